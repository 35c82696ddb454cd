"""Each option beyond magnitude-only MP-PCA on the GPU: its time against the magnitude-only run of the same
series, and its agreement with the CPU engine.

Phantom: ``mppca_nipype.phantoms.complex_dwi_phantom`` (the head-shaped DWI signal on a smooth background
phase, complex Gaussian noise; seed 0) at ``--shape`` x ``--volumes`` (default 96x96x60 x 100) and ``--snr``
(default 10). The magnitude with the defaults is the reference run; each option then runs on the same series:

- ``noise-in``: the true sigma given (``noise=``);
- ``rician``, ``ncchi 4``: the magnitude noise floor (``noise_floor=``; ``coils=4`` for ``ncchi``);
- ``hard``, ``optthresh``: the other filters (the defaults' is ``optshrink``); ``exp2``, ``exp1``, ``med``:
  the other estimators (the defaults' is ``olesen2023``); ``weighted``: the other weighted aggregation (the
  defaults' is ``gaussian``); ``sphere``: spherical patches; ``2016 method``: hard thresholding, exp2 and
  weighted aggregation together (the defaults before the method's options);
- ``phase hann``, ``phase mppca``: complex data (``denoise_complex``, with the phase);
- ``groups 4``: each voxel's mean per group of volumes removed (``demean="groups"``, the volumes in 4
  groups in turn);
- ``maps``: the lambda_plus and variance_removed maps asked for.

Each run is timed host to host in this process (NumPy in, NumPy out), ``--repeats`` times after one warm-up
(kernels compiled), best kept; the ratio to the magnitude-only run's best is the option's cost. With
``--cpu``, the same run on the CPU engine (``--threads`` workers, once) gives the agreement: the rms of
the difference of the denoised series over the rms of the CPU's (in the head), and the share of voxels
where the rank maps are equal.

Usage (from the repository root, on a machine with a CUDA GPU)::

    python benchmarks/gpu_options.py
    python benchmarks/gpu_options.py --cpu --shape 48,48,30 --threads 16

Writes JSON to ``--out`` (default benchmarks/results/gpu_options.json) and the Markdown table next to it
after every option, so that a run stopped from outside keeps the options it finished.
"""

from __future__ import annotations

import argparse
import copy
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
from mppca_nipype import denoise, denoise_complex  # noqa: E402
from mppca_nipype.phantoms import complex_dwi_phantom  # noqa: E402

#: The options timed, each as the keywords of ``denoise`` (or, with ``phase_method``, of ``denoise_complex``).
OPTIONS = {
    "magnitude": {},
    "noise-in": {"noise": "true"},
    "rician": {"noise_floor": "rician"},
    "ncchi 4": {"noise_floor": "ncchi", "coils": 4},
    "hard": {"filter": "hard"},
    "optthresh": {"filter": "optthresh"},
    "exp2": {"estimator": "exp2"},
    "exp1": {"estimator": "exp1"},
    "med": {"estimator": "med"},
    "weighted": {"aggregation": "weighted"},
    "sphere": {"shape": "sphere"},
    "2016 method": {"estimator": "exp2", "filter": "hard", "aggregation": "weighted"},
    "phase hann": {"phase_method": "hann"},
    "phase mppca": {"phase_method": "mppca"},
    "groups 4": {"demean": "groups", "groups": "4"},
    "maps": {"maps": ("lambda_plus", "variance_removed")},
}


def run_option(keywords, magnitude, phase, sigma, device, threads):
    keywords = dict(keywords)
    if keywords.get("noise") == "true":
        keywords["noise"] = sigma
    if "groups" in keywords:  # the volumes in that many groups, in turn (as interleaved shells)
        keywords["groups"] = np.arange(magnitude.shape[3]) % int(keywords["groups"])
    if "phase_method" in keywords:
        return denoise_complex(magnitude, phase, device=device, nprocs=threads, **keywords)
    return denoise(magnitude, device=device, nprocs=threads, **keywords)


def best_seconds(call, repeats):
    call()  # warm-up: kernels compiled, buffers allocated
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - started)
    return min(times), times, result


def measure(args, save=lambda result: None) -> dict:
    sigma = 1000.0 / args.snr
    magnitude, phase, truth, _, _, _ = complex_dwi_phantom(args.shape, args.volumes, sigma=sigma, seed=0)
    head = truth[..., 0] > 0
    rows = []
    for name in args.options:
        keywords = OPTIONS[name]
        best, times, gpu = best_seconds(
            lambda: run_option(keywords, magnitude, phase, sigma, "cuda", args.threads), args.repeats)
        row = dict(option=name, keywords=dict(keywords), gpu_seconds=best, gpu_times=times,
                   device=gpu.info.get("device"), cpu_seconds=None, relative_rms=None, ranks_equal=None)
        if args.cpu:
            started = time.perf_counter()
            cpu = run_option(keywords, magnitude, phase, sigma, "cpu", args.threads)
            row["cpu_seconds"] = time.perf_counter() - started
            difference = (gpu.denoised - cpu.denoised)[head].astype(np.float64)
            row["relative_rms"] = float(np.sqrt(np.mean(difference ** 2))
                                        / np.sqrt(np.mean(cpu.denoised[head].astype(np.float64) ** 2)))
            row["ranks_equal"] = float(np.mean(np.abs(gpu.rank - cpu.rank)[head] < 0.5))
        rows.append(row)
        save(summary(args, sigma, rows))  # kept if the run is stopped from outside
        print(f"gpu_options: {name:12s} GPU {best:.3f} s ({row['device']})" + (
            f" CPU {row['cpu_seconds']:.2f} s rel. rms {row['relative_rms']:.1e} ranks equal "
            f"{100 * row['ranks_equal']:.2f}%" if args.cpu else ""), file=sys.stderr)
    return summary(args, sigma, rows)


def summary(args, sigma, rows) -> dict:
    """The result's fields: the settings and the rows, each with its ratio to the magnitude-only run's."""
    base = next((row["gpu_seconds"] for row in rows if row["option"] == "magnitude"), None)
    for row in rows:
        row["ratio_to_magnitude"] = None if base is None else row["gpu_seconds"] / base
    return dict(shape=list(args.shape), volumes=args.volumes, snr=args.snr, sigma=sigma, repeats=args.repeats,
                threads=args.threads, cpu=args.cpu, rows=rows)


def markdown(result) -> str:
    lines = [f"{'x'.join(map(str, result['shape']))} x {result['volumes']}, SNR {result['snr']:g}; GPU best of "
             f"{result['repeats']} (host to host, in a running process)"
             + (f", CPU once on {result['threads']} workers." if result["cpu"] else "; the CPU not run."),
             "",
             "| option | GPU s | / magnitude's | CPU s | rel. rms GPU vs CPU | ranks equal |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        ratio = "" if row["ratio_to_magnitude"] is None else f"{row['ratio_to_magnitude']:.2f}x"
        compared = row["cpu_seconds"] is not None
        lines.append(f"| {row['option']} | {row['gpu_seconds']:.3f} | {ratio} | "
                     + (f"{row['cpu_seconds']:.2f} | {row['relative_rms']:.1e} | {100 * row['ranks_equal']:.2f}% |"
                        if compared else "| | |"))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=lambda s: tuple(int(v) for v in s.split(",")), default=(96, 96, 60))
    parser.add_argument("--volumes", type=int, default=100)
    parser.add_argument("--snr", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="run each option on the CPU engine too, and compare")
    parser.add_argument("--threads", type=int, default=None, help="CPU worker processes (default: all)")
    parser.add_argument("--options", type=lambda s: s.split(","), default=list(OPTIONS),
                        help=f"comma-separated, of: {', '.join(OPTIONS)}")
    parser.add_argument("--out", default=str(HERE / "results" / "gpu_options.json"))
    args = parser.parse_args(argv)
    unknown = [name for name in args.options if name not in OPTIONS]
    if unknown:
        parser.error(f"unknown options {unknown}; choose from {list(OPTIONS)}")
    run = harness.stamp()

    def save(fields, final=False):  # (a stamp that is not final ends at this save: a copy is finished)
        stamp = run if final else copy.deepcopy(run)
        result = dict(stamp=stamp, **fields)
        harness.write_result(args.out, result, markdown=harness.stamp_markdown(stamp) + "\n\n" + markdown(result))
        return result

    print(markdown(save(measure(args, save), final=True)))


if __name__ == "__main__":
    main()
