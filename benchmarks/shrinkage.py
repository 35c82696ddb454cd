"""The filters (``denoise(filter=...)``), the estimators (``estimator=...``) or the weighted and Gaussian
aggregations (``aggregation=...``) against each other on phantoms with a known truth.

The phantoms of ``quality.py`` (the low-rank series at ranks 3 and 10 and noise 5 and 20, the head-shaped DWI
phantom at noise 10 and 30), for every T in ``--volumes`` (default 32, 64, 128, 300), on quality.py's grid
(``--shape``, default 48x48x32; about 8 minutes a value on 2 cores). Each phantom is denoised
with our defaults and each filter (``--vary filter``, the default), each estimator (``--vary estimator``) or
the two aggregations of every patch (``--vary aggregation``) on the CPU engine; the table gives the RMSE to
the truth in the mask, its ratio to the default's (``hard``, ``exp2``, ``weighted``), the noise map's median
relative error and the mean rank, and per T the geometric mean of the ratios over the phantoms.

Usage (from the repository root)::

    python benchmarks/shrinkage.py --threads 2
    python benchmarks/shrinkage.py --threads 2 --vary estimator --out benchmarks/results/estimators.json
    python benchmarks/shrinkage.py --threads 2 --vary aggregation --out benchmarks/results/aggregation.json

Writes JSON to ``--out`` (default benchmarks/results/shrinkage.json: ``stamp`` and ``rows``) and a Markdown
table next to it (``.md``); the table is printed last.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import time
import warnings

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import cpu_peers as peers  # noqa: E402  (scoring)
import harness  # noqa: E402
from quality import FULL_DWI, FULL_LOWRANK, FULL_SHAPE, FULL_VOLUMES, parse_volumes, phantom_grid  # noqa: E402

from mppca_nipype.engine.estimators import ESTIMATORS, FILTERS  # noqa: E402

#: What ``--vary`` may vary: the option's values, the first the baseline of the ratios.
CHOICES = {"filter": FILTERS, "estimator": ESTIMATORS, "aggregation": ("weighted", "gaussian")}


def measure(args):
    from mppca_nipype import denoise
    from mppca_nipype.engine import MPPCAWarning

    rows = []
    for n_volumes, make in phantom_grid(args.shape, args.volumes, FULL_LOWRANK, FULL_DWI):
        phantom = make()
        for value in CHOICES[args.vary]:
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MPPCAWarning)
                result = denoise(phantom.noisy, **{args.vary: value}, device="cpu", nprocs=args.threads)
            seconds = time.perf_counter() - started
            row = {"phantom": phantom.name, "volumes": n_volumes, args.vary: value, "seconds": round(seconds, 3),
                   "mean_rank": float(result.rank[phantom.mask].mean()),
                   **peers.score(phantom, result.denoised, result.sigma)}
            rows.append(row)
            print(f"{phantom.name:24s} {value:10s} rmse {row['rmse_mask']:.4f} {seconds:.2f} s", file=sys.stderr)
    baseline = CHOICES[args.vary][0]
    base = {row["phantom"]: row["rmse_mask"] for row in rows if row[args.vary] == baseline}
    for row in rows:
        row[f"ratio_to_{baseline}"] = row["rmse_mask"] / base[row["phantom"]]
    return rows


def geometric_means(rows, vary):
    """{(value, T): geometric mean over the phantoms of the RMSE ratio to the baseline}, and over every T."""
    ratio = f"ratio_to_{CHOICES[vary][0]}"
    means = {}
    for value in CHOICES[vary]:
        for n_volumes in sorted({row["volumes"] for row in rows}) + [None]:
            ratios = [row[ratio] for row in rows if row[vary] == value and n_volumes in (None, row["volumes"])]
            means[(value, n_volumes)] = float(np.exp(np.mean(np.log(ratios))))
    return means


def markdown(result) -> str:
    rows, vary = result["rows"], result["settings"].get("vary", "filter")
    baseline = CHOICES[vary][0]
    volumes = sorted({row["volumes"] for row in rows})
    means = geometric_means(rows, vary)
    lines = [f"RMSE to the truth in the mask, relative to `{baseline}` (geometric mean over the phantoms):", "",
             f"| {vary} | " + " | ".join(f"T = {t}" for t in volumes) + " | all T |",
             "| --- | " + " | ".join("---:" for _ in volumes) + " | ---: |"]
    for value in CHOICES[vary]:
        cells = [f"{means[(value, t)]:.3f}" for t in volumes + [None]]
        lines.append(f"| `{value}` | " + " | ".join(cells) + " |")
    lines += ["", f"| phantom | {vary} | RMSE (mask) | / {baseline} | sigma median rel. error | mean rank | s |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['phantom']} | `{row[vary]}` | {row['rmse_mask']:.4f} | "
                     f"{row[f'ratio_to_{baseline}']:.3f} | {row['sigma_median_rel']:+.4f} | {row['mean_rank']:.2f} | "
                     f"{row['seconds']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="CPU worker processes (default: 2)")
    parser.add_argument("--volumes", type=parse_volumes, default=FULL_VOLUMES,
                        help="numbers of volumes T, comma-separated (default: 32,64,128,300)")
    parser.add_argument("--shape", type=lambda text: tuple(int(v) for v in text.split(",")), default=FULL_SHAPE,
                        help="the phantoms' grid X,Y,Z (default: quality.py's, 48,48,32)")
    parser.add_argument("--vary", choices=tuple(CHOICES), default="filter",
                        help="the option compared: each filter (the default), estimator or aggregation")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "shrinkage.json")
    args = parser.parse_args(argv)
    run = harness.stamp()
    result = dict(stamp=run, settings=dict(shape=list(args.shape), volumes=list(args.volumes),
                                           threads=args.threads, vary=args.vary,
                                           options=f"the defaults; {args.vary} varies"),
                  rows=measure(args))
    harness.finish(run)
    table = markdown(result)
    harness.write_result(args.out, result, markdown=harness.stamp_markdown(run) + "\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
