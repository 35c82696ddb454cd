"""Our MP-PCA on the CPU against its peers, on phantoms with a known truth, in one run on the same cores.

Peers: MRtrix3 ``dwidenoise`` (a subprocess on NIfTI files, float32 and ``-datatype float64``), DIPY's
``mppca`` (our patch radius and its default), and patch-denoise's MP-PCA (when installed). Ours runs twice:
its defaults (``denoise(noisy)``) and its dwidenoise mode (``stride=1, aggregation='center',
demean='none', extent='auto'``).

For each phantom and method: wall time (best of ``--repeats``, or a single run when the first run takes
longer than ``--single-above`` seconds; the ``runs`` column says which), the speed-up over ``dwidenoise``
(float32, its default) measured in the same run, the RMSE to the truth inside the head mask and over the whole
image, and the error of the noise map against the true sigma (median and rms of sigma_hat / sigma - 1, inside
the mask).

Usage (from the repository root)::

    python benchmarks/cpu_peers.py --threads 2                 # the reference problem, all peers
    python benchmarks/cpu_peers.py --quick                     # tiny sizes: a smoke test in a minute
    python benchmarks/cpu_peers.py --skip-slow                 # without DIPY and patch-denoise

Writes JSON to ``--out`` (default benchmarks/results/cpu_peers.json) and the Markdown tables next to it
(same name, ``.md``); the tables are printed last. ``choose_defaults.py`` reuses the phantoms, scoring,
timing and ``dwidenoise`` runner defined here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import datetime
import json
import os
from pathlib import Path
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmark the package of this tree, installed or not
    sys.path.insert(0, str(REPO))

#: The issue's reference problem: 64x64x40 voxels, 48 volumes, noise sigma 5.
REFERENCE_SHAPE = (64, 64, 40)
REFERENCE_VOLUMES = 48
#: --quick: small enough that every peer (DIPY and patch-denoise included) finishes in seconds.
QUICK_SHAPE = (20, 18, 14)
QUICK_VOLUMES = 24
#: Each phantom as "kind:sigma". The DWI phantom's sigma matches the low-rank one's, so that the input RMSE
#: (which is sigma for Gaussian noise) is the same; "dwi:20" is a harder, more clinical SNR (b0 SNR ~50).
DEFAULT_PHANTOMS = "lowrank:5,dwi:5,dwi:20"

#: Said of a commit when the package's files differ from it.
DIRTY = ", with uncommitted changes in mppca_nipype/"

DWIDENOISE_MODE = dict(stride=1, aggregation="center", demean="none", extent="auto")


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
    runs = (f"best of {repeats} runs, a single run when the first took over {single_above:g} s"
            if repeats > 1 else "a single run each")
    return ("wall time: " + runs + "; ours in-process after one warm-up call, dwidenoise as a subprocess "
            "including its NIfTI I/O")


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


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int, pinned) -> dict:
    """Hardware, versions and load: what a reader needs to judge the timings."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("mppca-nipype", "numpy", "scipy", "torch", "dipy", "patch-denoise", "threadpoolctl"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    versions["dwidenoise"] = dwidenoise_version()
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--", "mppca_nipype")
    return dict(
        cpu_model=cpu_model(), logical_cpus=os.cpu_count(), threads=threads, pinned_cpus=list(pinned),
        load_average_at_start=list(os.getloadavg()), platform=platform.platform(),
        python=platform.python_version(), versions=versions,
        git_commit=commit, package_modified=bool(dirty) if dirty is not None else None,
        command=" ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def _git(*args):
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


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


def dwidenoise_version():
    exe = shutil.which("dwidenoise")
    if exe is None:
        return None
    out = subprocess.run([exe, "-version"], capture_output=True, text=True)
    first = (out.stdout or out.stderr).splitlines()
    return first[0].strip("= ").strip() if first else "unknown"


class Dwidenoise:
    """MRtrix3 ``dwidenoise`` on one phantom, written once as uncompressed NIfTI in a temporary folder.

    Its wall time is the subprocess's: it includes reading and writing the NIfTI files (``io_seconds``
    measures that part with ``mrconvert`` copying the same file, for reference).
    """

    def __init__(self, phantom: Phantom, threads: int):
        import nibabel as nib

        self.exe = shutil.which("dwidenoise")
        if self.exe is None:
            raise RuntimeError("MRtrix3's dwidenoise is not on PATH (Debian/Ubuntu: apt-get install mrtrix3)")
        self.threads = threads
        self.folder = Path(tempfile.mkdtemp(prefix="mppca-bench-"))
        self.input = self.folder / "noisy.nii"
        nib.save(nib.Nifti1Image(phantom.noisy, np.eye(4)), self.input)
        self.env = dict(os.environ, OMP_NUM_THREADS=str(threads), MRTRIX_QUIET="1")

    def command(self, datatype=None, estimator=None, extent=None):
        cmd = [self.exe, str(self.input), str(self.folder / "denoised.nii"), "-noise",
               str(self.folder / "noise.nii"), "-nthreads", str(self.threads), "-force", "-quiet"]
        if datatype:
            cmd += ["-datatype", datatype]
        if estimator:
            cmd += ["-estimator", estimator]
        if extent:
            cmd += ["-extent", ",".join(str(e) for e in extent)]
        return cmd

    def run(self, datatype=None, estimator=None, extent=None):
        """Returns (denoised, noise map)."""
        import nibabel as nib

        cmd = self.command(datatype, estimator, extent)
        done = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        denoised = np.asarray(nib.load(self.folder / "denoised.nii").get_fdata(dtype=np.float32))
        noise = np.asarray(nib.load(self.folder / "noise.nii").get_fdata(dtype=np.float32))
        return denoised, noise

    def io_seconds(self) -> float | None:
        """Wall time of ``mrconvert`` copying the input: what file I/O alone costs ``dwidenoise``."""
        exe = shutil.which("mrconvert")
        if exe is None:
            return None
        cmd = [exe, str(self.input), str(self.folder / "copy.nii"), "-nthreads", str(self.threads),
               "-force", "-quiet"]
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            subprocess.run(cmd, capture_output=True, env=self.env, check=True)
            best = min(best, time.perf_counter() - started)
        return best

    def close(self):
        shutil.rmtree(self.folder, ignore_errors=True)


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

    def record(method, options, run, repeats=args.repeats, **extra):
        log(f"  {phantom.name}: {method} ...")
        try:
            (denoised, sigma_map, *info), seconds = timed(run, repeats, args.single_above)
        except Exception as err:  # a peer that fails is reported, not fatal
            log(f"  {phantom.name}: {method} failed: {err}")
            rows.append(dict(method=method, options=options, error=str(err)))
            return
        row = dict(method=method, options=options, seconds=min(seconds), seconds_all=seconds,
                   runs=runs_label(seconds), **score(phantom, denoised, sigma_map), **extra)
        if info and isinstance(info[0], dict):
            row["engine_info"] = {k: v for k, v in info[0].items() if isinstance(v, (str, int, float, list))}
        log(f"  {phantom.name}: {method}: {row['seconds']:.2f} s ({row['runs']}), "
            f"RMSE {row['rmse_mask']:.3f}")
        rows.append(row)

    dwi = None
    io_seconds = None
    try:
        dwi = Dwidenoise(phantom, threads)
        io_seconds = dwi.io_seconds()
        record("dwidenoise", "float32 (default), exp2", lambda: dwi.run())
        record("dwidenoise", "-datatype float64, exp2", lambda: dwi.run("float64"))
    except RuntimeError as err:
        log(f"  dwidenoise unavailable: {err}")
        rows.append(dict(method="dwidenoise", options="float32 (default), exp2", error=str(err)))
    finally:
        if dwi is not None:
            dwi.close()

    defaults = ", ".join(f"{k}={v}" for k, v in DEFAULTS.items())
    record("ours (defaults)", defaults, lambda: run_ours(phantom, threads))
    mode = ", ".join(f"{k}={v}" for k, v in DWIDENOISE_MODE.items())
    record("ours (dwidenoise mode)", mode + ", estimator=exp2",
           lambda: run_ours(phantom, threads, **DWIDENOISE_MODE))

    if args.skip_slow:
        log("  --skip-slow: DIPY and patch-denoise left out")
    else:
        radius = tuple((e - 1) // 2 for e in extent)
        if have("dipy"):
            default_radius = (2, 2, 2)
            same = radius == default_radius
            label = (f"patch_radius={radius[0]} (= ours, = its default)" if same and len(set(radius)) == 1
                     else f"patch_radius={','.join(map(str, radius))} (= ours)")
            record("DIPY mppca", label, lambda: run_dipy(phantom, threads, np.array(radius)), repeats=1)
            if not same:
                record("DIPY mppca", "patch_radius=2 (its default)",
                       lambda: run_dipy(phantom, threads, 2), repeats=1)
        else:
            rows.append(dict(method="DIPY mppca", options="", error="dipy is not installed"))
        if have("patch_denoise"):
            record("patch-denoise mp_pca", f"patch {'x'.join(map(str, extent))} (= ours), stride 1, weighted",
                   lambda: run_patch_denoise(phantom, threads, extent), repeats=1)
        else:
            rows.append(dict(method="patch-denoise mp_pca", options="",
                             error="patch-denoise is not installed (pip install patch-denoise)"))

    reference = next((r for r in rows if r["method"] == "dwidenoise" and "seconds" in r), None)
    for row in rows:
        if reference and "seconds" in row:
            row["speedup_vs_dwidenoise"] = reference["seconds"] / row["seconds"]
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
        head += (f" dwidenoise's time includes its NIfTI I/O (mrconvert copying the same file: "
                 f"{entry['dwidenoise_io_seconds']:.2f} s).")
    headers = ["method", "options", "runs", "wall s", "speed-up vs dwidenoise", "RMSE mask",
               "RMSE ÷ dwidenoise", "RMSE all", "σ median rel. err", "σ rms rel. err"]
    rows = []
    for r in entry["results"]:
        if "error" in r:
            rows.append([r["method"], r["options"], "—", "failed", "", "", "", "", "", r["error"][:80]])
            continue
        speedup = r.get("speedup_vs_dwidenoise")
        rows.append([r["method"], r["options"], r["runs"], f"{r['seconds']:.2f}",
                     "n/a" if speedup is None else f"{speedup:.2f}x", f"{r['rmse_mask']:.3f}",
                     fmt(r.get("rmse_vs_dwidenoise"), ".3f"), f"{r['rmse_all']:.3f}",
                     percent(r["sigma_median_rel"]), percent(r["sigma_rms_rel"], signed=False)])
    return head + "\n\n" + markdown_table(headers, rows)


def report_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"CPU: {m['cpu_model']} ({m['logical_cpus']} logical CPUs), {m['threads']} threads used "
             f"(pinned to CPUs {m['pinned_cpus']}); load average at start "
             f"{', '.join(f'{x:.2f}' for x in m['load_average_at_start'])}, at end "
             f"{', '.join(f'{x:.2f}' for x in report['load_average_at_end'])}.",
             f"Command: `{m['command']}` (commit {m['git_commit'] or 'unknown'}"
             f"{DIRTY if m['package_modified'] else ''}; {report['timing']}).", ""]
    for entry in report["phantoms"]:
        lines += [phantom_table(entry), ""]
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
    """Check the shared options, fill their size-dependent defaults, pin the process; return
    (shape, volumes, machine) and log the machine."""
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    shape = args.shape or (QUICK_SHAPE if args.quick else REFERENCE_SHAPE)
    volumes = args.volumes or (QUICK_VOLUMES if args.quick else REFERENCE_VOLUMES)
    args.repeats = args.repeats or (1 if args.quick else 3)
    pinned = [] if args.no_pin else pin_to_cores(args.threads)
    machine = machine_info(args.threads, pinned)
    log(f"{machine['cpu_model']}: {args.threads} threads, pinned to {pinned or 'nothing'}")
    return shape, volumes, machine


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser, threads_help="cores for every method: nprocs for ours, -nthreads for dwidenoise, "
                                         "BLAS threads for DIPY and patch-denoise (default 2)",
                    repeats_help="timed runs per method, best kept (default 3; --quick: 1)", single_above=20.0,
                    out_name="cpu_peers.json")
    parser.add_argument("--skip-slow", action="store_true", help="leave out DIPY and patch-denoise")
    args = parser.parse_args(argv)
    shape, volumes, machine = start_run(args, parser)
    timing = timing_note(args.repeats, args.single_above)
    report = dict(machine=machine, timing=timing, phantoms=[])
    warm_up_ours(args.threads)
    for spec in args.phantoms.split(","):
        phantom = make_phantom(spec.strip(), shape, volumes)
        log(f"{phantom.name}: {phantom.description}")
        report["phantoms"].append(bench_phantom(phantom, args))
    report["load_average_at_end"] = list(os.getloadavg())

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    markdown = report_markdown(report)
    args.out.with_suffix(".md").write_text(markdown + "\n")
    log(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    print(markdown)


if __name__ == "__main__":
    main()
