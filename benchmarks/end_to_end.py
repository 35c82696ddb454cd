"""What a user waits for: whole commands, each a new process, side by side in one run.

Rows (``--rows`` picks them by name, shell wildcards allowed, a leading '-' leaves out: ``--rows
'nii:*,bids:*,-*:cpu'``):

- ``nii:DEVICE`` and ``gz:DEVICE``: ``mppca-denoise IN OUT --noise N --rank R --device DEVICE --timings``
  on a DWI-like phantom (``--series``, default 96x96x60x300), .nii -> .nii and .nii.gz -> .nii.gz;
  ``nii:dwidenoise`` and ``gz:dwidenoise``: MRtrix3 ``dwidenoise IN OUT -noise N -nthreads CPUS`` on the same
  files (float32, its default), where it is on PATH.
- ``mode:DEVICE``: ours in dwidenoise's mode (``--extent auto --stride 1 --aggregation center --demean
  none``) on the .nii.
- ``seed:DEVICE``: the seed's problem (``--seed-series``, default 96x96x48x48: a rank-5 phantom on a baseline
  of 1000, noise 4) as a .nii, ``--extent 11 --stride 3 --demean voxel``.
- ``bids:DEVICE``: the BIDS app, ``mppca-nipype BIDS_DIR OUT participant --device DEVICE
  --skip-bids-validation`` on a dataset of ``--subjects`` subjects (default 8), each a DWI run (``--dwi``,
  default 96x96x60x100, with .bval/.bvec) and a BOLD run (``--bold``, default 64x64x40x300), .nii.gz,
  written by ``mppca_nipype.demo``; a new output and work directory each time (nothing reused).

DEVICE is ``cuda``, ``auto`` or ``cpu`` (the command's ``--device``). ``cuda-first`` and ``auto-first`` are
the same command on an empty Triton kernel cache (``TRITON_CACHE_DIR`` a new empty folder for that process),
what a user's first run pays to compile the GPU kernels; the other rows share one cache, filled by an untimed
run of each problem before the timed ones. Rows on the GPU (``cuda*``, ``auto*``) are skipped, with a note,
where no GPU is usable; so are dwidenoise's where it is not installed.

Each time is the wall time of the process, taken from outside. Ours also prints its phases (``--timings``:
start-up, checks, read, denoise and the engine's parts, write, total); the BIDS app's sidecars give each
denoised run's read, denoise and write, summed here over the runs. The rows run interleaved: ``--repeats``
rounds, each running every row once; each row's best and median, and the phases of its median run. With
``--baseline CHECKOUT`` each row of ours and of the BIDS app has a twin, ``NAME@baseline``, run from another
checkout of this repository right after it in every round, and a table sets the two side by side (a change's
effect, measured in one run).

Usage (from the repository root)::

    python benchmarks/end_to_end.py                        # the default rows at the default sizes
    python benchmarks/end_to_end.py --small --rows '*:cpu,*:dwidenoise'     # a check on a small CPU machine
    python benchmarks/end_to_end.py --subjects 4 --repeats 2 --budget 480 --rows 'nii:*,seed:*,bids:*'
    python benchmarks/end_to_end.py --rows seed:cuda,nii:cuda --repeats 4 --baseline ../before   # a change

Writes JSON to ``--out`` (default benchmarks/results/end_to_end.json) and the Markdown tables next to it
(``.md``) after every run, so that a run stopped from outside keeps what it finished; ``--budget`` starts
no round that would end past it. The tables are printed last.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
import fnmatch
import json
import os
from pathlib import Path
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import harness
from cpu_peers import DWIDENOISE_MODE, log, markdown_table, ours_env, pin_to_cores

REPO = harness.REPO
if str(REPO) not in sys.path:  # benchmark the package of this tree, installed or not
    sys.path.insert(0, str(REPO))

from mppca_nipype.phases import parse_line  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """Every generated series as (X, Y, Z, T), and the BIDS dataset's number of subjects."""

    series: tuple = (96, 96, 60, 300)  # the DWI-like phantom of the file-to-file rows
    seed: tuple = (96, 96, 48, 48)  # the seed's problem
    subjects: int = 8
    dwi: tuple = (96, 96, 60, 100)  # per subject of the BIDS dataset
    bold: tuple = (64, 64, 40, 300)


#: ``--small``: the same rows in a minute or two on two CPU cores.
SMALL = Sizes(series=(32, 32, 20, 60), seed=(32, 32, 24, 24), subjects=2, dwi=(24, 24, 16, 30),
              bold=(24, 24, 16, 40))

#: The seed's problem (``gpu_timing.SEED_OPTIONS``: 11^3 windows at stride 3, voxel demeaning).
SEED_OPTIONS = dict(extent=11, stride=3, demean="voxel")
#: The file-to-file problems: (input file, title, options of ours).
PROBLEMS = {
    "nii": ("series.nii", ".nii -> .nii", {}),
    "gz": ("series.nii.gz", ".nii.gz -> .nii.gz", {}),
    "seed": ("seed.nii", "the seed's problem, .nii -> .nii, " + " ".join(
        f"--{key} {value}" for key, value in SEED_OPTIONS.items()), SEED_OPTIONS),
    "mode": ("series.nii", "dwidenoise's mode, .nii -> .nii, " + " ".join(
        f"--{key} {value}" for key, value in DWIDENOISE_MODE.items()), DWIDENOISE_MODE),
}
#: Ours on each device; "-first": on an empty Triton kernel cache.
DEVICES = ("cuda-first", "cuda", "auto-first", "auto", "cpu")
#: The rows run when ``--rows`` is not given: the claims' rows. Left out: ``auto-first`` (the same kernels
#: compiled as by ``cuda-first``) and dwidenoise's mode (at the default size, minutes on the CPU; it belongs
#: beside ``dwidenoise``: ``--rows 'nii:*,mode:*'`` asks for both).
DEFAULT_ROWS = "nii:*,gz:*,seed:*,bids:*,-*:auto-first"


@dataclass(frozen=True)
class Row:
    name: str  # "nii:cuda-first"
    problem: str  # a key of PROBLEMS, or "bids"
    program: str  # "ours", "dwidenoise" or "bids"
    device: str | None = None  # ours' and the BIDS app's --device
    first_run: bool = False  # on an empty Triton cache
    baseline: bool = False  # ours from ``--baseline``'s checkout

    @property
    def on_gpu(self) -> bool:
        return self.device in ("cuda", "auto")


def all_rows() -> list[Row]:
    """Every row, in the order each round runs them."""
    rows = []
    for problem in PROBLEMS:
        for device in DEVICES:
            rows.append(Row(f"{problem}:{device}", problem, "ours", device.removesuffix("-first"),
                            device.endswith("-first")))
        if problem in ("nii", "gz"):
            rows.append(Row(f"{problem}:dwidenoise", problem, "dwidenoise"))
    rows += [Row(f"bids:{device}", "bids", "bids", device) for device in ("auto", "cuda", "cpu")]
    return rows


def select_rows(patterns: str, baseline=False) -> list[Row]:
    """The rows whose names match any of the comma-separated wildcard patterns and none of those given with
    a leading '-', in round order; with ``baseline``, each row of ours and of the BIDS app followed by its twin
    from the baseline checkout (``NAME@baseline``)."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    rows = all_rows()
    for pattern in wanted:
        if not any(fnmatch.fnmatchcase(row.name, pattern.removeprefix("-")) for row in rows):
            raise SystemExit(f"--rows: {pattern!r} matches no row (rows: {', '.join(r.name for r in rows)})")
    include = [p for p in wanted if not p.startswith("-")]
    exclude = [p[1:] for p in wanted if p.startswith("-")]
    chosen = [row for row in rows if any(fnmatch.fnmatchcase(row.name, p) for p in include)
              and not any(fnmatch.fnmatchcase(row.name, p) for p in exclude)]
    if not baseline:
        return chosen
    return [twin for row in chosen for twin in ([row, replace(row, name=f"{row.name}@baseline", baseline=True)]
                                                 if row.program in ("ours", "bids") else [row])]


# -- the programs --------------------------------------------------------------------------------------------

def program(script: str, module: str) -> list[str]:
    """How a user starts a command of the package: its console script beside this interpreter, or
    ``python -m module`` where it is not installed."""
    path = Path(sys.executable).with_name(script)
    return [str(path)] if path.is_file() else [sys.executable, "-m", module]


def gpu_reason_against() -> str | None:
    """Why ``--device cuda`` cannot run here (the engine's own sentence), or None when it can; asked in a new
    process so that torch is never loaded into this one."""
    probe = ("from mppca_nipype.engine import MPPCAInputError, check_device\n"
             "try:\n    check_device('cuda')\nexcept MPPCAInputError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ours_env(),
                          timeout=300)
    if done.returncode != 0:
        return f"the device check failed: {done.stderr.strip()[-300:]}"
    return done.stdout.strip().removeprefix("device 'cuda' was asked for but ") or None


# -- the inputs ----------------------------------------------------------------------------------------------

def write_inputs(folder: Path, sizes: Sizes, rows: list[Row], cpus: int) -> dict:
    """The files the selected rows read, written into ``folder``; returns {what: description}."""
    from mppca_nipype.demo import demo_subject_labels, write_demo_subject, write_raw_description, write_series
    from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom

    problems = {row.problem for row in rows}
    written = {}
    if problems & {"nii", "gz", "mode"}:
        noisy = dwi_phantom(sizes.series[:3], sizes.series[3], sigma=20.0, seed=0)[0]
        for name in ("series.nii", "series.nii.gz"):
            write_series(folder / name, noisy)
        written["series"] = f"{shape_text(sizes.series)} DWI-like phantom (b = 0 and 1000, noise 20), float32"
        del noisy
    if "seed" in problems:
        noisy = low_rank_phantom(sizes.seed[:3], sizes.seed[3], rank=5, sigma=4.0, baseline=1000.0, seed=0)[0]
        write_series(folder / "seed.nii", noisy)
        written["seed"] = f"{shape_text(sizes.seed)} rank-5 phantom on a baseline of 1000, noise 4, float32"
    if "bids" in problems:
        root = folder / "bids"
        labels = demo_subject_labels(sizes.subjects)
        write_raw_description(root, "mppca-nipype end-to-end benchmark", labels)
        # a subject's phantoms take seconds each: written side by side, each with its seeds as in the demo
        with ProcessPoolExecutor(max_workers=max(1, min(len(labels), cpus, 8))) as pool:
            jobs = [pool.submit(write_demo_subject, root, label, sizes.dwi[:3], sizes.dwi[3], sizes.bold[:3],
                                sizes.bold[3], seed=2 * number) for number, label in enumerate(labels)]
            for job in jobs:
                job.result()
        subjects = f"{sizes.subjects} subject{'s' if sizes.subjects != 1 else ''}"
        written["bids"] = (f"{subjects}, each a DWI run {shape_text(sizes.dwi)} (with .bval/.bvec) "
                           f"and a BOLD run {shape_text(sizes.bold)}, .nii.gz")
    return written


def shape_text(shape) -> str:
    return "x".join(str(s) for s in shape)


# -- one run of a row ----------------------------------------------------------------------------------------

def command_of(row: Row, folder: Path, out: Path, cpus: int) -> list[str]:
    """The command line of one run of ``row``: inputs in ``folder``, outputs into ``out``."""
    if row.program == "bids":  # (the baseline's package by its path: not this one's console script)
        starts = ([sys.executable, "-m", "mppca_nipype.cli.bids_app"] if row.baseline
                  else program("mppca-nipype", "mppca_nipype.cli.bids_app"))
        return [*starts, str(folder / "bids"),
                str(out / "derivatives"), "participant", "--device", row.device, "--skip-bids-validation",
                "--work-dir", str(out / "work")]
    source, _, options = PROBLEMS[row.problem]
    suffix = ".nii.gz" if source.endswith(".gz") else ".nii"
    if row.program == "dwidenoise":
        return ["dwidenoise", str(folder / source), str(out / f"denoised{suffix}"), "-noise",
                str(out / f"noise{suffix}"), "-nthreads", str(cpus), "-quiet"]
    flags = [item for key, value in options.items() for item in (f"--{key}", str(value))]
    # (the baseline's package by its path: not this one's console script)
    starts = [sys.executable, "-m", "mppca_nipype.cli.denoise"] if row.baseline else program(
        "mppca-denoise", "mppca_nipype.cli.denoise")
    return [*starts, str(folder / source),
            str(out / f"denoised{suffix}"), "--noise", str(out / f"noise{suffix}"), "--rank",
            str(out / f"rank{suffix}"), "--device", row.device, "--timings", *flags]


def shown_command(row: Row, folder: Path, cpus: int) -> str:
    """The command as the tables show it: the folders as DIR and OUT, the programs by name."""
    command = command_of(row, folder, Path("/OUT"), cpus)
    command[0] = Path(command[0]).name
    if command[0].startswith("python"):  # "python -m mppca_nipype.cli.denoise": as its console script
        command = [{"mppca_nipype.cli.denoise": "mppca-denoise"}.get(command[2], "mppca-nipype"), *command[3:]]
    return shlex.join(command).replace(str(folder), "DIR").replace("/OUT", "OUT")


#: ours' summary line: 'mppca-denoise: denoised 96x96x60x300 in 5.1 s (gpu on NVIDIA H200); ...'
_SUMMARY = re.compile(r"^mppca-denoise: denoised \S+ in \S+ s \((?P<where>[^)]*)\)", re.M)
_TIMINGS = re.compile(r"^mppca-denoise: timings: .*$", re.M)
_DONE = re.compile(r"^mppca-nipype: done in (?P<seconds>[\d.]+) s", re.M)


def run_once(row: Row, folder: Path, warm_cache: Path, cpus: int, timeout: float,
             participants=None, baseline: Path | None = None) -> dict:
    """One run of ``row`` as a new process, timed from outside; what it printed of its phases, read back.

    Returns {"wall_s", "status"} and, by program, "phases" and "ran_on" (ours), "app_done_s", "runs" and
    "phases" summed over them (the BIDS app), or "error". ``participants``: the BIDS app's
    ``--participant-label`` (the warm-up runs one subject). ``baseline``: the checkout a baseline row runs.
    """
    out = Path(tempfile.mkdtemp(prefix=f"{row.problem}-", dir=folder / "runs"))
    cache = Path(tempfile.mkdtemp(prefix="triton-empty-", dir=folder / "runs")) if row.first_run else warm_cache
    env = dict(ours_env(baseline) if row.baseline else ours_env(), TRITON_CACHE_DIR=str(cache))
    if row.program == "dwidenoise":
        env.update(OMP_NUM_THREADS=str(cpus), MRTRIX_QUIET="1")
    command = command_of(row, folder, out, cpus)
    if participants:
        command += ["--participant-label", *participants]
    try:
        started = time.perf_counter()
        try:
            # (in the baseline's checkout: ``python -m`` puts the working folder first on the path)
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout,
                                  cwd=baseline if row.baseline else None)
        except subprocess.TimeoutExpired:
            return dict(wall_s=round(time.perf_counter() - started, 3), status=None,
                        error=f"stopped after {timeout:g} s")
        record = dict(wall_s=round(time.perf_counter() - started, 3), status=done.returncode)
        if done.returncode != 0:
            record["error"] = " ".join(done.stderr.split())[-400:] or f"exit status {done.returncode}"
        elif row.program == "ours":
            record.update(read_ours(done.stderr))
        elif row.program == "bids":
            record.update(read_bids_app(done.stderr, out / "derivatives"))
        return record
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if row.first_run:
            shutil.rmtree(cache, ignore_errors=True)


def read_ours(stderr: str) -> dict:
    """The phases of ``--timings`` and where the engine ran, from what ``mppca-denoise`` printed."""
    found = {}
    timings = _TIMINGS.search(stderr)
    if timings is not None:
        found["phases"] = parse_line(timings.group())
    summary = _SUMMARY.search(stderr)
    if summary is not None:
        found["ran_on"] = summary["where"]
    return found


def read_bids_app(stderr: str, derivatives: Path) -> dict:
    """The app's own 'done in' time, and from each denoised run's sidecar its engine and phases; the phases
    summed over the runs (the runs overlap in time: these are run-seconds, not wall)."""
    found = {}
    done = _DONE.search(stderr)
    if done is not None:
        found["app_done_s"] = float(done["seconds"])
    runs, summed, engines = [], {}, {}
    for sidecar in sorted(derivatives.rglob("*_desc-denoised_*.json")):
        provenance = json.loads(sidecar.read_text()).get("MPPCADenoising")
        if not provenance:
            continue
        where = provenance["Backend"] + ("" if provenance["Device"] == provenance["Backend"]
                                         else f" on {provenance['Device']}")
        engines[where] = engines.get(where, 0) + 1
        timings = provenance.get("Timings", {})
        runs.append(dict(run=sidecar.name, ran_on=where, phases=timings))
        for phase, value in timings.items():
            if phase == "total":
                continue
            seconds = value["seconds"] if isinstance(value, dict) else value
            summed[phase] = round(summed.get(phase, 0.0) + seconds, 3)
    found.update(runs=runs, denoised_runs=len(runs), phases=summed,
                 ran_on=", ".join(f"{where} ({count} runs)" for where, count in engines.items()))
    if runs:
        found["longest_run_s"] = max(run["phases"].get("total", 0.0) for run in runs)
    return found


# -- the whole run -------------------------------------------------------------------------------------------

def summarise(row: Row, runs: list[dict]) -> dict:
    """Best and median of the row's runs, and the run of median wall time (of two, the faster) as its
    timeline."""
    good = [run for run in runs if "error" not in run]
    summary = dict(name=row.name, problem=row.problem, program=row.program, device=row.device,
                   first_run=row.first_run, runs=runs)
    if len(good) < len(runs):
        summary["failed_runs"] = len(runs) - len(good)
        summary["error"] = next(run["error"] for run in runs if "error" in run)
    if good:
        walls = sorted(run["wall_s"] for run in good)
        summary.update(best_s=walls[0], median_s=round(statistics.median(walls), 3))
        median_run = sorted(good, key=lambda run: run["wall_s"])[(len(good) - 1) // 2]
        summary["timeline"] = {key: median_run[key] for key in ("wall_s", "phases", "ran_on", "app_done_s",
                                                                "denoised_runs", "longest_run_s")
                               if key in median_run}
    return summary


def warm_up(rows: list[Row], folder: Path, warm_cache: Path, cpus: int, timeout: float, baseline=None):
    """Untimed runs before the rounds: ours once on a tiny series on the CPU (the files every process loads
    come into the page cache), and each problem that has a warm GPU row once on the GPU, filling the shared
    Triton cache (.nii and .nii.gz once for both; the BIDS app on its first subject only)."""
    if any(row.program in ("ours", "bids") for row in rows):
        import numpy as np

        from mppca_nipype.demo import write_series

        tiny = np.random.default_rng(0).standard_normal((12, 12, 12, 16)).astype(np.float32)
        write_series(folder / "warm-up.nii", tiny)
        log("warm-up: a tiny series on the CPU")
        done = subprocess.run([*program("mppca-denoise", "mppca_nipype.cli.denoise"), str(folder / "warm-up.nii"),
                               str(folder / "runs" / "warm-up-out.nii"), "--device", "cpu", "--quiet"],
                              capture_output=True, text=True, env=ours_env(), timeout=timeout)
        if done.returncode != 0:
            log(f"  the warm-up failed: {done.stderr.strip()[-400:]}")
    filled = set()
    for row in rows:
        # .nii and .nii.gz: the same series and options, so the same kernels
        kernels = ("nii" if row.problem == "gz" else row.problem, row.baseline)
        if row.on_gpu and not row.first_run and kernels not in filled:
            filled.add(kernels)
            labels = None
            if row.program == "bids":
                from mppca_nipype.demo import demo_subject_labels

                labels = demo_subject_labels(1)
            log(f"warm-up: {row.problem} on the GPU (filling the Triton cache)")
            record = run_once(replace(row, device="cuda"), folder, warm_cache, cpus, timeout, participants=labels,
                              baseline=baseline)
            if "error" in record:
                log(f"  the warm-up failed: {record['error']}")


def check(record: dict, what: str):
    if "error" in record:
        log(f"  {what} failed: {record['error']}")


def measure(args, rows: list[Row], sizes: Sizes, cpus: int, started: float, save) -> None:
    """Write the inputs, warm up, run the rounds; ``save(result)`` after each round (so that a run stopped
    from outside keeps the rounds it finished), the last time with every round."""
    notes = []
    reason = gpu_reason_against() if any(row.on_gpu for row in rows) else None
    if reason is not None:
        skipped = [row.name for row in rows if row.on_gpu]
        notes.append(f"No usable GPU ({reason}): rows {', '.join(skipped)} not run.")
        rows = [row for row in rows if not row.on_gpu]
    dwidenoise = harness.dwidenoise_version()
    if dwidenoise is None and any(row.program == "dwidenoise" for row in rows):
        skipped = [row.name for row in rows if row.program == "dwidenoise"]
        notes.append(f"MRtrix3's dwidenoise is not on PATH: rows {', '.join(skipped)} not run.")
        rows = [row for row in rows if row.program != "dwidenoise"]
    for note in notes:
        log(note)

    base = Path(tempfile.mkdtemp(prefix="mppca-end-to-end-", dir=args.work))
    try:
        (base / "runs").mkdir()
        warm_cache = base / "triton-warm"
        warm_cache.mkdir()
        began = time.perf_counter()
        inputs = write_inputs(base, sizes, rows, cpus)
        log(f"inputs written in {time.perf_counter() - began:.1f} s: {inputs}")
        warm_up(rows, base, warm_cache, cpus, args.timeout, args.baseline)
        commands = {row.name: shown_command(row, base, cpus) for row in rows}
        runs = {row.name: [] for row in rows}

        def result(rounds, unfinished=None):
            return dict(inputs=inputs, notes=notes, rounds=rounds, unfinished_round=unfinished,
                        commands=commands, rows=[summarise(row, runs[row.name]) for row in rows])

        for round_number in range(1, args.repeats + 1):
            began = time.perf_counter()
            for done, row in enumerate(rows, 1):
                record = run_once(row, base, warm_cache, cpus, args.timeout, baseline=args.baseline)
                runs[row.name].append(record)
                log(f"round {round_number}/{args.repeats}: {row.name}: {record['wall_s']:.2f} s"
                    + (f" (failed: {record['error']})" if "error" in record else ""))
                save(result(round_number, None) if done == len(rows) else
                     result(round_number - 1, dict(round=round_number, rows_done=done)))
            elapsed, last = time.perf_counter() - started, time.perf_counter() - began
            if round_number < args.repeats and args.budget and elapsed + last > args.budget:
                notes.append(f"{round_number} of {args.repeats} rounds: another ({last:.0f} s) would have "
                             f"ended past the budget of {args.budget:g} s (--budget).")
                log(notes[-1])
                save(result(round_number))
                break
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- tables --------------------------------------------------------------------------------------------------

def seconds_cell(summary: dict | None) -> str:
    """'14.30 / 14.52' (best / median), 'failed', or '—' (not run)."""
    if summary is None:
        return "—"
    if "best_s" not in summary:
        return "failed"
    cell = f"{summary['best_s']:.2f} / {summary['median_s']:.2f}"
    return cell + (" ‡" if "error" in summary else "")


def file_table(report: dict) -> str:
    by_name = {row["name"]: row for row in report["rows"]}
    columns = [("GPU, first run", "cuda-first"), ("GPU, warm", "cuda"), ("auto, first run", "auto-first"),
               ("auto, warm", "auto"), ("CPU", "cpu"), ("dwidenoise", "dwidenoise")]
    lines = []
    for problem, (source, title, _) in PROBLEMS.items():
        cells = [by_name.get(f"{problem}:{key}") for _, key in columns]
        if any(cells):
            size = report["settings"]["sizes"]["seed" if problem == "seed" else "series"]
            lines.append([f"{shape_text(size)}, {title}", *map(seconds_cell, cells)])
    if not lines:
        return ""
    return markdown_table(["series", *(name for name, _ in columns)], lines)


def baseline_table(report: dict) -> str:
    """Each row of ours beside its twin from the baseline checkout: best / median, and the median's ratio."""
    by_name = {row["name"]: row for row in report["rows"]}
    lines = []
    for row in report["rows"]:
        twin = by_name.get(f"{row['name']}@baseline")
        if twin is None:
            continue
        ratio = (f"{row['median_s'] / twin['median_s']:.2f}x" if "median_s" in row and "median_s" in twin
                 else "—")
        lines.append([f"`{row['name']}`", seconds_cell(row), seconds_cell(twin), ratio])
    if not lines:
        return ""
    return markdown_table(["row", "this checkout", "the baseline", "median / the baseline's"], lines)


def bids_table(report: dict) -> str:
    rows = [row for row in report["rows"] if row["program"] == "bids"]
    if not rows:
        return ""
    lines = []
    for row in rows:
        timeline = row.get("timeline", {})
        phases = timeline.get("phases", {})
        twin = " (the baseline)" if row["name"].endswith("@baseline") else ""
        lines.append([f"`--device {row['device']}`{twin}",
                      seconds_cell(row), fmt(timeline.get("app_done_s")),
                      str(timeline.get("denoised_runs", "—")), timeline.get("ran_on", "—"),
                      *(fmt(phases.get(phase)) for phase in ("read", "denoise", "write")),
                      fmt(timeline.get("longest_run_s"))])
    return markdown_table(["device", "best / median s", "app's own s", "runs denoised", "ran on",
                           "Σ read s", "Σ denoise s", "Σ write s", "longest run s"], lines)


def timeline_table(report: dict) -> str:
    """Per row of ours: the phases of its median run, and what the process spent outside them (wall time
    less the command's own total: the interpreter's exit, the teardown of the engine)."""
    rows = [row for row in report["rows"] if row["program"] != "bids" and "timeline" in row]
    if not rows:
        return ""
    names = []
    for row in rows:
        for phase in row["timeline"].get("phases", {}):
            if phase != "total" and phase not in names:
                names.append(phase)
    lines = []
    for row in rows:
        timeline = row["timeline"]
        phases = timeline.get("phases", {})
        cells = [f"`{row['name']}`", f"{timeline['wall_s']:.2f}"]
        for phase in names:
            value = phases.get(phase)
            if isinstance(value, dict):
                parts = ", ".join(f"{part} {s:.2f}" for part, s in value["parts"].items())
                cells.append(f"{value['seconds']:.2f} ({parts})")
            else:
                cells.append(fmt(value))
        total = phases.get("total")
        cells += [fmt(total), fmt(None if total is None else timeline["wall_s"] - total),
                  timeline.get("ran_on", "—")]
        lines.append(cells)
    return markdown_table(["row", "wall s", *(f"{phase} s" for phase in names), "total s (its own)",
                           "outside s", "ran on"], lines)


def rounds_text(report: dict) -> str:
    """'3 rounds', '2 rounds of the 3 asked for', with '; round 3 stopped after 4 of its 9 rows' when the
    run was stopped from outside."""
    done, asked = report["rounds"], report["settings"]["repeats"]
    text = f"{done} round{'s' if done != 1 else ''}" + (f" of the {asked} asked for" if done != asked else "")
    unfinished = report.get("unfinished_round")
    if unfinished:
        text += (f"; round {unfinished['round']} stopped after {unfinished['rows_done']} of its "
                 f"{len(report['rows'])} rows")
    return text


def fmt(value, spec=".2f") -> str:
    return "—" if value is None else format(value, spec)


def report_markdown(report: dict) -> str:
    run, settings = report["stamp"], report["settings"]
    lines = [harness.stamp_markdown(run), "",
             f"Each row a new process, timed from outside, in interleaved rounds that each run every row "
             f"once ({rounds_text(report)}); best / median seconds. {settings['cpus']} CPUs (dwidenoise's "
             "`-nthreads`; ours and the BIDS app use every CPU they may, by default). \"First run\": an empty "
             "Triton kernel cache for that process; \"warm\": a cache filled by an earlier run.", ""]
    lines += [f"Inputs: {text}." for text in report["inputs"].values()]
    lines += [""] + report["notes"] + ([""] if report["notes"] else [])
    table = file_table(report)
    if table:
        lines += ["**File to file** (`mppca-denoise IN OUT --noise N --rank R --device D`; `dwidenoise IN OUT "
                  "-noise N -nthreads C`):", "", table, ""]
    table = baseline_table(report)
    if table:
        baseline = report["settings"]["baseline"]
        lines += [f"**Against the baseline** (commit {baseline['commit'] or 'unknown'}, `--baseline`; its rows "
                  "interleaved with this checkout's in each round, best / median s):", "", table, ""]
    table = bids_table(report)
    if table:
        lines += [f"**The BIDS app** (`mppca-nipype BIDS_DIR OUT participant --device D "
                  f"--skip-bids-validation`, reports on, a new output and work directory each time) on "
                  f"{report['inputs'].get('bids', 'the dataset')}. Σ: summed over the runs, from their sidecars "
                  "(the runs overlap in time); the app's own: its 'done in', from its start to its end "
                  "(the interpreter's start and the imports before it not counted):", "", table, ""]
    table = timeline_table(report)
    if table:
        lines += ["**Where the time goes** (the `--timings` line of each row's median run; outside: the wall "
                  "time less the command's own total):", "", table, ""]
    if any("error" in row for row in report["rows"]):
        lines += ["‡ some runs failed: " + "; ".join(f"{row['name']}: {row['error'][:200]}"
                                                      for row in report["rows"] if "error" in row), ""]
    lines += ["Commands (inputs in DIR, outputs in OUT):", ""]
    lines += [f"- `{name}`: `{command}`" for name, command in report["commands"].items()]
    lines += ["", harness.load_note(run)]
    return "\n".join(lines)


# -- the command line ----------------------------------------------------------------------------------------

def parse_series(text: str) -> tuple:
    shape = tuple(int(s) for s in text.split(","))
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"a series is four positive integers X,Y,Z,T, not {text!r}")
    return shape


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Sizes()
    parser.add_argument("--rows", default=DEFAULT_ROWS,
                        help="comma-separated row names, wildcards allowed; a leading '-' leaves the rows it "
                             f"matches out (default {DEFAULT_ROWS}; see below)")
    parser.add_argument("--small", action="store_true",
                        help=f"small sizes, one or two minutes on two cores: series {shape_text(SMALL.series)}, "
                             f"seed {shape_text(SMALL.seed)}, {SMALL.subjects} subjects (DWI "
                             f"{shape_text(SMALL.dwi)}, BOLD {shape_text(SMALL.bold)}); sizes given apart win")
    parser.add_argument("--series", type=parse_series, metavar="X,Y,Z,T",
                        help=f"the DWI-like phantom of the file-to-file rows (default {shape_text(defaults.series)})")
    parser.add_argument("--seed-series", type=parse_series, metavar="X,Y,Z,T",
                        help=f"the seed's problem (default {shape_text(defaults.seed)})")
    parser.add_argument("--subjects", type=int, help=f"subjects of the BIDS dataset (default {defaults.subjects})")
    parser.add_argument("--dwi", type=parse_series, metavar="X,Y,Z,T",
                        help=f"each subject's DWI run (default {shape_text(defaults.dwi)})")
    parser.add_argument("--bold", type=parse_series, metavar="X,Y,Z,T",
                        help=f"each subject's BOLD run (default {shape_text(defaults.bold)})")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; every row runs once in each (default 3)")
    parser.add_argument("--threads", type=int,
                        help="restrict the run to this many CPUs (default: every CPU this process may use)")
    parser.add_argument("--budget", type=float, metavar="SECONDS",
                        help="start no round that would end past this many seconds from the start, judged by the "
                             "round before (the first round always runs; default: no limit)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="stop a run that takes longer than this, in seconds, and mark it failed (default 600)")
    parser.add_argument("--work", type=Path, help="where the inputs and outputs go while it runs (default: the "
                                                  "system's temporary folder)")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="a checkout (or export) of this repository whose mppca-denoise runs beside this one's: "
                             "each row of ours gets a twin NAME@baseline in every round; its commit is read with "
                             f"git, else from ${BASELINE_COMMIT}")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "end_to_end.json",
                        help="JSON output; the Markdown goes next to it as .md")
    return parser


#: Where ``--baseline``'s commit is read from when its checkout has no git history (an export).
BASELINE_COMMIT = "BASELINE_COMMIT"


def baseline_commit(checkout: Path) -> str | None:
    """The commit of the ``--baseline`` checkout: git's, else ``$BASELINE_COMMIT``, else None."""
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else os.environ.get(BASELINE_COMMIT)


def main(argv=None):
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    base = SMALL if args.small else Sizes()
    sizes = Sizes(series=args.series or base.series, seed=args.seed_series or base.seed,
                  subjects=args.subjects or base.subjects, dwi=args.dwi or base.dwi, bold=args.bold or base.bold)
    if min(sizes.seed[:3]) < SEED_OPTIONS["extent"]:
        parser.error(f"--seed-series: every side must be at least the extent {SEED_OPTIONS['extent']}")
    if args.repeats < 1 or sizes.subjects < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--repeats, --subjects and --threads must be at least 1")
    if args.baseline is not None and not (args.baseline / "mppca_nipype" / "__init__.py").is_file():
        parser.error(f"--baseline {args.baseline}: no mppca_nipype package there")
    rows = select_rows(args.rows, baseline=args.baseline is not None)
    pinned = pin_to_cores(args.threads) if args.threads else []
    from mppca_nipype.engine.backend import available_cpus

    cpus = available_cpus()
    run = harness.stamp()
    settings = dict(rows=[row.name for row in rows], sizes=asdict(sizes), repeats=args.repeats, cpus=cpus,
                    pinned_cpus=pinned, timeout_s=args.timeout, budget_s=args.budget,
                    baseline=None if args.baseline is None else dict(path=str(args.baseline),
                                                                     commit=baseline_commit(args.baseline)))
    log(f"{run['hardware']['cpu_model']}: {cpus} CPUs; {harness.load_line(run)}; rows {', '.join(settings['rows'])}")
    finished = {}

    def save(result):
        report = dict(stamp=dict(run, load_average=dict(run["load_average"])), settings=settings, **result)
        harness.finish(report["stamp"])
        markdown = report_markdown(report)
        finished.update(markdown=markdown, written=harness.write_result(args.out, report, markdown))

    measure(args, rows, sizes, cpus, started, save)
    log("wrote " + " and ".join(map(str, finished["written"])))
    print(finished["markdown"])


if __name__ == "__main__":
    main()
