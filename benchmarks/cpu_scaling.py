"""CPU engine scaling: wall time of one run at nprocs = 1, 2, 4, 8, 16 (each in a fresh process).

    python benchmarks/cpu_scaling.py --shape 96,96,60 --volumes 100 --workers 1,2,4,8,16
    python benchmarks/cpu_scaling.py --quick --out /tmp/cpu_scaling.json      # a smoke test in seconds

Each worker count runs in a new interpreter (so that no pool or cache carries over): a warm-up call on a
16^3 corner, then one timed ``denoise(noisy, device="cpu", nprocs=N)`` with the defaults on the DWI phantom
(sigma 20). Writes JSON (stamped by ``harness.stamp()``: commit, date, hardware, load average at start and
end, versions, command) to ``--out`` and the Markdown table (workers, wall s, speed-up, efficiency) next to
it; prints the table.
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
import json, sys, time
from mppca_nipype import denoise
from mppca_nipype.phantoms import dwi_phantom
shape = tuple(int(s) for s in sys.argv[1].split(",")); volumes = int(sys.argv[2]); workers = int(sys.argv[3])
noisy = dwi_phantom(shape, volumes, sigma=20.0)[0]
denoise(noisy[:16, :16, :16], device="cpu", nprocs=workers)  # warm-up: imports, pool start
started = time.perf_counter()
result = denoise(noisy, device="cpu", nprocs=workers)
seconds = time.perf_counter() - started
print(json.dumps(dict(seconds=seconds, eigensolver=result.info["eigensolver"], windows=result.info["n_windows"])))
"""


def run_workers(shape: str, volumes: int, workers: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(harness.REPO),
                                                                    os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", CHILD, shape, str(volumes), str(workers)], capture_output=True,
                          text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"cpu_scaling: the run with {workers} workers failed:\n{done.stderr[-2000:]}")
    return dict(workers=workers, **json.loads(done.stdout.strip().splitlines()[-1]))


def table(result: dict) -> str:
    rows = result["rows"]
    base = rows[0]["seconds"] * rows[0]["workers"]
    lines = [f"{result['shape']} x {result['volumes']} volumes, the defaults, {rows[0]['windows']} windows, "
             f"eigensolver {rows[0]['eigensolver']}; one run per worker count, each in a new process after a "
             "warm-up call.", "", "| workers | wall s | speed-up | efficiency |", "| --- | --- | --- | --- |"]
    for row in rows:
        speedup = base / row["seconds"]
        lines.append(f"| {row['workers']} | {row['seconds']:.2f} | {speedup:.2f} | {speedup / row['workers']:.0%} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help="phantom size X,Y,Z (default 96,96,60; --quick: 24,24,16)")
    parser.add_argument("--volumes", type=int, default=None, help="volumes (default 100; --quick: 30)")
    parser.add_argument("--workers", default=None, help="worker counts (default 1,2,4,8,16; --quick: 1,2)")
    parser.add_argument("--quick", action="store_true", help="a small phantom and 1, 2 workers: a smoke test")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "cpu_scaling.json",
                        help="JSON output; the Markdown goes next to it as .md")
    args = parser.parse_args(argv)
    shape = args.shape or ("24,24,16" if args.quick else "96,96,60")
    volumes = args.volumes or (30 if args.quick else 100)
    workers = [int(w) for w in (args.workers or ("1,2" if args.quick else "1,2,4,8,16")).split(",")]

    run = harness.stamp()
    rows = [run_workers(shape, volumes, n) for n in workers]
    result = dict(stamp=run, shape=shape, volumes=volumes, rows=rows)
    harness.finish(run)
    markdown = table(result) + "\n\n" + harness.stamp_markdown(run) + "\n\n" + harness.load_note(run)
    harness.write_result(args.out, result, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
