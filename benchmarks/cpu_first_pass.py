"""The CPU engine's float32 first pass against float64: the windows it leaves unsettled, whether its ranks are
float64's, and its time per window.

    python benchmarks/cpu_first_pass.py
    python benchmarks/cpu_first_pass.py --quick --out /tmp/cpu_first_pass.json      # a smoke test

One process, one BLAS thread (as each CPU worker runs). For each phantom (``cpu_peers.make_phantom``:
DWI and low-rank, several lengths) and each setting the float32 pass takes (voxel or volume demeaning,
the four estimators), up to ``--windows`` windows of the plan (its first ones: the head's edge and the background
beside it, where the largest eigenvalue is furthest above the noise) go through ``cpu.window_spectra`` in
float32 and in float64, and through ``cpu.fit_windows`` in float32 (unsettled windows redone in float64):

- ``unsettled``: the share of windows the settling test sends to float64 (``cpu.SETTLE_SLACK``);
- ``ranks differ before`` / ``after``: windows whose float32 rank differs from float64's, before the redo and
  after it (the redo exists for the first; the second must be 0);
- ``eigenvalue error``: the largest error of any float32 eigenvalue against float64's, in float32 roundings
  of the window's largest eigenvalue (median and largest over the windows);
- ``float32 us`` / ``float64 us``: ``fit_windows`` per window (gather, Gram, eigen step, threshold, kept
  eigenvectors, the redo), best of ``--repeats``, each precision on the same windows.

Writes JSON (stamped by ``harness.stamp()``) to ``--out`` and the Markdown table next to it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from cpu_peers import make_phantom  # noqa: E402

from mppca_nipype.engine import DEFAULTS, _finite_input, _plan, check_data, cpu, resolve_options  # noqa: E402

#: (phantom, volumes)
PHANTOMS = [("dwi:20", 100), ("dwi:10", 32), ("lowrank:5", 64), ("dwi:40", 300), ("lowrank:2", 48)]
#: (demeaning, estimator)
SETTINGS = [("volume", "exp2"), ("voxel", "exp1"), ("volume", "exp1"), ("volume", "olesen2023"), ("voxel", "med")]


def best_per_window(call, n_windows, repeats):
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1e6 * min(times) / n_windows


def measure_setting(rows_of_volume, finite, plan, options, n_windows, repeats) -> dict:
    windows = slice(0, min(plan.n_windows, n_windows))
    count = windows.stop
    float32 = cpu.window_spectra(rows_of_volume, finite, plan, options, windows, dtype=np.float32)
    float64 = cpu.window_spectra(rows_of_volume, finite, plan, options, windows)
    settled = cpu.fit_windows(rows_of_volume, finite, plan, options, windows, dtype=np.float32)
    rounding = np.finfo(np.float32).eps * np.maximum(float64.forms.eigenvalues[:, -1], 1e-300)
    error = np.abs(float32.forms.eigenvalues - float64.forms.eigenvalues).max(axis=1) / rounding
    step = cpu.batch_size(plan.patch_size, rows_of_volume.shape[1])

    def fit_all(dtype):
        for start in range(0, count, step):
            cpu.fit_windows(rows_of_volume, finite, plan, options, slice(start, min(start + step, count)),
                            dtype=dtype)

    return dict(windows=count, unsettled=float(np.mean(float32.unsettled)),
                ranks_differ_before=int(np.sum(float32.rank != float64.rank)),
                ranks_differ_after=int(np.sum(settled.rank != float64.rank)),
                eigenvalue_error_median=float(np.median(error)), eigenvalue_error_max=float(error.max()),
                float32_us=best_per_window(lambda: fit_all(np.float32), count, repeats),
                float64_us=best_per_window(lambda: fit_all(np.float64), count, repeats))


def measure(args) -> dict:
    rows = []
    for spec, volumes in args.phantoms:
        phantom = make_phantom(spec, args.shape, volumes, seed=3)
        data, mask = check_data(phantom.noisy, phantom.mask)
        for demean, estimator in SETTINGS:
            chosen = dict(DEFAULTS, demean=demean, estimator=estimator)
            options = resolve_options(data.shape, mask=mask, **{name: chosen[name] for name in (
                "extent", "stride", "estimator", "aggregation", "demean")})
            _, series, finite, _ = _finite_input(data, mask)
            plan = _plan(series, mask, finite, options)
            rows_of_volume = np.ascontiguousarray(series.reshape(-1, volumes))
            with threadpool_limits(1):
                row = measure_setting(rows_of_volume, finite.reshape(-1), plan, options, args.windows,
                                      args.repeats)
            rows.append(dict(phantom=spec, volumes=volumes, demean=demean, estimator=estimator,
                             extent=list(options.extent), **row))
            print(f"cpu_first_pass: {spec} T={volumes} {demean} {estimator}: {row['unsettled']:.1%} unsettled, "
                  f"ranks differ {row['ranks_differ_before']} -> {row['ranks_differ_after']}, "
                  f"{row['float32_us']:.0f} vs {row['float64_us']:.0f} us", file=sys.stderr)
    windows = sum(row["windows"] for row in rows)
    return dict(shape=list(args.shape), slack=cpu.SETTLE_SLACK, rows=rows, total=dict(
        windows=windows, unsettled=sum(row["unsettled"] * row["windows"] for row in rows) / windows,
        ranks_differ_before=sum(row["ranks_differ_before"] for row in rows),
        ranks_differ_after=sum(row["ranks_differ_after"] for row in rows)))


def markdown(result) -> str:
    lines = [f"{'x'.join(map(str, result['shape']))} phantoms, settling slack {result['slack']:g} float32 "
             "roundings of the largest eigenvalue; one process, one BLAS thread.", "",
             "| phantom | T | demean | estimator | windows | unsettled | ranks differ before / after the redo "
             "| eigenvalue error (roundings: median / max) | float32 us | float64 us | speed-up |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        lines.append(f"| {row['phantom']} | {row['volumes']} | {row['demean']} | {row['estimator']} | "
                     f"{row['windows']} | {row['unsettled']:.1%} | {row['ranks_differ_before']} / "
                     f"{row['ranks_differ_after']} | {row['eigenvalue_error_median']:.2f} / "
                     f"{row['eigenvalue_error_max']:.2f} | {row['float32_us']:.0f} | {row['float64_us']:.0f} | "
                     f"{row['float64_us'] / row['float32_us']:.2f}x |")
    total = result["total"]
    lines.append(f"| all | | | | {total['windows']} | {total['unsettled']:.1%} | "
                 f"{total['ranks_differ_before']} / {total['ranks_differ_after']} | | | | |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=lambda s: tuple(int(v) for v in s.split(",")), default=(40, 40, 24))
    parser.add_argument("--windows", type=int, default=2500, help="windows per phantom and setting, at most")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="two small phantoms, few windows: a smoke test")
    parser.add_argument("--out", default=str(HERE / "results" / "cpu_first_pass.json"))
    args = parser.parse_args(argv)
    args.phantoms = PHANTOMS[:2] if args.quick else PHANTOMS
    if args.quick:
        args.shape, args.windows, args.repeats = (16, 16, 12), 200, 1
    harness.measure_and_write(args.out, lambda: measure(args), markdown)


if __name__ == "__main__":
    main()
