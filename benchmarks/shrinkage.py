"""The filters (``denoise(filter=...)``) against each other on phantoms with a known truth.

The phantoms of ``quality.py`` (the low-rank series at ranks 3 and 10 and noise 5 and 20, the head-shaped DWI
phantom at noise 10 and 30), for every T in ``--volumes`` (default 32, 64, 128, 300), on a smaller grid
(``--shape``, default 24x24x16) so that the whole table takes minutes on 2 cores. Each phantom is denoised
with our defaults and each filter on the CPU engine; the table gives the RMSE to the truth in the mask, its
ratio to ``hard``'s, the noise map's median relative error and the mean rank, and per T the geometric mean of
the ratios over the phantoms (the issue's target: optshrink <= 0.95 x hard).

Usage (from the repository root)::

    python benchmarks/shrinkage.py --threads 2

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
from quality import FULL_DWI, FULL_LOWRANK, FULL_VOLUMES, parse_volumes, phantom_grid  # noqa: E402

FILTERS = ("hard", "optshrink", "optthresh")
SHAPE = (24, 24, 16)


def measure(args):
    from mppca_nipype import denoise
    from mppca_nipype.engine import MPPCAWarning

    rows = []
    for n_volumes, make in phantom_grid(args.shape, args.volumes, FULL_LOWRANK, FULL_DWI):
        phantom = make()
        for filter_name in FILTERS:
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MPPCAWarning)
                result = denoise(phantom.noisy, filter=filter_name, device="cpu", nprocs=args.threads)
            seconds = time.perf_counter() - started
            row = dict(phantom=phantom.name, volumes=n_volumes, filter=filter_name, seconds=round(seconds, 3),
                       mean_rank=float(result.rank[phantom.mask].mean()),
                       **peers.score(phantom, result.denoised, result.sigma))
            rows.append(row)
            print(f"{phantom.name:24s} {filter_name:10s} rmse {row['rmse_mask']:.4f} {seconds:.2f} s",
                  file=sys.stderr)
    hard = {row["phantom"]: row["rmse_mask"] for row in rows if row["filter"] == "hard"}
    for row in rows:
        row["ratio_to_hard"] = row["rmse_mask"] / hard[row["phantom"]]
    return rows


def geometric_means(rows):
    """{(filter, T): geometric mean over the phantoms of the RMSE ratio to hard}, and over every T."""
    means = {}
    for filter_name in FILTERS:
        for n_volumes in sorted({row["volumes"] for row in rows}) + [None]:
            ratios = [row["ratio_to_hard"] for row in rows
                      if row["filter"] == filter_name and n_volumes in (None, row["volumes"])]
            means[(filter_name, n_volumes)] = float(np.exp(np.mean(np.log(ratios))))
    return means


def markdown(result) -> str:
    rows = result["rows"]
    volumes = sorted({row["volumes"] for row in rows})
    means = geometric_means(rows)
    lines = ["RMSE to the truth in the mask, relative to `hard` (geometric mean over the phantoms):", "",
             "| filter | " + " | ".join(f"T = {t}" for t in volumes) + " | all T |",
             "| --- | " + " | ".join("---:" for _ in volumes) + " | ---: |"]
    for filter_name in FILTERS:
        cells = [f"{means[(filter_name, t)]:.3f}" for t in volumes + [None]]
        lines.append(f"| `{filter_name}` | " + " | ".join(cells) + " |")
    lines += ["", "| phantom | filter | RMSE (mask) | / hard | sigma median rel. error | mean rank | s |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['phantom']} | `{row['filter']}` | {row['rmse_mask']:.4f} | "
                     f"{row['ratio_to_hard']:.3f} | {row['sigma_median_rel']:+.4f} | {row['mean_rank']:.2f} | "
                     f"{row['seconds']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="CPU worker processes (default: 2)")
    parser.add_argument("--volumes", type=parse_volumes, default=FULL_VOLUMES,
                        help="numbers of volumes T, comma-separated (default: 32,64,128,300)")
    parser.add_argument("--shape", type=lambda text: tuple(int(v) for v in text.split(",")), default=SHAPE,
                        help="the phantoms' grid X,Y,Z (default: 24,24,16)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "shrinkage.json")
    args = parser.parse_args(argv)
    run = harness.stamp()
    result = dict(stamp=run, settings=dict(shape=list(args.shape), volumes=list(args.volumes),
                                           threads=args.threads, options="the defaults; filter varies"),
                  rows=measure(args))
    harness.finish(run)
    table = markdown(result)
    harness.write_result(args.out, result, markdown=harness.stamp_markdown(run) + "\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
