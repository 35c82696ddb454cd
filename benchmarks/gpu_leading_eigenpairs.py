"""The eigen step of the longest series on one GPU: the full eigensolve against the leading eigenpairs alone.

    python benchmarks/gpu_leading_eigenpairs.py [--orders 600,900,1200,1800] [--count 256] [--out FILE]

For each order m, ``--count`` float64 Gram matrices (the columns' side) of 13^3-voxel patches of a
multi-echo series (``phantoms.multi_echo_phantom`` at 64x64x40, three echoes of m / 3 volumes, each patch's
mean time course removed), in batches of 64, best of 3 per batch: the path long series took before (the
Gram rounded to float32, XsyevBatched with all eigenvectors, then ``ProjectorFromVectors.refine``'s float64
Rayleigh-Ritz on 64 vectors at each end) and ``ProjectorFromVectors.leading`` (a float64 block Krylov space,
``cusolver.LEADING_*``). Each checked against XsyevBatched in float64: the share of windows whose
``olesen2023`` rank equals it, the largest relative error of the noise variance, and for ``leading`` the
share of kept Ritz values within their bounds and the largest bound among the components the rank reads
(relative to the eigenvalue). ``cusolver.LEADING_MIN_ORDER`` rests on it. JSON (and Markdown beside it) to
``--out``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from gpu_timing import run_benchmark  # (also puts this tree's package on the path)
from mppca_nipype.engine.estimators import marchenko_pastur_threshold
from mppca_nipype.engine.gpu import cusolver
from mppca_nipype.engine.gpu.cusolver import BatchedEigh
from mppca_nipype.phantoms import multi_echo_phantom

EXTENT, STRIDE, BATCH, ECHOES = 13, 3, 64, 3


def patch_grams(m, count, seed=1):
    """(count, m, m) float64 Grams of volume-demeaned 13^3 patches of a three-echo series of m / 3 volumes."""
    noisy, _ = multi_echo_phantom((64, 64, 40), n_volumes=m // ECHOES)
    series = torch.from_numpy(noisy.reshape(64, 64, 40, m)).to("cuda", torch.float64)
    corners = [(x, y, z) for x in range(0, 64 - EXTENT + 1, STRIDE) for y in range(0, 64 - EXTENT + 1, STRIDE)
               for z in range(0, 40 - EXTENT + 1, STRIDE)]
    chosen = np.random.default_rng(seed).choice(len(corners), count, replace=False)
    grams = torch.empty((count, m, m), dtype=torch.float64, device="cuda")
    for i, c in enumerate(chosen):
        x, y, z = corners[c]
        patch = series[x:x + EXTENT, y:y + EXTENT, z:z + EXTENT].reshape(-1, m)
        patch = patch - patch.mean(dim=0)
        grams[i] = patch.mT @ patch
    return grams


def best_seconds(step):
    step()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return min(times), result


def measure(orders, count):
    solver = BatchedEigh("cuda")
    rows = []
    for m in (int(v) for v in orders.split(",")):
        grams = patch_grams(m, count)
        voxels = torch.full((BATCH,), EXTENT**3 - 1, dtype=torch.int64, device="cuda")
        usable = torch.full((BATCH,), m, dtype=torch.int64, device="cuda")
        keep = cusolver.LEADING_KEEP
        row = dict(m=m, count=count, full_s=0.0, leading_s=0.0, full_rank_equal=0, leading_rank_equal=0,
                   full_sigma2_error=0.0, leading_sigma2_error=0.0, within_bounds=0, read_bound=0.0)
        for first in range(0, count, BATCH):
            batch = grams[first:first + BATCH]
            exact, _, _ = solver(batch.clone(), vectors=False)
            want_rank, want_sigma2 = marchenko_pastur_threshold(exact, voxels, m, "olesen2023")

            def full():
                solver.values(batch.to(torch.float32).contiguous())
                return solver.refine(batch, cusolver.refine_block(m))[0]

            seconds, values = best_seconds(full)
            row["full_s"] += seconds
            rank, sigma2 = marchenko_pastur_threshold(values, voxels, m, "olesen2023")
            row["full_rank_equal"] += int((rank == want_rank).sum())
            row["full_sigma2_error"] = max(row["full_sigma2_error"],
                                           float(((sigma2 - want_sigma2) / want_sigma2).abs().max()))
            seconds, (values, info, bounds) = best_seconds(lambda: solver.leading(batch, usable))
            row["leading_s"] += seconds
            rank, sigma2 = marchenko_pastur_threshold(values, voxels, m, "olesen2023")
            row["leading_rank_equal"] += int((rank == want_rank).sum())
            row["leading_sigma2_error"] = max(row["leading_sigma2_error"],
                                              float(((sigma2 - want_sigma2) / want_sigma2).abs().max()))
            errors = (values[:, -keep:] - exact[:, -keep:]).abs()
            row["within_bounds"] += int((errors <= bounds).sum())
            read = torch.arange(keep, device="cuda")[None, :] >= keep - (want_rank + 2)[:, None]
            relative = bounds / values[:, -keep:].abs()
            row["read_bound"] = max(row["read_bound"], float(torch.where(read, relative, 0.0).max()))
        row["within_bounds"] /= count * keep
        for key in ("full_s", "leading_s"):
            row[key] = round(row[key] * BATCH / count, 4)  # per batch of 64
        rows.append(row)
        print(row, flush=True)
        del grams
        solver.release_workspaces()
        torch.cuda.empty_cache()
    return dict(rows=rows)


def markdown(result):
    lines = ["| m | full eigensolve + refinement, s per 64 windows | leading eigenpairs, s per 64 | speed-up | "
             "ranks equal to float64: full / leading | kept values within their bounds | largest bound the rank "
             "reads (relative) |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        lines.append(f"| {row['m']} | {row['full_s']:.3f} | {row['leading_s']:.3f} | "
                     f"{row['full_s'] / row['leading_s']:.1f}x | {row['full_rank_equal'] / row['count']:.2%} / "
                     f"{row['leading_rank_equal'] / row['count']:.2%} | {row['within_bounds']:.2%} | "
                     f"{row['read_bound']:.1e} |")
    return "\n".join(lines)


def main():
    run_benchmark(__doc__, "gpu_leading_eigenpairs", measure, markdown,
                  ("--orders", dict(default="600,900,1200,1800")), ("--count", dict(type=int, default=256)))


if __name__ == "__main__":
    main()
