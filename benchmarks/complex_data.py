"""Complex data: MP-PCA of the phase-demodulated real part against magnitude-only denoising.

Phantom: the head-shaped DWI phantom's signal (``mppca_nipype.phantoms.complex_dwi_phantom``, seed 0, b = 0
signal near 1000) on a smooth background phase (a shared field of peak pi plus a per-volume field of peak pi / 2),
with complex Gaussian noise of sigma = 1000 / SNR per real channel, at SNR 2, 5, 10 and 20. Methods: the
magnitude with ``denoise``'s defaults (``none``); the magnitude with ``noise_floor="rician"`` (sigma estimated);
``denoise_complex`` (Hann background phase, the real part denoised) with the magnitude taken as max(R_hat, 0)
(``clip``) and as |R_hat| (``abs``), with the phase of the complex image first denoised (``mppca``), and, to
show what the phase estimate costs, with the Hann filter's widths and passes varied (``--widths``). Measures,
against the truth: RMSE in the head and over the whole image, the mean bias where the true signal is below 3
sigma in the head, the median sigma in the head over the true sigma, the rms of the demodulated imaginary part
over sigma, and the time (``--threads`` worker processes).

Usage (from the repository root)::

    python benchmarks/complex_data.py --threads 2
    python benchmarks/complex_data.py --quick
    python benchmarks/complex_data.py --filter hard --out benchmarks/results/complex_data_hard.json

Writes JSON to ``--out`` (default benchmarks/results/complex_data.json) and the Markdown table next to it,
stamped by ``harness.stamp()``; prints the table last.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import time

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from mppca_nipype import denoise, denoise_complex  # noqa: E402
from mppca_nipype.engine.complex_data import PHASE_PASSES, PHASE_WIDTH  # noqa: E402
from mppca_nipype.engine.estimators import FILTERS as FILTER_CHOICES  # noqa: E402
from mppca_nipype.phantoms import complex_dwi_phantom  # noqa: E402
# the noise floor's phantom sizes and SNRs, so that the two tables compare
from noise_floor import (QUICK_SHAPE, QUICK_SNRS, QUICK_VOLUMES, SHAPE, SNRS, VOLUMES, fmt,  # noqa: E402
                         scores)
#: Hann filters compared with ``--widths``: (width, passes).
FILTERS = ((0.25, 1), (0.25, 2), (0.25, 3), (0.375, 1), (0.375, 2), (0.375, 3), (0.5, 1), (0.5, 2))


def bench(args) -> list[dict]:
    rows = []
    for snr in args.snrs:
        sigma = 1000.0 / snr
        magnitude, phase, truth, _, _, _ = complex_dwi_phantom(args.shape, args.volumes, sigma=sigma, seed=0)
        given = dict(device="cpu", nprocs=args.threads, **({"filter": args.filter} if args.filter else {}))
        runs = [("magnitude, none", lambda: denoise(magnitude, **given)),
                ("magnitude, rician", lambda: denoise(magnitude, noise_floor="rician", **given))]
        for out in ("clip", "abs"):
            runs.append((f"complex, {out}", lambda out=out: denoise_complex(magnitude, phase, magnitude_out=out,
                                                                            **given)))
        runs.append(("complex, clip, mppca", lambda: denoise_complex(magnitude, phase, phase_method="mppca",
                                                                     **given)))
        filters = FILTERS if args.widths else ()
        for width, passes in filters:
            if (width, passes) != (PHASE_WIDTH, PHASE_PASSES):
                runs.append((f"complex, clip, Hann {width} x{passes}", lambda w=width, p=passes: denoise_complex(
                    magnitude, phase, phase_width=w, phase_passes=p, **given)))
        for method, call in runs:
            started = time.perf_counter()
            result = call()
            seconds = time.perf_counter() - started
            row = dict(snr=snr, sigma=sigma, method=method, seconds=seconds,
                       **scores(result.denoised, truth, sigma, result.sigma))
            row["imaginary_sd_ratio"] = result.info.get("imaginary_sd_ratio")
            rows.append(row)
            print(f"complex_data: SNR {snr} {method:34s} rmse head {row['rmse_head']:.1f} all {row['rmse_all']:.1f} "
                  f"bias {row['bias_low']:+.1f} {seconds:.2f} s", file=sys.stderr)
        rows.append(dict(snr=snr, sigma=sigma, method="input magnitude (no denoising)", seconds=None,
                         **scores(magnitude, truth, sigma)))
    return rows


def markdown(result) -> str:
    base = {row["snr"]: row for row in result["rows"] if row["method"] == "magnitude, none"}
    lines = ["| SNR | method | RMSE head | RMSE all | RMSE all / none's | bias, truth < 3 sigma | bias / none's | "
             "sigma / true (head) | rms Im / sigma | time (s) |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        ref = base[row["snr"]]
        lines.append(f"| {row['snr']} | {row['method']} | {row['rmse_head']:.1f} | {row['rmse_all']:.1f} | "
                     f"{row['rmse_all'] / ref['rmse_all']:.2f} | {row['bias_low']:+.1f} | "
                     f"{row['bias_low'] / ref['bias_low']:+.2f} | {fmt(row.get('sigma_head'), '.3f')} | "
                     f"{fmt(row.get('imaginary_sd_ratio'), '.3f')} | {fmt(row['seconds'], '.2f')} |")
    settings = result["settings"]
    lines += ["", f"Phantom {'x'.join(map(str, settings['shape']))}, T = {settings['volumes']}, b = 0 signal "
              f"near 1000; {settings['threads']} worker processes; "
              f"{'filter ' + repr(settings['filter']) + ', ' if settings.get('filter') else ''}"
              "`denoise`'s defaults otherwise; Hann width "
              f"{settings['phase_width']}, {settings['phase_passes']} passes unless the row says.", "",
              harness.stamp_markdown(result["stamp"]), "", harness.load_note(result["stamp"])]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small phantom at SNR 5")
    parser.add_argument("--widths", action="store_true", help="also compare the Hann filter's widths and passes")
    parser.add_argument("--threads", type=int, default=2, help="CPU worker processes (default 2)")
    parser.add_argument("--filter", choices=FILTER_CHOICES,
                        help="the eigenvalue filter of every run (default: denoise's own)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "complex_data.json")
    args = parser.parse_args(argv)
    args.shape = QUICK_SHAPE if args.quick else SHAPE
    args.volumes = QUICK_VOLUMES if args.quick else VOLUMES
    args.snrs = QUICK_SNRS if args.quick else SNRS
    run = harness.stamp()
    warm, phase, _, _, _, _ = complex_dwi_phantom(QUICK_SHAPE, QUICK_VOLUMES)
    # the worker pool and the Rician tables, before anything is timed
    denoise_complex(warm, phase, device="cpu", nprocs=args.threads)
    denoise(warm, device="cpu", nprocs=args.threads, noise_floor="rician")
    result = dict(stamp=run, settings=dict(threads=args.threads, quick=args.quick, shape=list(args.shape),
                                           volumes=args.volumes, snrs=list(args.snrs), phase_width=PHASE_WIDTH,
                                           phase_passes=PHASE_PASSES, filter=args.filter),
                  rows=bench(args))
    harness.finish(run)
    table = markdown(result)
    written = harness.write_result(args.out, result, table)
    print(table)
    print("complex_data: wrote " + " and ".join(map(str, written)), file=sys.stderr)


if __name__ == "__main__":
    main()
