"""Multi-echo series denoised jointly (the echoes as more columns of each patch) against each echo alone.

    python benchmarks/multi_echo.py                                   # 32x32x20, 3 echoes x 600, CPU
    python benchmarks/multi_echo.py --shape 64,64,40 --device cuda --skip-alone
    python benchmarks/multi_echo.py --quick --out /tmp/multi_echo.json  # a smoke test

Phantom: ``mppca_nipype.phantoms.multi_echo_phantom`` (echo times 14, 38, 62 ms; every echo carries the same
BOLD fluctuations, scaled by its echo time and decay; Gaussian noise ``--sigma`` per echo; seed 0). Rows, each
at every extent of ``--extents`` (an odd number, or a rule of ``patches.EXTENT_RULES``), stride and the other
options the defaults:

- ``joint``: ``denoise`` of the (X, Y, Z, E, T) series: each voxel's mean per echo removed, each patch's
  matrix E * T columns wide;
- ``each echo alone``: ``denoise`` of each echo's (X, Y, Z, T) series (the defaults' volume demeaning).

For each row: the RMSE to the truth, per echo and over all echoes, and the wall time of the call (in this
process, after a warm-up call on a 16^3 crop with the same extent; on the GPU host to host), and for joint
rows what the engine says of the run (``ENGINE_INFO``, and its ``seconds`` by phase as ``phases``). Writes JSON (stamped by
``harness.stamp()``) to ``--out`` and the Markdown table next to it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import time

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (HERE, REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import harness  # noqa: E402

from mppca_nipype import denoise  # noqa: E402
from mppca_nipype.phantoms import multi_echo_phantom  # noqa: E402

ECHO_TIMES = (14.0, 38.0, 62.0)
#: What each joint row records of the engine's ``info``.
ENGINE_INFO = ("n_windows", "seconds_engine", "leading_eigenpairs", "n_settled_in_float64", "gram_path")


def parse_extent(text: str):
    return int(text) if text.isdigit() else text


def rmse(estimate, truth, axis=None):
    return np.sqrt(np.mean((np.asarray(estimate, np.float64) - truth) ** 2, axis=axis))


def timed(call):
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def measure(args) -> dict:
    noisy, truth = multi_echo_phantom(args.shape, args.volumes, ECHO_TIMES, sigma=args.sigma, seed=0)
    n_echoes = noisy.shape[3]
    run = dict(device=args.device, nprocs=args.threads)
    per_echo_axes = (0, 1, 2, 4)
    rows = [dict(row="input", extent=None, seconds=None, rmse=float(rmse(noisy, truth)),
                 rmse_by_echo=rmse(noisy, truth, per_echo_axes).tolist())]
    for extent in args.extents:
        # warm-up on a crop that holds a few patches: the backend started, this series' kernels compiled
        denoise(noisy[:16, :16, :16], extent=extent, **run)
        joint, seconds = timed(lambda: denoise(noisy, extent=extent, **run))
        rows.append(dict(row="joint", extent=joint.info["extent"], seconds=seconds,
                         rmse=float(rmse(joint.denoised, truth)),
                         rmse_by_echo=rmse(joint.denoised, truth, per_echo_axes).tolist(),
                         backend=joint.info.get("backend"),
                         phases=joint.info.get("seconds"),
                         **{key: joint.info[key] for key in ENGINE_INFO if key in joint.info}))
        print(f"multi_echo: joint, extent {extent}: {seconds:.2f} s, RMSE {rows[-1]['rmse']:.4f}", file=sys.stderr)
        del joint
        if args.skip_alone:
            continue
        alone = np.empty_like(noisy)
        seconds = 0.0
        for echo in range(n_echoes):
            if echo == 0:
                denoise(noisy[:16, :16, :16, 0], extent=extent, **run)  # (warm-up, as above)
            result, spent = timed(lambda: denoise(noisy[:, :, :, echo], extent=extent, **run))
            alone[:, :, :, echo] = result.denoised
            seconds += spent
        rows.append(dict(row="each echo alone", extent=result.info["extent"], seconds=seconds,
                         rmse=float(rmse(alone, truth)), rmse_by_echo=rmse(alone, truth, per_echo_axes).tolist(),
                         backend=result.info.get("backend")))
        print(f"multi_echo: each echo alone, extent {extent}: {seconds:.2f} s, RMSE {rows[-1]['rmse']:.4f}",
              file=sys.stderr)
    return dict(shape=list(args.shape), volumes=args.volumes, echo_times=list(ECHO_TIMES), sigma=args.sigma,
                device=args.device, threads=args.threads, rows=rows)


def markdown(result) -> str:
    echoes = ", ".join(f"{t:g}" for t in result["echo_times"])
    lines = [f"{'x'.join(map(str, result['shape']))}, {len(result['echo_times'])} echoes ({echoes} ms) x "
             f"{result['volumes']} volumes, noise {result['sigma']:g} per echo; device {result['device']}"
             + (f", {result['threads']} workers" if result["threads"] else "") + ".", "",
             "| row | extent | seconds | RMSE | RMSE by echo |", "| --- | --- | ---: | ---: | --- |"]
    for row in result["rows"]:
        extent = "" if row["extent"] is None else "x".join(map(str, row["extent"]))
        seconds = "" if row["seconds"] is None else f"{row['seconds']:.2f}"
        by_echo = " / ".join(f"{value:.3f}" for value in row["rmse_by_echo"])
        lines.append(f"| {row['row']} | {extent} | {seconds} | {row['rmse']:.4f} | {by_echo} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=lambda s: tuple(int(v) for v in s.split(",")), default=(32, 32, 20))
    parser.add_argument("--volumes", type=int, default=600, help="volumes per echo (default 600)")
    parser.add_argument("--sigma", type=float, default=8.0, help="noise per echo (default 8)")
    parser.add_argument("--extents", type=lambda s: [parse_extent(v) for v in s.split(",")], default=[5, 7],
                        help="comma-separated extents (odd numbers or rules; default 5,7)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU worker processes (default: all)")
    parser.add_argument("--skip-alone", action="store_true", help="only the joint rows")
    parser.add_argument("--quick", action="store_true", help="a small phantom: a smoke test")
    parser.add_argument("--out", default=str(HERE / "results" / "multi_echo.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.shape, args.volumes, args.extents = (12, 12, 8), 60, [3]
    harness.measure_and_write(args.out, lambda: measure(args), markdown)


if __name__ == "__main__":
    main()
