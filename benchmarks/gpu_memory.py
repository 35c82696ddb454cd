"""The GPU engine within a device-memory budget: an HCP-size series at 4, 8, 16 GiB and unlimited, and the
unlimited runs' speed beside another checkout's.

    python benchmarks/gpu_memory.py --baseline ../older-checkout [--budgets 0,16,8,4] [--repeats 2]

HCP-size: a generated 145x174x145 x 288 series (the low-rank phantom, 4.2 GB in float32) with the defaults,
``denoise(device="cuda", gpu_memory=B)`` in this process, host to host, each budget the best of ``--repeats``
after one unlimited warm-up run; per budget: seconds, the peak of memory allocated through torch
(``info["gpu_peak_bytes"]``) and reserved by its allocator (``torch.cuda.max_memory_reserved``, torch's cache
emptied before each run), the slabs and batch the plan chose, and the rms relative difference of the denoised
series to the unlimited run's. Budget 0 stands for none.

``--baseline DIR``: the unlimited runs of the seed's problem, dwidenoise's mode (96x96x48x48) and a
96x96x60x300 series (low-rank phantom) timed beside DIR's package in interleaved blocks
(``gpu_timing.interleaved``), so that a change of the planning is seen not to cost the runs that need no
budget. JSON (and Markdown beside it) to ``--out``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from gpu_timing import (BASELINE, DWIDENOISE_OPTIONS, SEED_OPTIONS, Backend, interleaved, load_package, relative_rms,
                        run_benchmark, seed_phantom)
from mppca_nipype.engine import DEFAULTS
from mppca_nipype.phantoms import low_rank_phantom

GIB = 2**30
#: An HCP-size diffusion series: 1.25 mm, 145x174x145, 288 volumes (HCP's 3 shells and b=0).
HCP_SHAPE, HCP_VOLUMES = (145, 174, 145), 288


def budget_runs(package, budgets, repeats):
    noisy = low_rank_phantom(HCP_SHAPE, n_volumes=HCP_VOLUMES, rank=8, sigma=10.0, seed=4)[0]
    package.denoise(noisy, device="cuda")  # warm-up: kernels, cuSOLVER, page-locked staging memory
    rows, reference = [], None
    for budget in budgets:
        best, result, reserved = np.inf, None, 0
        for _ in range(repeats):
            result = None  # (the last run's series freed before the next)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            result = package.denoise(noisy, device="cuda", gpu_memory=budget or None)
            best = min(best, time.perf_counter() - started)
            reserved = max(reserved, torch.cuda.max_memory_reserved())
        info = result.info
        if reference is None:
            reference = result
        rows.append(dict(budget_gib=budget or None, seconds=round(best, 2),
                         peak_allocated_gib=round(info["gpu_peak_bytes"] / GIB, 2),
                         peak_reserved_gib=round(reserved / GIB, 2), n_slabs=info["n_slabs"],
                         slab_planes=info["slab_planes"], batch=info["batch"],
                         slab_retries=info["slab_retries"], out_of_memory_retries=info["out_of_memory_retries"],
                         relative_rms_to_first=relative_rms(result.denoised, reference.denoised),
                         rank_equal_to_first=float(np.mean(np.abs(result.rank - reference.rank) < 1e-3))))
        print(rows[-1], flush=True)
    return dict(series=f"{'x'.join(map(str, HCP_SHAPE))}x{HCP_VOLUMES} (low-rank phantom, rank 8, sigma 10)",
                options=DEFAULTS, repeats=repeats, rows=rows)


def unlimited_speed(package, baseline, blocks):
    problems = (("seed's problem 96x96x48x48", seed_phantom()[0], SEED_OPTIONS, 5),
                ("dwidenoise's mode 96x96x48x48", seed_phantom()[0], DWIDENOISE_OPTIONS, 3),
                ("96x96x60x300, defaults", low_rank_phantom((96, 96, 60), n_volumes=300, rank=8, sigma=10.0,
                                                            seed=3)[0], DEFAULTS, 2))
    rows = []
    for name, noisy, options, repeats in problems:
        this, other = Backend(package, noisy, options), Backend(baseline, noisy, options)
        by_block, results = interleaved(dict(this=this.run, baseline=other.run), blocks, repeats, warmup=2)
        rows.append(dict(problem=name, this_ms=by_block["this"], baseline_ms=by_block["baseline"],
                         ratio=round(min(by_block["this"]) / min(by_block["baseline"]), 3),
                         relative_rms=relative_rms(this.denoised(results["this"]),
                                                   other.denoised(results["baseline"]))))
        print(rows[-1], flush=True)
    return rows


def measure(budgets, repeats, baseline, blocks):
    package = load_package()
    result = budget_runs(package, [float(b) for b in budgets.split(",")], repeats) if budgets else {}
    if baseline:
        result["unlimited"] = unlimited_speed(package, load_package(baseline), blocks)
    return result


def markdown(result):
    lines = []
    if "rows" in result:
        lines += [f"{result['series']}, the defaults, best of {result['repeats']}:", "",
                  "| budget | seconds | peak allocated GiB | peak reserved GiB | slabs (x-planes) | batch | "
                  "rel. rms to the first row | rank map equal |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result.get("rows", ()):
        budget = f"{row['budget_gib']:g} GiB" if row["budget_gib"] else "none"
        lines.append(f"| {budget} | {row['seconds']:.2f} | {row['peak_allocated_gib']:.2f} | "
                     f"{row['peak_reserved_gib']:.2f} | {row['n_slabs']} ({row['slab_planes']}) | {row['batch']} | "
                     f"{row['relative_rms_to_first']:.1e} | {row['rank_equal_to_first']:.4f} |")
    if "unlimited" in result:
        lines += ["" if lines else "Unlimited runs beside the baseline, interleaved blocks:", "",
                  "| unlimited run | this ms (blocks) | baseline ms (blocks) | ratio of the best | rel. rms |",
                  "| --- | --- | --- | ---: | ---: |"]
        for row in result["unlimited"]:
            lines.append(f"| {row['problem']} | {', '.join(f'{x:.1f}' for x in row['this_ms'])} | "
                         f"{', '.join(f'{x:.1f}' for x in row['baseline_ms'])} | {row['ratio']:.3f} | "
                         f"{row['relative_rms']:.1e} |")
    return "\n".join(lines)


def main():
    run_benchmark(__doc__, "gpu_memory", measure, markdown,
                  ("--budgets", dict(default="0,16,8,4", help="GiB, comma-separated; 0: none; '': no HCP-size "
                                                              "runs")),
                  ("--repeats", dict(type=int, default=2)), BASELINE, ("--blocks", dict(type=int, default=3)))


if __name__ == "__main__":
    main()
