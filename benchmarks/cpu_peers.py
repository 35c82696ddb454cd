"""Our MP-PCA on the CPU against its peers, on phantoms with a known truth, in one run on the same cores.

Peers: MRtrix3 ``dwidenoise`` (float32 and ``-datatype float64``), DIPY's ``mppca`` (our patch radius and its
default), and patch-denoise's MP-PCA (when installed). Ours runs twice: its defaults and its dwidenoise mode
(``--extent auto --stride 1 --aggregation center --demean none``).

Two wall times. Engine: the method called inside this process on the array (ours after a warm-up call,
DIPY, patch-denoise). File to file: a new process reading the phantom written as NIfTI and writing the
denoised series and the noise map, as a user runs it: ``mppca-denoise IN OUT --noise NOISE --device cpu
--nprocs N`` (process start, imports, reading and writing included) and ``dwidenoise IN OUT -noise NOISE
-nthreads N``. The speed-up over ``dwidenoise`` (float32, its default) compares file-to-file times; DIPY and
patch-denoise, which are only called in-process, are compared by their engine time (marked †).

Each time is the best of ``--repeats`` runs, or a single run when the first takes longer than
``--single-above`` seconds (the ``runs`` column says which). Quality: the RMSE to the truth inside the mask
and over the whole image, and the error of the noise map against the true sigma (median and rms of
sigma_hat / sigma - 1, inside the mask). Every result carries ``harness.stamp()``: commit, date, hardware,
load average at start and end, versions and the command.

Usage (from the repository root)::

    python benchmarks/cpu_peers.py --threads 2                 # the reference problem, all peers
    python benchmarks/cpu_peers.py --quick                     # tiny sizes: a smoke test in a minute
    python benchmarks/cpu_peers.py --skip-slow                 # without DIPY and patch-denoise

Writes JSON to ``--out`` (default benchmarks/results/cpu_peers.json) and the Markdown tables next to it
(same name, ``.md``); the tables are printed last. ``choose_defaults.py`` and ``quality.py`` reuse the
phantoms, scoring, timing and ``dwidenoise`` runner defined here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import os
from pathlib import Path
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import harness

REPO = harness.REPO
if str(REPO) not in sys.path:  # benchmark the package of this tree, installed or not
    sys.path.insert(0, str(REPO))

#: The reference problem: 64x64x40 voxels, 48 volumes, noise sigma 5.
REFERENCE_SHAPE = (64, 64, 40)
REFERENCE_VOLUMES = 48
#: --quick: small enough that every peer (DIPY and patch-denoise included) finishes in seconds.
QUICK_SHAPE = (20, 18, 14)
QUICK_VOLUMES = 24
#: Each phantom as "kind:sigma". The DWI phantom's sigma matches the low-rank one's, so that the input RMSE
#: (which is sigma for Gaussian noise) is the same; "dwi:20" is a harder, more clinical SNR (b0 SNR ~50).
DEFAULT_PHANTOMS = "lowrank:5,dwi:5,dwi:20"

from mppca_nipype.engine import DWIDENOISE_MODE  # noqa: E402  (re-exported for the other benchmarks)


def log(message):
    print(message, file=sys.stderr, flush=True)


# -- phantoms ---------------------------------------------------------------------------------------------

@dataclass
class Phantom:
    """A noisy series, its truth, the mask the errors are measured in, and the true noise level."""

    name: str
    noisy: np.ndarray
    truth: np.ndarray
    mask: np.ndarray
    sigma: float
    description: str

    def summary(self) -> dict:
        residual = self.noisy - self.truth
        return dict(name=self.name, description=self.description, shape=list(self.noisy.shape),
                    sigma=self.sigma, mask_voxels=int(self.mask.sum()),
                    input_rmse_mask=rms(residual[self.mask]), input_rmse_all=rms(residual))


def make_phantom(spec: str, shape, n_volumes: int, seed: int = 0) -> Phantom:
    """``spec`` is "lowrank:SIGMA" (rank-5 series on a baseline of 1000) or "dwi:SIGMA" (the head phantom)."""
    from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom

    kind, _, sigma_text = spec.partition(":")
    sigma = float(sigma_text) if sigma_text else 5.0
    shape = tuple(int(s) for s in shape)
    if kind == "lowrank":
        noisy, truth = low_rank_phantom(shape=shape, n_volumes=n_volumes, rank=5, sigma=sigma, seed=seed)
        mask = np.ones(shape, dtype=bool)
        description = f"rank-5 series on a baseline of 1000, Gaussian noise sigma {sigma:g}; mask: all voxels"
    elif kind == "dwi":
        noisy, truth, _, _ = dwi_phantom(shape=shape, n_volumes=n_volumes, sigma=sigma, seed=seed)
        mask = truth[..., 0] > 0
        description = (f"head-shaped DWI (3-compartment tensor model, b=0 and b=1000), Gaussian noise sigma "
                       f"{sigma:g}; mask: the head")
    else:
        raise SystemExit(f"unknown phantom {spec!r}: use lowrank:SIGMA or dwi:SIGMA")
    return Phantom(spec, noisy, truth, mask, sigma, description)


def parse_shape(text: str):
    shape = tuple(int(s) for s in text.split(","))
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"a shape is three positive integers X,Y,Z, not {text!r}")
    return shape


# -- scoring ----------------------------------------------------------------------------------------------

def rms(values) -> float:
    values = np.asarray(values, dtype=np.float64)
    return float(np.sqrt(np.mean(values**2))) if values.size else float("nan")


def score(phantom: Phantom, denoised, sigma_map=None) -> dict:
    """RMSE to the truth (in the mask, overall) and the noise map's relative error against the true sigma."""
    denoised = np.asarray(denoised, dtype=np.float64)
    if denoised.shape != phantom.truth.shape:
        raise RuntimeError(f"output shape {denoised.shape} differs from the input's {phantom.truth.shape}")
    error = denoised - phantom.truth
    result = dict(rmse_mask=rms(error[phantom.mask]), rmse_all=rms(error))
    if sigma_map is None:
        result.update(sigma_median_rel=None, sigma_rms_rel=None)
    else:
        relative = np.asarray(sigma_map, dtype=np.float64)[phantom.mask] / phantom.sigma - 1
        finite = np.isfinite(relative)  # DIPY leaves NaN where no patch gave a noise estimate
        result.update(sigma_median_rel=float(np.median(relative[finite])) if finite.any() else None,
                      sigma_rms_rel=rms(relative[finite]) if finite.any() else None,
                      sigma_nonfinite_voxels=int((~finite).sum()))
    return result


# -- timing and cores -------------------------------------------------------------------------------------

def timed(run, repeats: int, single_above: float):
    """Call ``run()`` up to ``repeats`` times (once when the first call takes > ``single_above`` s).

    Returns (the last call's result, the list of wall times in seconds).
    """
    seconds = []
    result = None
    for _ in range(max(repeats, 1)):
        started = time.perf_counter()
        result = run()
        seconds.append(time.perf_counter() - started)
        if seconds[0] > single_above:
            break
    return result, seconds


def timing_note(repeats: int, single_above: float) -> str:
    """How each time was taken, in words: 'best of 3 runs, a single run when the first took over 20 s'."""
    return (f"best of {repeats} runs, a single run when the first took over {single_above:g} s" if repeats > 1
            else "a single run each")


#: ``timing_note``'s sequel for the scripts that time ours in-process and dwidenoise as a new process.
ENGINE_AGAINST_DWIDENOISE = ("ours in this process after one warm-up call; dwidenoise a new process, file to "
                             "file (its time includes reading and writing NIfTI)")


def runs_label(seconds) -> str:
    return "1" if len(seconds) == 1 else f"best of {len(seconds)}"


def pin_to_cores(threads: int) -> list[int]:
    """Restrict this process (and so its workers and subprocesses) to ``threads`` of its allowed CPUs."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return []
    chosen = allowed[:threads]
    if len(chosen) < len(allowed):
        os.sched_setaffinity(0, chosen)
    return chosen


# -- the methods --------------------------------------------------------------------------------------------

def warm_up_ours(threads: int):
    """One small call, so that the first timed run does not pay for imports done once per process."""
    from mppca_nipype import denoise

    rng = np.random.default_rng(0)
    denoise(rng.standard_normal((12, 12, 12, 16)).astype(np.float32), device="cpu", nprocs=threads)


def run_ours(phantom: Phantom, threads: int, **options):
    """Our engine on the CPU; returns (denoised, sigma map, info)."""
    from mppca_nipype import denoise

    result = denoise(phantom.noisy, device="cpu", nprocs=threads, **options)
    return result.denoised, result.sigma, result.info


class NiftiPhantom:
    """A phantom written once as NIfTI in a temporary folder, for the methods run on files: uncompressed, or
    with ``suffix=".nii.gz"`` compressed (the methods then write compressed outputs too).

    ``path(name)`` names a file there; ``read(name)`` loads the denoised series ``name`` + suffix and the noise
    map ``name_noise`` + suffix that a method wrote. A context manager: the folder goes on exit.
    """

    def __init__(self, phantom: Phantom, suffix: str = ".nii"):
        import nibabel as nib

        self.folder = Path(tempfile.mkdtemp(prefix="mppca-bench-"))
        self.suffix = suffix
        self.input = self.folder / f"noisy{suffix}"
        nib.save(nib.Nifti1Image(np.asarray(phantom.noisy, dtype=np.float32), np.eye(4)), self.input)

    def path(self, name: str) -> Path:
        return self.folder / name

    def read(self, name: str):
        """(denoised, noise map) as float32 arrays."""
        import nibabel as nib

        return tuple(np.asarray(nib.load(self.path(f)).get_fdata(dtype=np.float32))
                     for f in (f"{name}{self.suffix}", f"{name}_noise{self.suffix}"))

    def close(self):
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_command(command, env):
    """Run a denoising command to completion (what a file-to-file time measures); raise with its stderr."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed: {done.stderr.strip()[-500:]}")


def ours_program() -> list[str]:
    """How a user starts our command: the ``mppca-denoise`` console script installed beside this
    interpreter, or ``python -m mppca_nipype.cli.denoise`` where it is not installed."""
    script = Path(sys.executable).with_name("mppca-denoise")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "mppca_nipype.cli.denoise"]


def ours_env(checkout: Path = REPO) -> dict:
    """The environment of our command: PYTHONPATH puts this tree's package (or another ``checkout``'s) first,
    installed or not."""
    paths = [str(checkout), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def ours_command(files: NiftiPhantom, threads: int, name: str = "ours", **options) -> list[str]:
    """``mppca-denoise IN name.nii --noise name_noise.nii --device cpu --nprocs N --quiet [options]``."""
    flags = [item for key, value in options.items() for item in (f"--{key}", str(value))]
    return [*ours_program(), str(files.input), str(files.path(f"{name}{files.suffix}")), "--noise",
            str(files.path(f"{name}_noise{files.suffix}")), "--device", "cpu", "--nprocs", str(threads), "--quiet",
            *flags]


def warm_up_ours_file(threads: int):
    """One run of our command on a tiny file, so that the first timed run finds the files it loads cached."""
    rng = np.random.default_rng(0)
    tiny = Phantom("warm-up", rng.standard_normal((12, 12, 12, 16)).astype(np.float32), None, None, 1.0, "")
    with NiftiPhantom(tiny) as files:
        run_command(ours_command(files, threads), ours_env())


class Dwidenoise:
    """MRtrix3 ``dwidenoise`` on a phantom's NIfTI file: ``run`` writes ``dwidenoise.nii`` and
    ``dwidenoise_noise.nii`` (read them with ``files.read("dwidenoise")``); a run is a new process, so its
    wall time includes reading and writing the files (``io_seconds`` measures that part alone)."""

    name = "dwidenoise"

    def __init__(self, files: NiftiPhantom, threads: int):
        self.exe = shutil.which("dwidenoise")
        if self.exe is None:
            raise RuntimeError("MRtrix3's dwidenoise is not on PATH (Debian/Ubuntu: apt-get install mrtrix3)")
        self.files = files
        self.threads = threads
        self.env = dict(os.environ, OMP_NUM_THREADS=str(threads), MRTRIX_QUIET="1")

    def command(self, datatype=None, estimator=None, extent=None) -> list[str]:
        suffix = self.files.suffix
        cmd = [self.exe, str(self.files.input), str(self.files.path(f"{self.name}{suffix}")), "-noise",
               str(self.files.path(f"{self.name}_noise{suffix}")), "-nthreads", str(self.threads), "-force",
               "-quiet"]
        if datatype:
            cmd += ["-datatype", datatype]
        if estimator:
            cmd += ["-estimator", estimator]
        if extent:
            cmd += ["-extent", ",".join(str(e) for e in extent)]
        return cmd

    def run(self, datatype=None, estimator=None, extent=None):
        """One run, file to file; the outputs stay on disk."""
        run_command(self.command(datatype, estimator, extent), self.env)

    def denoise(self, datatype=None, estimator=None, extent=None):
        """One run, then its outputs: (denoised, noise map)."""
        self.run(datatype, estimator, extent)
        return self.files.read(self.name)

    def io_seconds(self) -> float | None:
        """Wall time of ``mrconvert`` copying the input: what file I/O alone costs ``dwidenoise``."""
        exe = shutil.which("mrconvert")
        if exe is None:
            return None
        cmd = [exe, str(self.files.input), str(self.files.path(f"copy{self.files.suffix}")), "-nthreads", str(self.threads),
               "-force", "-quiet"]
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            subprocess.run(cmd, capture_output=True, env=self.env, check=True)
            best = min(best, time.perf_counter() - started)
        return best


def run_dipy(phantom: Phantom, threads: int, patch_radius):
    """DIPY's ``mppca`` with its BLAS limited to ``threads``; returns (denoised, sigma map)."""
    from dipy.denoise.localpca import mppca
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=threads):
        denoised, sigma = mppca(phantom.noisy, patch_radius=patch_radius, return_sigma=True,
                                suppress_warning=True)
    return denoised, sigma


def run_patch_denoise(phantom: Phantom, threads: int, extent):
    """patch-denoise's MP-PCA, patches of ``extent`` at stride 1 (overlap extent - 1), weighted.

    It computes no noise map (its noise output stays zero), so it is scored on the image only.
    """
    from patch_denoise.space_time.lowrank import MPPCADenoiser
    from threadpoolctl import threadpool_limits

    extent = tuple(int(e) for e in extent)
    denoiser = MPPCADenoiser(extent, tuple(e - 1 for e in extent), threshold_scale=1.0,
                             recombination="weighted")
    with threadpool_limits(limits=threads):
        denoised, *_ = denoiser.denoise(phantom.noisy, mask=None, progbar=False)
    return denoised, None


def have(module: str) -> bool:
    from importlib.util import find_spec

    return find_spec(module) is not None


# -- one phantom, every method -----------------------------------------------------------------------------

def bench_phantom(phantom: Phantom, args) -> dict:
    from mppca_nipype.engine import DEFAULTS
    from mppca_nipype.engine.patches import resolve_extent

    threads = args.threads
    extent = resolve_extent("auto", phantom.noisy.shape[:3], phantom.noisy.shape[3])
    rows = []

    def measure(what, run, repeats):
        result, seconds = timed(run, repeats, args.single_above)
        return result, {f"{what}_seconds": min(seconds), f"{what}_seconds_all": seconds,
                        f"{what}_runs": runs_label(seconds)}

    def record(method, options, engine=None, file=None, repeats=args.repeats):
        """``engine``: a call returning (denoised, sigma map[, info]); ``file``: (command, env, output name)."""
        log(f"  {phantom.name}: {method} ...")
        row = dict(method=method, options=options)
        try:
            if engine is not None:
                (denoised, sigma_map, *info), times = measure("engine", engine, repeats)
                row.update(times, **score(phantom, denoised, sigma_map))
                if info and isinstance(info[0], dict):
                    row["engine_info"] = {k: v for k, v in info[0].items()
                                          if isinstance(v, (str, int, float, list))}
            if file is not None:
                command, env, name = file
                _, times = measure("file", lambda: run_command(command, env), repeats)
                written = score(phantom, *files.read(name))
                row.update(times, file_command=shlex.join(command).replace(f"{files.folder}{os.sep}", ""))
                if engine is None:
                    row.update(written)
                else:  # the file holds the engine's result, rounded to float32 on disk
                    row["file_rmse_mask"] = written["rmse_mask"]
        except Exception as err:  # a peer that fails is reported, not fatal
            log(f"  {phantom.name}: {method} failed: {err}")
            rows.append(dict(method=method, options=options, error=str(err)))
            return
        log(f"  {phantom.name}: {method}: " + ", ".join(
            f"{what} {row[f'{what}_seconds']:.2f} s ({row[f'{what}_runs']})" for what in ("engine", "file")
            if f"{what}_seconds" in row) + f", RMSE {row['rmse_mask']:.3f}")
        rows.append(row)

    io_seconds = None
    with NiftiPhantom(phantom, ".nii.gz" if args.compressed else ".nii") as files:
        try:
            dwi = Dwidenoise(files, threads)
        except RuntimeError as err:
            log(f"  dwidenoise unavailable: {err}")
            rows.append(dict(method="dwidenoise", options="float32 (default), exp2", error=str(err)))
        else:
            io_seconds = dwi.io_seconds()
            record("dwidenoise", "float32 (default), exp2", file=(dwi.command(), dwi.env, dwi.name))
            record("dwidenoise", "-datatype float64, exp2", file=(dwi.command("float64"), dwi.env, dwi.name))

        defaults = ", ".join(f"{k}={v}" for k, v in DEFAULTS.items())
        record("ours (defaults)", defaults, engine=lambda: run_ours(phantom, threads),
               file=(ours_command(files, threads), ours_env(), "ours"))
        mode = ", ".join(f"{k}={v}" for k, v in DWIDENOISE_MODE.items())
        record("ours (dwidenoise mode)", mode + ", estimator=exp2",
               engine=lambda: run_ours(phantom, threads, **DWIDENOISE_MODE),
               file=(ours_command(files, threads, **DWIDENOISE_MODE), ours_env(), "ours"))

    if args.skip_slow:
        log("  --skip-slow: DIPY and patch-denoise left out")
    else:
        radius = tuple((e - 1) // 2 for e in extent)
        if have("dipy"):
            default_radius = (2, 2, 2)
            same = radius == default_radius
            label = (f"patch_radius={radius[0]} (= ours, = its default)" if same and len(set(radius)) == 1
                     else f"patch_radius={','.join(map(str, radius))} (= ours)")
            record("DIPY mppca", label, engine=lambda: run_dipy(phantom, threads, np.array(radius)), repeats=1)
            if not same:
                record("DIPY mppca", "patch_radius=2 (its default)",
                       engine=lambda: run_dipy(phantom, threads, 2), repeats=1)
        else:
            rows.append(dict(method="DIPY mppca", options="", error="dipy is not installed"))
        if have("patch_denoise"):
            record("patch-denoise mp_pca", f"patch {'x'.join(map(str, extent))} (= ours), stride 1, weighted",
                   engine=lambda: run_patch_denoise(phantom, threads, extent), repeats=1)
        else:
            rows.append(dict(method="patch-denoise mp_pca", options="",
                             error="patch-denoise is not installed (pip install patch-denoise)"))

    reference = next((r for r in rows if r["method"] == "dwidenoise" and "file_seconds" in r), None)
    for row in rows:
        if reference is None or "error" in row:
            continue
        # file to file where the method has a file run; DIPY and patch-denoise only by their engine time
        basis = "file" if "file_seconds" in row else "engine"
        row["speedup_basis"] = basis
        row["speedup_vs_dwidenoise"] = reference["file_seconds"] / row[f"{basis}_seconds"]
        row["rmse_vs_dwidenoise"] = row["rmse_mask"] / reference["rmse_mask"]
    return dict(phantom=phantom.summary(), extent_auto=list(extent), dwidenoise_io_seconds=io_seconds,
                results=rows)


# -- tables ---------------------------------------------------------------------------------------------------

def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value, spec=".3f", missing="n/a"):
    return missing if value is None else format(value, spec)


def percent(value, signed=True):
    return "n/a" if value is None else f"{100 * value:{'+' if signed else ''}.1f}%"


def phantom_table(entry: dict) -> str:
    p = entry["phantom"]
    head = (f"**{p['name']}**: {'x'.join(map(str, p['shape'][:3]))} voxels x {p['shape'][3]} volumes, "
            f"{p['description']}. Input RMSE {p['input_rmse_mask']:.3f} (mask), {p['input_rmse_all']:.3f} "
            f"(all); auto extent {'x'.join(map(str, entry['extent_auto']))}.")
    if entry.get("dwidenoise_io_seconds") is not None:
        head += (f" Reading and writing the files alone (mrconvert copying the input) takes "
                 f"{entry['dwidenoise_io_seconds']:.2f} s.")
    headers = ["method", "options", "runs (engine / file)", "engine s", "file-to-file s",
               "speed-up vs dwidenoise (file to file)", "RMSE mask", "RMSE ÷ dwidenoise", "RMSE all",
               "σ median rel. err", "σ rms rel. err"]
    rows = []
    for r in entry["results"]:
        if "error" in r:
            rows.append([r["method"], r["options"], "—", "failed", "", "", "", "", "", "", r["error"][:80]])
            continue
        options = r["options"] + ("; a new process, file to file" if r["method"] == "dwidenoise" else "")
        speedup = r.get("speedup_vs_dwidenoise")
        speedup = "n/a" if speedup is None else f"{speedup:.2f}x" + (" †" if r["speedup_basis"] == "engine" else "")
        rows.append([r["method"], options, f"{r.get('engine_runs', '—')} / {r.get('file_runs', '—')}",
                     fmt(r.get("engine_seconds"), ".2f", "—"), fmt(r.get("file_seconds"), ".2f", "—"), speedup,
                     f"{r['rmse_mask']:.3f}", fmt(r.get("rmse_vs_dwidenoise"), ".3f"), f"{r['rmse_all']:.3f}",
                     percent(r["sigma_median_rel"]), percent(r["sigma_rms_rel"], signed=False)])
    return head + "\n\n" + markdown_table(headers, rows)


def report_markdown(report: dict) -> str:
    run = report["stamp"]
    lines = [harness.stamp_markdown(run), "",
             f"{report['settings']['threads']} threads for every method; {report['timing']}.", ""]
    for entry in report["phantoms"]:
        lines += [phantom_table(entry), ""]
    if any(r.get("speedup_basis") == "engine" for e in report["phantoms"] for r in e["results"]):
        lines += ["† run in this process only: its engine time against dwidenoise's file-to-file time.", ""]
    lines += ["File to file, as run (in the phantom's folder; ours " + " ".join(report["ours_program"]) + "):", ""]
    lines += [f"- {r['method']}: `{Path(r['file_command'].split()[0]).name} {r['file_command'].split(' ', 1)[1]}`"
              for r in report["phantoms"][0]["results"] if "file_command" in r] if report["phantoms"] else []
    lines += ["", harness.load_note(run)]
    return "\n".join(lines)


def add_run_options(parser, *, threads_help, repeats_help, single_above, out_name):
    """The options every benchmark script of this folder shares (cores, sizes, repeats, pinning, output)."""
    parser.add_argument("--threads", type=int, default=2, help=threads_help)
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny phantoms ({'x'.join(map(str, QUICK_SHAPE))}x{QUICK_VOLUMES}), one run each")
    parser.add_argument("--phantoms", default=DEFAULT_PHANTOMS,
                        help=f"comma-separated kind:sigma, kind lowrank or dwi (default {DEFAULT_PHANTOMS})")
    parser.add_argument("--shape", type=parse_shape, default=None,
                        help="phantom size X,Y,Z (default 64,64,40; --quick: 20,18,14)")
    parser.add_argument("--volumes", type=int, default=None, help="volumes (default 48; --quick: 24)")
    parser.add_argument("--repeats", type=int, default=None, help=repeats_help)
    parser.add_argument("--single-above", type=float, default=single_above,
                        help=f"run once when the first run takes longer than this (s; default {single_above:g})")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not restrict the process to --threads CPUs (by default it is pinned, so that "
                             "every method runs on the same cores)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / out_name,
                        help="JSON output; the Markdown goes next to it as .md")


def start_run(args, parser):
    """Check the shared options, fill their size-dependent defaults, pin the process, stamp the run.

    Returns (shape, volumes, stamp, settings): ``settings`` records threads, pinned CPUs, repeats, sizes.
    """
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    shape = args.shape or (QUICK_SHAPE if args.quick else REFERENCE_SHAPE)
    volumes = args.volumes or (QUICK_VOLUMES if args.quick else REFERENCE_VOLUMES)
    args.repeats = args.repeats or (1 if args.quick else 3)
    pinned = [] if args.no_pin else pin_to_cores(args.threads)
    run = harness.stamp()
    settings = dict(threads=args.threads, pinned_cpus=pinned, quick=args.quick, shape=list(shape),
                    volumes=volumes, phantoms=args.phantoms, repeats=args.repeats, single_above=args.single_above)
    log(f"{run['hardware']['cpu_model']}: {args.threads} threads, pinned to {pinned or 'nothing'}; "
        f"{harness.load_line(run)}")
    return shape, volumes, run, settings


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser, threads_help="cores for every method: nprocs for ours, -nthreads for dwidenoise, "
                                         "BLAS threads for DIPY and patch-denoise (default 2)",
                    repeats_help="timed runs per method, best kept (default 3; --quick: 1)", single_above=20.0,
                    out_name="cpu_peers.json")
    parser.add_argument("--skip-slow", action="store_true", help="leave out DIPY and patch-denoise")
    parser.add_argument("--compressed", action="store_true",
                        help="file to file on compressed NIfTI (.nii.gz in and out) rather than .nii")
    args = parser.parse_args(argv)
    shape, volumes, run, settings = start_run(args, parser)
    settings["skip_slow"] = args.skip_slow
    settings["compressed"] = args.compressed
    timing = (f"wall time: {timing_note(args.repeats, args.single_above)}; engine: in this process (ours after "
              "one warm-up call); file to file: a new process reading and writing "
              f"{'compressed NIfTI (.nii.gz)' if args.compressed else 'NIfTI'} (ours: mppca-denoise; dwidenoise)")
    report = dict(stamp=run, settings=settings, timing=timing,
                  ours_program=ours_program(), phantoms=[])
    warm_up_ours(args.threads)
    warm_up_ours_file(args.threads)
    for spec in args.phantoms.split(","):
        phantom = make_phantom(spec.strip(), shape, volumes)
        log(f"{phantom.name}: {phantom.description}")
        report["phantoms"].append(bench_phantom(phantom, args))

    harness.finish(run)
    markdown = report_markdown(report)
    written = harness.write_result(args.out, report, markdown)
    log("wrote " + " and ".join(map(str, written)))
    print(markdown)


if __name__ == "__main__":
    main()
