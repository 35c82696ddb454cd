"""CPU engine scaling: wall time of one run at nprocs = 1, 2, 4, 8, 16 (each in a fresh process).

    python benchmarks/cpu_scaling.py --shape 96,96,60 --volumes 100 --workers 1,2,4,8,16
    python benchmarks/cpu_scaling.py --profile --shape 96,96,60 --volumes 100 --workers 1,2,4,8,16
    python benchmarks/cpu_scaling.py --workers 1 --batch-mb 48,24,12,6,3      # the batch size, one worker
    python benchmarks/cpu_scaling.py --quick --out /tmp/cpu_scaling.json      # a smoke test in seconds

Each worker count runs in a new interpreter (so that no pool or cache carries over): a warm-up call on a
16^3 corner, then one timed ``denoise(noisy, device="cpu", nprocs=N)`` with the defaults on the DWI phantom
(sigma 20). Writes JSON (stamped by ``harness.stamp()``: commit, date, hardware, load average at start and
end, versions, command) to ``--out`` and the Markdown table (workers, wall s, speed-up, efficiency) next to
it; prints the table.

``--profile`` times the engine's phases (``mppca_nipype.engine.cpu.PROFILE``) and adds a second table: per
phase, the seconds summed over the workers at each worker count and the efficiency against one worker (its
seconds over theirs: 100% when the phase costs the same CPU time whatever the number of workers), then the
parent's serial phases, the workers' time outside units, the slowest worker's busy time against the mean
(balance), the threads per worker and the thread pools threadpoolctl found in them. The JSON keeps each
run's whole profile (per worker and per unit).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import subprocess
import sys

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402

#: One timed run in a fresh interpreter; prints its seconds and the engine's info as JSON.
CHILD = """
import json, resource, sys, time
from mppca_nipype import denoise
from mppca_nipype.engine import cpu
from mppca_nipype.phantoms import dwi_phantom
shape = tuple(int(s) for s in sys.argv[1].split(",")); volumes = int(sys.argv[2]); workers = int(sys.argv[3])
cpu.PROFILE = sys.argv[4] == "profile"
if sys.argv[5] != "default":
    cpu.BATCH_BYTES = int(float(sys.argv[5]) * 2**20)
noisy = dwi_phantom(shape, volumes, sigma=20.0)[0]
denoise(noisy[:16, :16, :16], device="cpu", nprocs=workers)  # warm-up: imports, pool start
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
started = time.perf_counter()
result = denoise(noisy, device="cpu", nprocs=workers)
seconds = time.perf_counter() - started
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults  # this process's: all of them on 1 worker
print(json.dumps(dict(seconds=seconds, batch_mb=cpu.BATCH_BYTES / 2**20, minor_faults=faults,
                      eigensolver=result.info["eigensolver"], windows=result.info["n_windows"],
                      phases=result.info["seconds"], profile=result.info.get("profile"))))
"""


def run_workers(shape: str, volumes: int, workers: int, profile: bool, batch_mb: str = "default") -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(harness.REPO),
                                                                    os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", CHILD, shape, str(volumes), str(workers),
                           "profile" if profile else "plain", batch_mb], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"cpu_scaling: the run with {workers} workers failed:\n{done.stderr[-2000:]}")
    return dict(workers=workers, **json.loads(done.stdout.strip().splitlines()[-1]))


def table(result: dict) -> str:
    rows = result["rows"]
    base = rows[0]["seconds"] * rows[0]["workers"]
    lines = [f"{result['shape']} x {result['volumes']} volumes, the defaults, {rows[0]['windows']} windows, "
             f"eigensolver {rows[0]['eigensolver']}; one run per worker count, each in a new process after a "
             "warm-up call.", "",
             "| workers | batch MB | wall s | speed-up | efficiency | minor page faults (caller) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        speedup = base / row["seconds"]
        lines.append(f"| {row['workers']} | {row['batch_mb']:g} | {row['seconds']:.2f} | {speedup:.2f} | "
                     f"{speedup / row['workers']:.0%} | {row['minor_faults']:,} |")
    return "\n".join(lines)


def phase_table(result: dict) -> str:
    """Per phase: worker-seconds (summed over the workers) and efficiency against the first worker count."""
    rows = result["rows"]
    profiles = [row["profile"] for row in rows]
    worker_phases = list(dict.fromkeys(p for prof in profiles for w in prof["workers"] for p in w["phases"]))
    parent_phases = list(dict.fromkeys(p for prof in profiles for p in prof["parent"]))

    def worker_sum(prof, phase):
        return sum(w["phases"].get(phase, 0.0) for w in prof["workers"])

    def outside(prof):  # the workers' time between their first unit's start and last unit's end not in units
        return sum(w["span"] - w["busy"] for w in prof["workers"])

    def busy(prof):
        return sum(w["busy"] for w in prof["workers"])

    base = profiles[0]
    scale = rows[0]["workers"]  # efficiency against this many workers' CPU time
    header = "| phase | " + " | ".join(f"{row['workers']} w: s | eff" for row in rows) + " |"
    lines = ["Worker-seconds per phase (summed over the workers) and efficiency against "
             f"{scale} worker{'s' * (scale > 1)} (its seconds over these: 100% = the same CPU time).", "",
             header, "| --- |" + " --- | --- |" * len(rows)]

    def cells(values, reference):
        out = []
        for value in values:
            eff = f"{reference / value:.0%}" if value > 0 and reference > 0 else ""
            out.append(f"{value:.2f} | {eff}")
        return " | ".join(out)

    for phase in worker_phases:
        lines.append(f"| {phase} | {cells([worker_sum(p, phase) for p in profiles], worker_sum(base, phase))} |")
    lines.append(f"| **in units** | {cells([busy(p) for p in profiles], busy(base))} |")
    lines.append("| CPU seconds in units | " + " | ".join(f"{sum(w['cpu'] for w in p['workers']):.2f} | "
                                                         for p in profiles) + " |")
    lines.append("| outside units | " + " | ".join(f"{outside(p):.2f} | " for p in profiles) + " |")
    lines.append("| balance (slowest / mean busy) | " + " | ".join(
        f"{max(w['busy'] for w in p['workers']) / (busy(p) / len(p['workers'])):.2f} | " for p in profiles) + " |")
    for phase in parent_phases:
        lines.append(f"| parent: {phase} | " + " | ".join(f"{p['parent'].get(phase, 0.0):.2f} | "
                                                         for p in profiles) + " |")
    serial = [sum(v for k, v in p["parent"].items() if k != "waiting") for p in profiles]
    lines.append("| **parent, serial** | " + " | ".join(f"{v:.2f} | " for v in serial) + " |")
    lines.append("| engine wall | " + " | ".join(f"{p['wall']:.2f} | " for p in profiles) + " |")
    efficiency = [rows[0]["seconds"] * scale / row["seconds"] / row["workers"] for row in rows]
    lines.append("| denoise() wall | " + " | ".join(f"{row['seconds']:.2f} | {eff:.0%}"
                                                    for row, eff in zip(rows, efficiency)) + " |")
    lines.append("| denoise(): output | " + " | ".join(f"{row['phases'].get('output', 0.0):.2f} | "
                                                       for row in rows) + " |")
    lines.append("")
    for row, prof in zip(rows, profiles):
        threads = sorted({w["threads"] for w in prof["workers"]}, key=str)
        pools = sorted({f"{pool['library']} ({pool['api']}) {pool['threads']}" for w in prof["workers"]
                        for pool in w["threadpools"]})
        lines.append(f"- {row['workers']} workers, {prof['n_units']} units: threads per worker "
                     f"{', '.join(map(str, threads))}; thread pools: {'; '.join(pools) or 'none found'}.")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help="phantom size X,Y,Z (default 96,96,60; --quick: 24,24,16)")
    parser.add_argument("--volumes", type=int, default=None, help="volumes (default 100; --quick: 30)")
    parser.add_argument("--workers", default=None, help="worker counts (default 1,2,4,8,16; --quick: 1,2)")
    parser.add_argument("--quick", action="store_true", help="a small phantom and 1, 2 workers: a smoke test")
    parser.add_argument("--batch-mb", default=None,
                        help="batch sizes in MB (engine.cpu.BATCH_BYTES) to time in turn at each worker count")
    parser.add_argument("--profile", action="store_true",
                        help="time the engine's phases in the workers and the parent; print a table per phase")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "cpu_scaling.json",
                        help="JSON output; the Markdown goes next to it as .md")
    args = parser.parse_args(argv)
    shape = args.shape or ("24,24,16" if args.quick else "96,96,60")
    volumes = args.volumes or (30 if args.quick else 100)
    workers = [int(w) for w in (args.workers or ("1,2" if args.quick else "1,2,4,8,16")).split(",")]

    run = harness.stamp()
    batches = args.batch_mb.split(",") if args.batch_mb else ["default"]
    rows = [run_workers(shape, volumes, n, args.profile, mb) for n in workers for mb in batches]
    result = dict(stamp=run, shape=shape, volumes=volumes, profiled=args.profile, rows=rows)
    harness.finish(run)
    tables = table(result) + ("\n\n" + phase_table(result) if args.profile else "")
    markdown = tables + "\n\n" + harness.stamp_markdown(run) + "\n\n" + harness.load_note(run)
    harness.write_result(args.out, result, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
