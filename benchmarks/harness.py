"""What every benchmark result carries so that a reader can judge and repeat it.

Each script of this folder calls ``stamp()`` when it starts, keeps the dict under its result's ``"stamp"``
key, and saves with ``write_result``::

    from harness import finish, stamp, stamp_markdown, write_result

    run = stamp()                                   # commit, date, hardware, load, versions, command
    result = dict(stamp=run, rows=measure())
    finish(run)                                     # the load average at the end, the elapsed time
    write_result(out, result, markdown=stamp_markdown(run) + "\n\n" + table(result))

The stamp holds the git commit (full hash) and whether the files that make the numbers (``mppca_nipype/``
and ``benchmarks/*.py``) differ from it, the date (ISO 8601, UTC), the hardware (CPU model, logical CPUs,
the CPUs this process may use, memory; the GPUs and their driver and CUDA versions when torch sees any),
the load average at the start and the end (the end includes the benchmark's own work: a quiet machine
reads near 0 at the start), the versions of the libraries that are installed, and the exact command line.

torch is never imported into the calling process (it takes seconds and brings its own BLAS and OpenMP
runtimes, which would change what a CPU run measures): a short-lived interpreter asks torch about the GPUs,
unless the caller has already initialised CUDA.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
from pathlib import Path
import platform
import shlex
import shutil
import subprocess
import sys

REPO = Path(__file__).resolve().parents[1]

#: The paths whose uncommitted changes make a result "dirty": the package and the benchmark scripts.
MEASURED_PATHS = ("mppca_nipype", "benchmarks", ":(exclude)benchmarks/results")
#: The commit of a copy of the tree whose git folder is missing or not its own (a tree sent to a GPU machine), when
#: set: ``stamp()["commit"]`` (``dirty`` is then unknown, None). Set it to ``git rev-parse HEAD`` of the
#: tree that was copied, clean.
COMMIT_VARIABLE = "BENCHMARK_COMMIT"
#: Distributions whose versions are recorded when installed (distribution names, as pip knows them).
LIBRARIES = ("mppca-nipype", "numpy", "scipy", "threadpoolctl", "torch", "triton", "nvmath-python", "nibabel",
             "nipype", "dipy", "patch-denoise")

#: Run in a fresh interpreter: ``torch_gpus()`` as JSON, without loading torch into the caller's process.
_TORCH_QUERY = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import harness; " \
               "print(json.dumps(harness.torch_gpus()))"


def stamp() -> dict:
    """Everything about this run that is known before it measures anything.

    Returns a JSON-serialisable dict: ``commit`` (full hash; ``$BENCHMARK_COMMIT`` when set; None outside a
    git checkout), ``dirty`` (bool; None when unknown),
    ``dirty_files`` (those changed files), ``date`` (ISO 8601, UTC), ``hardware`` (see ``hardware()``),
    ``load_average`` (``{"start": [1, 5, 15 min]}``; ``finish`` adds ``"end"``), ``versions`` (see
    ``versions()``), ``python``, ``bytecode_cached`` (whether new processes may keep compiled modules),
    ``platform``, ``command`` (the interpreter and ``sys.argv``, shell-quoted),
    ``argv`` (the same as a list) and ``cwd``. Call it after pinning the process to its CPUs, so that
    ``hardware["usable_cpus"]`` says which ones the run had.
    """
    changed = _git("status", "--porcelain", "--", *MEASURED_PATHS)
    commit = _git("rev-parse", "HEAD")
    if os.environ.get(COMMIT_VARIABLE):  # a copy of the tree whose git folder is not its own: as the caller says
        commit, changed = os.environ[COMMIT_VARIABLE], None
    argv = [sys.executable, *sys.argv]
    return dict(
        commit=commit.strip() if commit else None,
        dirty=bool(changed.strip()) if changed is not None else None,
        # porcelain lines are "XY path" or "XY old -> new"
        dirty_files=[line[3:].split(" -> ")[-1] for line in changed.splitlines() if line] if changed else [],
        date=_now(),
        hardware=hardware(),
        load_average=dict(start=_load_average()),
        versions=versions(),
        python=platform.python_version(),
        # False where PYTHONDONTWRITEBYTECODE is set: every new process then compiles the modules it imports
        # that have no cached bytecode (seconds for torch), which a normal install does not
        bytecode_cached=not sys.dont_write_bytecode,
        platform=platform.platform(),
        command=shlex.join(argv),
        argv=argv,
        cwd=os.getcwd(),
    )


def finish(run: dict) -> dict:
    """Add what is known at the end to a ``stamp()``: ``load_average["end"]``, ``finished`` (ISO, UTC) and
    ``elapsed_seconds``. Returns the same dict; a second call changes nothing."""
    if "end" not in run["load_average"]:
        run["load_average"]["end"] = _load_average()
        run["finished"] = _now()
        run["elapsed_seconds"] = (datetime.datetime.fromisoformat(run["finished"])
                                  - datetime.datetime.fromisoformat(run["date"])).total_seconds()
    return run


def write_result(path, result: dict, markdown: str | None = None) -> list[Path]:
    """Write ``result`` as JSON to ``path`` and, when given, ``markdown`` next to it (same name, ``.md``).

    Calls ``finish`` on ``result["stamp"]`` first when there is one. Creates the folder. Returns the paths
    written.
    """
    path = Path(path)
    if isinstance(result.get("stamp"), dict):
        finish(result["stamp"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    written = [path]
    if markdown is not None:
        written.append(path.with_suffix(".md"))
        written[-1].write_text(markdown.rstrip("\n") + "\n")
    return written


def measure_and_write(path, measure, table) -> dict:
    """Stamp a run, ``measure()`` (a dict of fields), write the stamped result to ``path`` with its Markdown
    (the stamp, then ``table(result)``) and print the table; returns the result."""
    run = stamp()
    result = dict(stamp=run, **measure())
    write_result(path, result, markdown=stamp_markdown(run) + "\n\n" + table(result))
    print(table(result))
    return result


# -- what the stamp says, in words ------------------------------------------------------------------------

def load_line(run: dict) -> str:
    """'load 0.02 at start, 1.98 at end on 2 CPUs' (the one-minute load averages; end once finished)."""
    load = run["load_average"]
    if load["start"] is None:
        return "load average unknown"
    text = f"load {load['start'][0]:.2f} at start"
    if load.get("end") is not None:
        text += f", {load['end'][0]:.2f} at end"
    return text + f" on {run['hardware']['logical_cpus']} CPUs"


def load_note(run: dict) -> str:
    """``load_line`` as a sentence for under a table: 'Load 0.02 at start, 1.98 at end on 2 CPUs (...).'"""
    line = load_line(run)
    return (line[0].upper() + line[1:] + " (one-minute load average; the end includes this run's own work).")


def stamp_markdown(run: dict) -> str:
    """The stamp as a short Markdown paragraph: commit, date, hardware, load, command and versions."""
    hw = run["hardware"]
    commit = run["commit"] or "unknown commit"
    if run["dirty"]:
        files = run["dirty_files"]
        commit += (f" with uncommitted changes in {files[0]}" if len(files) == 1 else
                   f" with uncommitted changes in {len(files)} files (listed in the JSON)")
    usable = hw["usable_cpus"]
    cpus = f"{hw['logical_cpus']} logical CPUs"
    if usable is not None and len(usable) != hw["logical_cpus"]:
        cpus += f", this run on CPUs {_ranges(usable)}"
    memory = f", {hw['memory_gib']:g} GiB memory" if hw["memory_gib"] else ""
    gpu = hw["gpu"]
    if gpu and gpu["gpus"]:
        names = sorted({g["name"] for g in gpu["gpus"]})
        names = f"{len(gpu['gpus'])} x {names[0]}" if len(names) == 1 else ", ".join(g["name"] for g in gpu["gpus"])
        gpus = f"; GPU: {names} (driver {gpu.get('driver') or 'unknown'}, CUDA {gpu['cuda']})"
    else:
        gpus = "; no GPU"
    libraries = ", ".join(f"{name} {version}" for name, version in run["versions"].items())
    bytecode = (" (no bytecode written: modules without a compiled copy were compiled in each process)"
                if run.get("bytecode_cached") is False else "")
    return (f"Commit {commit}; {run['date']} (UTC). CPU: {hw['cpu_model']} ({cpus}){memory}{gpus}; "
            f"{load_line(run)}.\n"
            f"Command: `{run['command']}`.\n"
            f"Python {run['python']}{bytecode}; {libraries}.")


# -- what the stamp holds ----------------------------------------------------------------------------------

def hardware() -> dict:
    """``cpu_model``, ``logical_cpus``, ``usable_cpus`` (the CPU numbers this process may run on; None where
    the system does not say), ``memory_gib`` and ``gpu`` (None when torch is not installed, else
    ``{"cuda": torch's CUDA version, "driver": the NVIDIA driver's or None, "gpus": [{name, memory_gib}]}``)."""
    try:
        usable = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = None
    return dict(cpu_model=cpu_model(), logical_cpus=os.cpu_count(), usable_cpus=usable,
                memory_gib=_memory_gib(), gpu=gpu_info())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> dict | None:
    """What torch sees of the GPUs, plus the driver version from ``nvidia-smi`` when it is on PATH."""
    if importlib.util.find_spec("torch") is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # the caller uses CUDA already: ask in place
        info = torch_gpus()
    else:
        try:
            done = subprocess.run([sys.executable, "-c", _TORCH_QUERY], capture_output=True, text=True,
                                  timeout=120)
            info = json.loads(done.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            return dict(cuda=None, driver=None, gpus=[], error="torch could not be asked about GPUs")
    info["driver"] = _nvidia_driver() if info["gpus"] else None
    return info


def torch_gpus() -> dict:
    """``{"cuda": torch's CUDA version, "gpus": [{"name", "memory_gib"}]}`` (imports torch)."""
    import torch

    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            gpus.append(dict(name=properties.name, memory_gib=round(properties.total_memory / 2**30, 1)))
    return dict(cuda=torch.version.cuda, gpus=gpus)


def versions() -> dict:
    """``{distribution: version}`` for each of ``LIBRARIES`` that is installed, and MRtrix3's dwidenoise
    (the first line of ``dwidenoise --version``) when it is on PATH."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    dwidenoise = dwidenoise_version()
    if dwidenoise is not None:
        found["dwidenoise"] = dwidenoise
    return found


def dwidenoise_version() -> str | None:
    """'3.0.3' (the first line of ``dwidenoise --version``, '== dwidenoise 3.0.3 =='), or None when it is not
    on PATH."""
    exe = shutil.which("dwidenoise")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = (done.stdout or done.stderr).splitlines()
    return lines[0].strip("= ").removeprefix("dwidenoise").strip() if lines else "unknown"


# -- small helpers ----------------------------------------------------------------------------------------

def _git(*args) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _nvidia_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def _ranges(numbers) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)

