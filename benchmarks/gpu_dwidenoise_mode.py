"""MRtrix3 dwidenoise's mode on one GPU: 5^3 windows around every voxel of a 96x96x48x48 series.

    python benchmarks/gpu_dwidenoise_mode.py [--blocks 3] [--repeats 5] [--baseline DIR] [--out FILE]

372,416 windows (442,368 voxels), no demeaning, each voxel from its own window (``gpu_timing.DWIDENOISE_OPTIONS``),
a rank-5 phantom on a baseline near 1000. Timed host to host in interleaved blocks: ``denoise_gpu`` with the
engine's choices (float32 with each patch's mean taken apart as a rank-one term, the tridiagonal kernels,
the windows float32 cannot settle redone in float64), the plain float64 run (every window in float64 with
XsyevBatched: the reference of the errors, and what parity with ``dwidenoise -datatype float64`` asks), and
with ``--baseline`` the other checkout's ``denoise_gpu``, and each package's whole ``denoise(device="cuda")`` call.
JSON (and Markdown beside it) to ``--out``.
"""

from __future__ import annotations

import numpy as np

from gpu_timing import (BASELINE, DWIDENOISE_OPTIONS, Backend, interleaved, load_package, peak_gib, relative_rms,
                        run_benchmark, seed_phantom)

FLOAT64 = dict(precision="float64", eigensolver="xsyev")


def measure(blocks, repeats, baseline=None):
    noisy, _ = seed_phantom(seed=1)
    backends = dict(ours=Backend(load_package(), noisy, DWIDENOISE_OPTIONS))
    ours = backends["ours"]
    variants = {"ours (denoise_gpu)": ours.run,
                "float64 with XsyevBatched (the reference)": lambda: ours.run(**FLOAT64)}
    if baseline is not None:
        backends["baseline"] = Backend(load_package(baseline), noisy, DWIDENOISE_OPTIONS)
        variants["baseline (denoise_gpu)"] = backends["baseline"].run
    for name, backend in backends.items():  # the whole call, timed in the same blocks
        variants[f"{name}: denoise(device='cuda'), the whole call"] = (
            lambda backend=backend: backend.denoise(noisy, device="cuda", **DWIDENOISE_OPTIONS))
    by_block, results = interleaved(variants, blocks, repeats, warmup=1)
    reference = results["float64 with XsyevBatched (the reference)"]
    reference_image, reference_rank = ours.denoised(reference), reference.rank
    rows = []
    for name, times in by_block.items():
        result = results[name]
        rank = result.rank.reshape(-1)
        rows.append(dict(variant=name, best_ms=min(times), ms_by_block=times,
                         relative_rms_to_float64=relative_rms(ours.denoised(result), reference_image),
                         rank_equal=float(np.mean(np.abs(rank - reference_rank) < 1e-3)),
                         n_settled_in_float64=result.info["n_settled_in_float64"],
                         gram_precision=result.info["gram_precision"], eigensolver=result.info["eigensolver"]))
    peak, _ = peak_gib(ours.run)
    return dict(problem=dict(shape=list(noisy.shape), options=DWIDENOISE_OPTIONS, n_windows=ours.plan.n_windows),
                rows=rows, peak_gib=round(peak, 2))


def markdown(result):
    lines = ["| variant | best ms | ms by block | rel. rms to float64 | ranks equal | windows settled |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for row in result["rows"]:
        blocks = " / ".join(f"{t:.1f}" for t in row["ms_by_block"])
        lines.append(f"| {row['variant']} | {row['best_ms']:.1f} | {blocks} | {row['relative_rms_to_float64']:.1e} "
                     f"| {row['rank_equal']:.4f} | {row['n_settled_in_float64']} |")
    return "\n".join(lines)


def main():
    run_benchmark(__doc__, "gpu_dwidenoise_mode", measure, markdown, ("--blocks", dict(type=int, default=3)),
                  ("--repeats", dict(type=int, default=5)), BASELINE)


if __name__ == "__main__":
    main()
