"""The magnitude noise floor: MP-PCA of magnitude phantoms with and without the floor removed.

Phantoms: the head-shaped DWI phantom (``mppca_nipype.phantoms.dwi_phantom``, seed 0, b = 0 signal near
1000) with Rician noise (one complex channel) and with non-central chi noise (the root sum of squares of 4
channels), at SNR 2, 5, 10 and 20 (sigma = 1000 / SNR per real channel). Methods: ``denoise`` with its
defaults and no floor (``none``); with the floor of the data's model (``rician``, or ``ncchi`` with 4 coils),
sigma estimated (a first MP-PCA pass, corrected) or given (the true sigma). Measures, against the truth: RMSE
in the head and over the whole image, the mean bias where the true signal is below 3 sigma in the head (the
floor's region), the median sigma used in the head and outside it over the true sigma, and the time (one
run, ``--threads`` worker processes, in this process after a warm-up call).

Usage (from the repository root)::

    python benchmarks/noise_floor.py --threads 2
    python benchmarks/noise_floor.py --quick

Writes JSON to ``--out`` (default benchmarks/results/noise_floor.json) and the Markdown table next to it,
stamped by ``harness.stamp()``; prints the table last.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import time

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from mppca_nipype import denoise  # noqa: E402
from mppca_nipype.phantoms import dwi_phantom  # noqa: E402

SHAPE, VOLUMES, SNRS = (32, 32, 24), 32, (2, 5, 10, 20)
QUICK_SHAPE, QUICK_VOLUMES, QUICK_SNRS = (16, 16, 12), 20, (5,)
#: (label, channels, the floor model that fits the data)
DATA = (("Rician", 1, "rician"), ("4 channels", 4, "ncchi"))


def scores(denoised, truth, sigma, sigma_used=None) -> dict:
    head = truth[..., 0] > 0
    low = (truth < 3 * sigma) & head[..., None]
    error = np.asarray(denoised, np.float64) - truth
    row = dict(rmse_head=float(np.sqrt(np.mean(error[head] ** 2))), rmse_all=float(np.sqrt(np.mean(error**2))),
               bias_low=float(error[low].mean()), low_voxel_volumes=int(low.sum()))
    if sigma_used is not None:
        row.update(sigma_head=float(np.median(sigma_used[head]) / sigma),
                   sigma_outside=float(np.median(sigma_used[~head]) / sigma) if (~head).any() else None)
    return row


def bench(args) -> list[dict]:
    rows = []
    for label, coils, model in DATA:
        for snr in args.snrs:
            sigma = 1000.0 / snr
            noisy, truth, _, _ = dwi_phantom(shape=args.shape, n_volumes=args.volumes, sigma=sigma, rician=True,
                                             coils=coils, seed=0)
            runs = (("none", {}), (f"{model}, sigma estimated", dict(noise_floor=model, coils=coils)),
                    (f"{model}, sigma given", dict(noise_floor=model, coils=coils, noise=sigma)))
            for method, options in runs:
                started = time.perf_counter()
                result = denoise(noisy, device="cpu", nprocs=args.threads, **options)
                seconds = time.perf_counter() - started
                row = dict(data=label, coils=coils, snr=snr, sigma=sigma, method=method, seconds=seconds,
                           **scores(result.denoised, truth, sigma, result.sigma))
                rows.append(row)
                print(f"noise_floor: {label} SNR {snr} {method:24s} rmse head {row['rmse_head']:.1f} "
                      f"bias {row['bias_low']:+.1f} {seconds:.2f} s", file=sys.stderr)
            rows.append(dict(data=label, coils=coils, snr=snr, sigma=sigma, method="input (no denoising)",
                             seconds=None, **scores(noisy, truth, sigma)))
    return rows


def fmt(value, spec):
    return "" if value is None else format(value, spec)


def markdown(result) -> str:
    lines = ["| data | SNR | method | RMSE head | RMSE all | bias, truth < 3 sigma | sigma used / true: head, "
             "outside | time (s) |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        used = (f"{fmt(row.get('sigma_head'), '.3f')}, {fmt(row.get('sigma_outside'), '.3f')}"
                if "sigma_head" in row else "")
        lines.append(f"| {row['data']} | {row['snr']} | {row['method']} | {row['rmse_head']:.1f} | "
                     f"{row['rmse_all']:.1f} | {row['bias_low']:+.1f} | {used} | {fmt(row['seconds'], '.2f')} |")
    settings = result["settings"]
    lines += ["", f"Phantom {'x'.join(map(str, settings['shape']))}, T = {settings['volumes']}, b = 0 signal "
              f"near 1000; {settings['threads']} worker processes; `denoise`'s defaults otherwise.", "",
              harness.stamp_markdown(result["stamp"]), "", harness.load_note(result["stamp"])]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small phantom per model at SNR 5")
    parser.add_argument("--threads", type=int, default=2, help="CPU worker processes (default 2)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "noise_floor.json")
    args = parser.parse_args(argv)
    args.shape = QUICK_SHAPE if args.quick else SHAPE
    args.volumes = QUICK_VOLUMES if args.quick else VOLUMES
    args.snrs = QUICK_SNRS if args.quick else SNRS
    run = harness.stamp()
    warm, _, _, _ = dwi_phantom(shape=QUICK_SHAPE, n_volumes=QUICK_VOLUMES, rician=True)
    for _, coils, model in DATA:  # the worker pool and each model's tables, before anything is timed
        denoise(warm, device="cpu", nprocs=args.threads, noise_floor=model, coils=coils)
    result = dict(stamp=run, settings=dict(threads=args.threads, quick=args.quick, shape=list(args.shape),
                                           volumes=args.volumes, snrs=list(args.snrs)), rows=bench(args))
    harness.finish(run)
    table = markdown(result)
    written = harness.write_result(args.out, result, table)
    print(table)
    print("noise_floor: wrote " + " and ".join(map(str, written)), file=sys.stderr)


if __name__ == "__main__":
    main()
