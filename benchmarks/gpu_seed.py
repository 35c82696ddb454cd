"""The seed's problem on one GPU: our backend against the article's final step, side by side in one run.

    python benchmarks/gpu_seed.py [--blocks 5] [--repeats 7] [--baseline DIR] [--out FILE]

The problem (``gpu_timing.SEED_OPTIONS``): 96x96x48x48, 11^3 windows at stride 3 (12,600), voxel demeaning,
weighted aggregation, hard thresholding, a rank-5 phantom on a baseline near 1000. Timed host to host in ``--blocks``
interleaved blocks, each the best of ``--repeats`` runs: ``denoise_gpu`` with the engine's choices (the box
sums, the tridiagonal eigensolver, the first pass replayed as CUDA graphs), the article's final step (the
fused kernels and XsyevBatched in batches of 2048: ``gpu_timing.ARTICLE_STEP``), and with ``--baseline`` the
other checkout's ``denoise_gpu``, and each package's whole ``denoise(device="cuda")`` call; each variant's
error against the float64 run (``precision="float64"``: every window in float64 with XsyevBatched). The ratio to
the article's step is taken within each block. JSON (and Markdown beside it) to ``--out``.
"""

from __future__ import annotations

import numpy as np

from gpu_timing import (ARTICLE_STEP, BASELINE, SEED_OPTIONS, Backend, interleaved, load_package, peak_gib,
                        relative_rms, run_benchmark, seed_phantom)


def measure(blocks, repeats, baseline=None):
    noisy, truth = seed_phantom()
    ours = Backend(load_package(), noisy, SEED_OPTIONS)
    backends = dict(ours=ours)
    variants = {"ours (denoise_gpu)": ours.run, "the article's final step": lambda: ours.run(**ARTICLE_STEP)}
    if baseline is not None:
        backends["baseline"] = Backend(load_package(baseline), noisy, SEED_OPTIONS)
        variants["baseline (denoise_gpu)"] = backends["baseline"].run
    for name, backend in backends.items():  # the whole call, timed in the same blocks
        variants[f"{name}: denoise(device='cuda'), the whole call"] = (
            lambda backend=backend: backend.denoise(noisy, device="cuda", **SEED_OPTIONS))
    by_block, results = interleaved(variants, blocks, repeats)
    reference = ours.denoised(ours.run(precision="float64"))
    article = by_block["the article's final step"]
    rows = []
    for name, times in by_block.items():
        result = results[name]
        info = result.info
        ratios = [a / t for a, t in zip(article, times)]
        rows.append(dict(variant=name, best_ms=min(times), ms_by_block=times,
                         speedup_over_article_best_block=round(max(ratios), 2),
                         speedup_over_article_median=round(float(np.median(ratios)), 2),
                         relative_rms_to_float64=relative_rms(ours.denoised(result), reference),
                         n_settled_in_float64=info["n_settled_in_float64"], first_pass=info.get("first_pass"),
                         gram_path=info["gram_path"], eigensolver=info["eigensolver"]))
    peak, _ = peak_gib(ours.run)
    return dict(problem=dict(shape=list(noisy.shape), options=SEED_OPTIONS, n_windows=ours.plan.n_windows,
                             rmse_of_float64_run_to_truth=float(np.sqrt(np.mean((reference - truth) ** 2)))),
                rows=rows, peak_gib=round(peak, 2))


def markdown(result):
    lines = ["| variant | best ms | ms by block | x the article's step (best block / median) | "
             "rel. rms to float64 | windows settled |", "| --- | ---: | --- | ---: | ---: | ---: |"]
    for row in result["rows"]:
        blocks = " / ".join(f"{t:.2f}" for t in row["ms_by_block"])
        lines.append(f"| {row['variant']} | {row['best_ms']:.2f} | {blocks} "
                     f"| {row['speedup_over_article_best_block']:.2f} / {row['speedup_over_article_median']:.2f} "
                     f"| {row['relative_rms_to_float64']:.1e} | {row['n_settled_in_float64']} |")
    return "\n".join(lines)


def main():
    run_benchmark(__doc__, "gpu_seed", measure, markdown, ("--blocks", dict(type=int, default=5)),
                  ("--repeats", dict(type=int, default=7)), BASELINE)


if __name__ == "__main__":
    main()
