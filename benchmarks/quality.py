"""Denoising quality against the peers: phantoms with a known truth, and DIPY's small real DWI.

Phantoms (``mppca_nipype.phantoms``, seed 0): for every number of volumes T in ``--volumes`` (default
32, 64, 128, 300), the low-rank phantom at several ranks and noise levels and the head-shaped DWI phantom at
several noise levels. Methods: our defaults, our dwidenoise mode (``extent='auto', stride=1,
aggregation='center', demean='none'``), MRtrix3 ``dwidenoise`` (float32, its defaults), DIPY's ``mppca``
(its default patch radius 2, i.e. 5x5x5) and patch-denoise's MP-PCA (patches of dwidenoise's auto extent,
stride 1, weighted). Measures: RMSE to the truth in the mask and over the whole image, the noise map's error
against the true sigma (median and rms of sigma_hat/sigma - 1 in the mask) and the wall time.

Real DWI: DIPY's ``small_64D`` (10x10x10, 65 volumes) and ``small_101D`` (6x10x10, 102 volumes),
shipped inside the dipy package (no download). No truth: we report the agreement of each method with
``dwidenoise -datatype float64`` (rms of the difference relative to the rms of the data; noise maps:
median |sigma/sigma_dwidenoise - 1|; dwidenoise 3.0.3 writes no rank map) and the residuals' whiteness:
the mean lag-1 correlation of the residual (input - denoised) along x, y and z (0 for white noise, positive
when the residual holds smooth structure, i.e. removed signal), the mean absolute correlation between the
residuals of different volumes, and the SD of the residual scaled by sigma sqrt(1 - (P + d)/T) (1 when
the noise estimate is right; only for our modes: dwidenoise 3.0.3 and DIPY give no rank map).

Scoring, timing, core pinning and the peer runners are ``cpu_peers.py``'s; ours and the Python peers are
timed in this process, ``dwidenoise`` as a new process, file to file. The result is stamped by
``harness.stamp()`` (commit, date, hardware, load average at start and end, versions, command).

Usage (from the repository root)::

    python benchmarks/quality.py --threads 2                  # the full grid: long (hours with every peer)
    python benchmarks/quality.py --quick                      # tiny sizes, T = 32 and 64: a smoke test
    python benchmarks/quality.py --skip dipy,patch-denoise    # without the slow peers

Writes JSON to ``--out`` (default benchmarks/results/quality.json: ``stamp``, ``settings``, ``phantoms``
and ``real``, the rows that ``plot_quality.py`` draws) and Markdown tables next to it (``.md``); the tables
are printed last.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import warnings

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import cpu_peers as peers  # noqa: E402  (the shared phantoms, scoring, timing and peer runners)
import harness  # noqa: E402

#: The full grid: T in {32, 64, 128, 300}.
FULL_SHAPE = (48, 48, 32)
FULL_VOLUMES = (32, 64, 128, 300)
#: Low-rank phantoms: (rank, sigma) on a baseline near 1000; DWI phantoms: sigma (b=0 signal about 1000).
FULL_LOWRANK = ((3, 5.0), (3, 20.0), (10, 5.0), (10, 20.0))
FULL_DWI = (10.0, 30.0)

QUICK_SHAPE = (16, 14, 12)
QUICK_VOLUMES = (32, 64)
QUICK_LOWRANK = ((3, 10.0),)
QUICK_DWI = (20.0,)

METHODS = ("ours (defaults)", "ours (dwidenoise mode)", "dwidenoise", "dipy mppca", "patch-denoise")
SKIP_NAMES = {"dwidenoise": "dwidenoise", "dipy": "dipy mppca", "patch-denoise": "patch-denoise"}
REAL_DATA = ("small_64D", "small_101D")


# -- phantoms -------------------------------------------------------------------------------------------

def lowrank_phantom(shape, n_volumes, rank, sigma, seed=0) -> peers.Phantom:
    from mppca_nipype.phantoms import low_rank_phantom

    noisy, truth = low_rank_phantom(shape=shape, n_volumes=n_volumes, rank=rank, sigma=sigma, seed=seed)
    return peers.Phantom(f"lowrank r{rank} s{sigma:g} T{n_volumes}", noisy, truth, np.ones(shape, bool), sigma,
                         f"rank-{rank} series on a baseline near 1000, Gaussian noise sigma {sigma:g}; mask: all")


def dwi_phantom(shape, n_volumes, sigma, seed=0) -> peers.Phantom:
    from mppca_nipype.phantoms import dwi_phantom as make

    noisy, truth, _, _ = make(shape=shape, n_volumes=n_volumes, sigma=sigma, seed=seed)
    return peers.Phantom(f"dwi s{sigma:g} T{n_volumes}", noisy, truth, truth[..., 0] > 0, sigma,
                         f"head-shaped DWI phantom, Gaussian noise sigma {sigma:g}; mask: the head")


def phantom_grid(shape, volumes, lowrank, dwi):
    for n_volumes in volumes:
        for rank, sigma in lowrank:
            yield n_volumes, lambda r=rank, s=sigma, t=n_volumes: lowrank_phantom(shape, t, r, s)
        for sigma in dwi:
            yield n_volumes, lambda s=sigma, t=n_volumes: dwi_phantom(shape, t, s)


# -- methods ---------------------------------------------------------------------------------------------

def auto_extent(phantom):
    from mppca_nipype.engine.patches import resolve_extent

    return resolve_extent("auto", phantom.noisy.shape[:3], phantom.noisy.shape[3])


def run_method(name, phantom, threads, dwidenoise=None):
    """Returns (denoised, sigma map or None, rank map or None); ``dwidenoise`` is a ``peers.Dwidenoise``."""
    if name == "ours (defaults)":
        from mppca_nipype import denoise

        result = denoise(phantom.noisy, device="cpu", nprocs=threads)
        return result.denoised, result.sigma, result.rank
    if name == "ours (dwidenoise mode)":
        from mppca_nipype import denoise

        result = denoise(phantom.noisy, device="cpu", nprocs=threads, **peers.DWIDENOISE_MODE)
        return result.denoised, result.sigma, result.rank
    if name == "dwidenoise":
        denoised, sigma = dwidenoise.files.read(dwidenoise.name)
        return denoised, sigma, None
    if name == "dipy mppca":
        denoised, sigma = peers.run_dipy(phantom, threads, patch_radius=2)
        return denoised, sigma, None
    if name == "patch-denoise":
        denoised, sigma = peers.run_patch_denoise(phantom, threads, auto_extent(phantom))
        return denoised, sigma, None
    raise ValueError(name)


def measure(method, phantom, args, dwidenoise=None):
    """Run ``method`` on ``phantom`` as ``args`` says; returns ((denoised, sigma, rank), wall times).

    dwidenoise's time is its process, file to file; its outputs are read afterwards, untimed.
    """
    if method == "dwidenoise":
        _, seconds = peers.timed(dwidenoise.run, args.repeats, args.single_above)
        return run_method(method, phantom, args.threads, dwidenoise), seconds
    return peers.timed(lambda: run_method(method, phantom, args.threads), args.repeats, args.single_above)


def available(methods, skip):
    chosen = [m for m in methods if m not in skip]
    missing = {"dwidenoise": not harness.dwidenoise_version(), "dipy mppca": not peers.have("dipy"),
               "patch-denoise": not peers.have("patch_denoise")}
    for method, absent in missing.items():
        if method in chosen and absent:
            peers.log(f"quality: {method} is not installed; left out")
            chosen.remove(method)
    return chosen


def bench_phantoms(args, methods):
    rows = []
    for n_volumes, make in phantom_grid(args.shape, args.volumes, args.lowrank, args.dwi):
        phantom = make()
        peers.log(f"quality: {phantom.name} ({'x'.join(map(str, phantom.noisy.shape))})")
        with peers.NiftiPhantom(phantom) as files:
            dwidenoise = peers.Dwidenoise(files, args.threads) if "dwidenoise" in methods else None
            for method in methods:
                (denoised, sigma, _), seconds = measure(method, phantom, args, dwidenoise)
                row = dict(phantom=phantom.name, volumes=n_volumes, sigma=phantom.sigma, method=method,
                           seconds=min(seconds), runs=peers.runs_label(seconds),
                           input_rmse_mask=phantom.summary()["input_rmse_mask"],
                           **peers.score(phantom, denoised, sigma))
                rows.append(row)
                peers.log(f"  {method:24s} rmse {row['rmse_mask']:.3f} (input {row['input_rmse_mask']:.3f}) "
                          f"{row['seconds']:.2f} s")
    return rows


# -- real data -------------------------------------------------------------------------------------------

def lag1_correlation(residual, mask, axis):
    """Mean correlation of the residual with itself shifted by one voxel along ``axis``, inside the mask."""
    first = [slice(None)] * 4
    second = [slice(None)] * 4
    first[axis], second[axis] = slice(0, -1), slice(1, None)
    a, b = residual[tuple(first)], residual[tuple(second)]
    both = (mask[tuple(first[:3])] & mask[tuple(second[:3])])
    a, b = a[both].ravel(), b[both].ravel()
    if a.size < 3:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def volume_correlation(residual, mask):
    """Mean |correlation| between the residuals of two different volumes, over the mask's voxels."""
    series = residual[mask]  # (V, T)
    series = series - series.mean(axis=0)
    norms = np.linalg.norm(series, axis=0)
    norms[norms == 0] = 1
    correlation = (series.T @ series) / np.outer(norms, norms)
    off = ~np.eye(correlation.shape[0], dtype=bool)
    return float(np.abs(correlation[off]).mean())


def whiteness(noisy, denoised, mask, sigma=None, rank=None, demeaned=False):
    residual = np.asarray(noisy, np.float64) - np.asarray(denoised, np.float64)
    measures = {f"lag1_{axis}": lag1_correlation(residual, mask, k) for k, axis in enumerate("xyz")}
    measures["volume_abs_correlation"] = volume_correlation(residual, mask)
    if sigma is not None and rank is not None:  # the projection's share needs the rank map
        from mppca_nipype.reports import expected_residual_sd

        expected = expected_residual_sd(np.asarray(sigma, np.float64), rank, noisy.shape[3], demeaned)
        usable = mask & (expected > 0) & np.isfinite(expected)
        measures["scaled_residual_sd"] = float((residual[usable] / expected[usable, None]).std()) \
            if usable.any() else None
    return measures


def load_real(name):
    import nibabel as nib
    from dipy.data import get_fnames

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = get_fnames(name=name)[0]
    noisy = np.asarray(nib.load(path).get_fdata(dtype=np.float32))
    mask = np.ones(noisy.shape[:3], dtype=bool)  # tiny crops of brain: every voxel
    return peers.Phantom(name, noisy, noisy, mask, float("nan"), f"DIPY {name} {noisy.shape}")


def bench_real(args, methods):
    rows = []
    for name in REAL_DATA:
        data = load_real(name)
        peers.log(f"quality: {name} {data.noisy.shape}")
        with peers.NiftiPhantom(data) as files:
            runner = peers.Dwidenoise(files, args.threads)
            reference, reference_sigma = runner.denoise(datatype="float64")
            scale = peers.rms(data.noisy)
            for method in methods:
                (denoised, sigma, rank), seconds = measure(method, data, args, runner)
                row = dict(data=name, shape=list(data.noisy.shape), method=method, seconds=min(seconds),
                           runs=peers.runs_label(seconds),
                           rel_rms_diff_to_dwidenoise=peers.rms(np.asarray(denoised, np.float64) - reference)
                           / scale)
                if sigma is not None:
                    ratio = np.asarray(sigma, np.float64)[reference_sigma > 0] / reference_sigma[reference_sigma > 0]
                    row["sigma_median_abs_rel_diff"] = float(np.nanmedian(np.abs(ratio - 1)))
                from mppca_nipype.engine import DEFAULTS

                demeaned = method == "ours (defaults)" and DEFAULTS["demean"] != "none"
                row.update(whiteness(data.noisy, denoised, data.mask, sigma, rank, demeaned))
                rows.append(row)
                peers.log(f"  {method:24s} diff {row['rel_rms_diff_to_dwidenoise']:.2e} "
                          f"lag1 x {row['lag1_x']:+.3f} vol {row['volume_abs_correlation']:.3f}")
    return rows


# -- tables ----------------------------------------------------------------------------------------------

def fmt(value, spec):
    return "" if value is None or (isinstance(value, float) and not np.isfinite(value)) else format(value, spec)


def markdown(result) -> str:
    lines = ["## Phantoms with a known truth", "",
             "| phantom | method | RMSE mask (input) | RMSE all | sigma median rel. err. | sigma rms rel. err. "
             "| time (s) | runs |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in result["phantoms"]:
        lines.append(f"| {row['phantom']} | {row['method']} | {fmt(row['rmse_mask'], '.3f')} "
                     f"({fmt(row['input_rmse_mask'], '.3f')}) | {fmt(row['rmse_all'], '.3f')} | "
                     f"{fmt(row.get('sigma_median_rel'), '+.3f')} | {fmt(row.get('sigma_rms_rel'), '.3f')} | "
                     f"{fmt(row['seconds'], '.2f')} | {row['runs']} |")
    lines += ["", "## Real DWI (DIPY small_64D, small_101D): agreement with dwidenoise -datatype float64 and "
              "residual whiteness", "",
              "| data | method | rel. rms diff. to dwidenoise | sigma median abs rel. diff. "
              "| lag-1 corr. x / y / z | mean abs corr. between volumes | scaled residual SD | time (s) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["real"]:
        lags = " / ".join(fmt(row.get(f"lag1_{a}"), "+.3f") for a in "xyz")
        lines.append(f"| {row['data']} | {row['method']} | {fmt(row['rel_rms_diff_to_dwidenoise'], '.2e')} | "
                     f"{fmt(row.get('sigma_median_abs_rel_diff'), '.3f')} | {lags} | "
                     f"{fmt(row['volume_abs_correlation'], '.3f')} | "
                     f"{fmt(row.get('scaled_residual_sd'), '.3f')} | {fmt(row['seconds'], '.2f')} |")
    settings = result["settings"]
    lines += ["", f"{settings['threads']} threads for every method; wall time: "
              f"{peers.timing_note(settings['repeats'], settings['single_above'])}; "
              "ours, DIPY and patch-denoise in this process (ours after one warm-up call); dwidenoise a new "
              "process, file to file (its time includes reading and writing NIfTI).", "",
              harness.stamp_markdown(result["stamp"]), "", harness.load_note(result["stamp"])]
    return "\n".join(lines) + "\n"


# -- main ------------------------------------------------------------------------------------------------

def parse_volumes(text):
    try:
        volumes = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"volumes are integers separated by commas, not {text!r}") from None
    if min(volumes) < 3:
        raise argparse.ArgumentTypeError("every number of volumes must be at least 3")
    return volumes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny phantoms, T = 32 and 64: a smoke test")
    parser.add_argument("--threads", type=int, default=2, help="cores for every method (default 2)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the process to --threads CPUs")
    parser.add_argument("--shape", type=peers.parse_shape, help="phantom shape X,Y,Z")
    parser.add_argument("--volumes", type=parse_volumes, help="numbers of volumes, e.g. 32,64,128,300")
    parser.add_argument("--skip", default="", help="peers to leave out: dwidenoise,dipy,patch-denoise")
    parser.add_argument("--no-real", action="store_true", help="leave out the real DWI (DIPY small_64D, small_101D)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs (default 3)")
    parser.add_argument("--single-above", type=float, default=20.0,
                        help="one run only when the first takes longer (seconds, default 20)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "quality.json")
    args = parser.parse_args(argv)

    skip = {SKIP_NAMES[s.strip()] for s in args.skip.split(",") if s.strip()} if args.skip else set()
    unknown = {s.strip() for s in args.skip.split(",") if s.strip()} - set(SKIP_NAMES)
    if unknown:
        parser.error(f"--skip knows {', '.join(SKIP_NAMES)}, not {', '.join(sorted(unknown))}")
    args.shape = args.shape or (QUICK_SHAPE if args.quick else FULL_SHAPE)
    args.volumes = args.volumes or (QUICK_VOLUMES if args.quick else FULL_VOLUMES)
    args.lowrank = QUICK_LOWRANK if args.quick else FULL_LOWRANK
    args.dwi = QUICK_DWI if args.quick else FULL_DWI
    if args.quick:
        args.repeats = min(args.repeats, 1)

    pinned = [] if args.no_pin else peers.pin_to_cores(args.threads)
    run = harness.stamp()
    methods = available(list(METHODS), skip)
    peers.warm_up_ours(args.threads)

    result = dict(stamp=run,
                  settings=dict(threads=args.threads, pinned_cpus=pinned, quick=args.quick, shape=list(args.shape),
                                volumes=list(args.volumes),
                                lowrank=[list(p) for p in args.lowrank], dwi=list(args.dwi), methods=methods,
                                repeats=args.repeats, single_above=args.single_above),
                  phantoms=bench_phantoms(args, methods), real=[])
    if not args.no_real:
        if "dwidenoise" not in methods or not peers.have("dipy"):
            peers.log("quality: the real DWI needs dwidenoise and dipy; left out")
        else:
            result["real"] = bench_real(args, methods)

    harness.finish(run)
    table = markdown(result)
    written = harness.write_result(args.out, result, table)
    print(table)
    peers.log("quality: wrote " + " and ".join(map(str, written)))


if __name__ == "__main__":
    main()
