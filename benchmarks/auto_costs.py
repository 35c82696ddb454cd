"""The CPU side of ``device="auto"``'s cost model (``mppca_nipype.engine.costs``), measured and fitted.

Each case (a phantom's geometry and options, chosen around where the two engines cross and beyond it) runs
``denoise(device="cpu")`` in this process on one worker and on ``--workers`` workers, after a warm-up call
that starts the pool; the engine's own seconds (``info["seconds"]["backend"]``) are kept. The model's
per-window constants (``CPU_SECONDS_PER_PRODUCT``, ``CPU_SECONDS_PER_EIGEN``, ``CPU_SECONDS_PER_WINDOW``)
are then fitted to the one-worker times (non-negative least squares on the relative error), and its serial
share (``CPU_SERIAL_SHARE``) to the speed-ups (their median). The table sets each case's measured seconds
beside the model's, with the constants in ``costs`` now and with the fitted ones.

Usage (from the repository root)::

    python benchmarks/auto_costs.py --workers 16
    python benchmarks/auto_costs.py --quick --workers 2

Writes JSON to ``--out`` (default benchmarks/results/auto_costs.json) and the Markdown table next to it,
stamped by ``harness.stamp()``; prints the table last.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import math
from pathlib import Path
import sys

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from mppca_nipype import denoise  # noqa: E402
from mppca_nipype.engine import costs, resolve_options  # noqa: E402
from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom  # noqa: E402


@dataclass(frozen=True)
class Case:
    label: str
    shape: tuple
    volumes: int
    options: dict
    phantom: str = "dwi"  # or "lowrank" (rank 5 on a baseline of 1000)


CASES = (
    Case("the seed's problem", (96, 96, 48), 48, dict(extent=11, stride=3, demean="voxel"), "lowrank"),
    Case("64x64x40 x 32", (64, 64, 40), 32, {}),
    Case("64x64x40 x 100", (64, 64, 40), 100, {}),
    Case("96x96x60 x 100", (96, 96, 60), 100, {}),
    Case("48x48x30 x 200", (48, 48, 30), 200, {}),
    Case("64x64x40 x 300", (64, 64, 40), 300, {}),
)
QUICK_CASES = (
    Case("24x24x16 x 32", (24, 24, 16), 32, {}),
    Case("24x24x16 x 100", (24, 24, 16), 100, {}),
    Case("the seed's settings, 32x32x24 x 48", (32, 32, 24), 48, dict(extent=11, stride=3, demean="voxel"),
         "lowrank"),
)


def features(case: Case) -> tuple[np.ndarray, int]:
    """The model's terms for the case's windows: (products, eigen, windows) summed over its windows."""
    defaults = dict(extent="wide", stride=3, estimator="exp2", aggregation="weighted", demean="volume")
    options = resolve_options(case.shape + (case.volumes,), **{**defaults, **case.options})
    windows = costs.window_count(case.shape, options.extent, options.stride)
    n = math.prod(options.extent)
    m = min(n, case.volumes)
    return np.array([windows * n * case.volumes * m, windows * m**3, windows], dtype=np.float64), windows


def series(case: Case) -> np.ndarray:
    if case.phantom == "lowrank":
        return low_rank_phantom(case.shape, case.volumes, rank=5, sigma=4.0, baseline=1000.0, seed=0)[0]
    return dwi_phantom(case.shape, case.volumes, sigma=20.0, seed=0)[0]


def engine_seconds(noisy, case: Case, workers: int) -> float:
    result = denoise(noisy, device="cpu", nprocs=workers, **case.options)
    return float(result.info["seconds"]["backend"])


def model_seconds(terms, constants: dict, workers: int) -> float:
    work = float(terms @ np.array([constants["product"], constants["eigen"], constants["window"]]))
    speed_up = workers / (1 + constants["serial"] * (workers - 1))
    return (costs.CPU_START_SECONDS if workers > 1 else 0.0) + work / speed_up


def bench(args) -> dict:
    rows = []
    warm = dwi_phantom((16, 16, 16), 32, sigma=20.0)[0]
    for workers in (1, args.workers):
        denoise(warm, device="cpu", nprocs=workers)  # the imports and the pool's start
    for case in QUICK_CASES if args.quick else CASES:
        noisy = series(case)
        terms, windows = features(case)
        one = engine_seconds(noisy, case, 1)
        many = engine_seconds(noisy, case, args.workers)
        rows.append(dict(case=case.label, windows=windows, terms=terms.tolist(), one_worker=one, workers=many))
        print(f"auto_costs: {case.label}: {one:.2f} s on 1 worker, {many:.2f} s on {args.workers}", file=sys.stderr)
    return dict(rows=rows, workers=args.workers, fitted=fit(rows, args.workers), current=current_constants())


def current_constants() -> dict:
    return dict(product=costs.CPU_SECONDS_PER_PRODUCT, eigen=costs.CPU_SECONDS_PER_EIGEN,
                window=costs.CPU_SECONDS_PER_WINDOW, serial=costs.CPU_SERIAL_SHARE)


def fit(rows, workers: int) -> dict:
    """Non-negative per-window constants minimising the one-worker times' squared relative error, and the
    serial share whose speed-up is the median of the cases' (``speed-up = p / (1 + s (p - 1))``)."""
    from scipy.optimize import nnls

    terms = np.array([row["terms"] for row in rows])
    times = np.array([row["one_worker"] for row in rows])
    (product, eigen, window), _ = nnls(terms / times[:, None], np.ones(len(rows)))
    shares = ([(workers * row["workers"] / row["one_worker"] - 1) / (workers - 1) for row in rows]
              if workers > 1 else [0])
    return dict(product=float(product), eigen=float(eigen), window=float(window), serial=float(np.median(shares)))


def table(result: dict) -> str:
    workers, current, fitted = result["workers"], result["current"], result["fitted"]
    lines = [f"The CPU engine's own seconds against `costs`' estimate, with its constants now and fitted; "
             f"{workers} workers beside 1.", "",
             f"| case | windows | 1 worker s | model now | model fitted | {workers} workers s | model now | "
             "model fitted |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        terms = np.array(row["terms"])
        lines.append(f"| {row['case']} | {row['windows']:,} | {row['one_worker']:.2f} | "
                     f"{model_seconds(terms, current, 1):.2f} | {model_seconds(terms, fitted, 1):.2f} | "
                     f"{row['workers']:.2f} | {model_seconds(terms, current, workers):.2f} | "
                     f"{model_seconds(terms, fitted, workers):.2f} |")
    lines += ["", "| constant | now | fitted |", "| --- | ---: | ---: |"]
    for name, key in (("CPU_SECONDS_PER_PRODUCT", "product"), ("CPU_SECONDS_PER_EIGEN", "eigen"),
                      ("CPU_SECONDS_PER_WINDOW", "window"), ("CPU_SERIAL_SHARE", "serial")):
        lines.append(f"| `{name}` | {current[key]:.3g} | {fitted[key]:.3g} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16, help="worker processes beside 1 (default 16)")
    parser.add_argument("--quick", action="store_true", help="three small cases (a smoke test)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "auto_costs.json")
    args = parser.parse_args(argv)
    harness.measure_and_write(args.out, lambda: bench(args), table)


if __name__ == "__main__":
    main()
