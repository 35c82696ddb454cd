"""The eigen step alone on one GPU: the tridiagonal Triton kernels against cuSOLVER's XsyevBatched.

    python benchmarks/gpu_eigen_step.py [--count 12600] [--out FILE]

The step the engine runs per window once it has the Gram matrix: the eigenvalues, the estimator's rank
(exp2), the projector onto the kept eigenvectors. On ``--count`` float32 Gram matrices of rank-5 patches on
noise (1331 voxels at T = 48, as in the seed's problem; 4T voxels otherwise) for T = 32 .. 128, best of 5:
XsyevBatched (all eigenvectors, then the projector), XsyevBatched's eigenvalues alone, and the tridiagonal
kernels (eigenvalues, then the projector by inverse iteration for the kept eigenvectors). Each checked
against XsyevBatched in float64: the share of equal ranks, the eigenvalues' largest error relative to the
largest eigenvalue, the projectors' largest error where the ranks agree. ``plan.AUTO_TRIDIAGONAL_MAX_ORDER``
rests on it. JSON (and Markdown beside it) to ``--out``.
"""

from __future__ import annotations

import time

import torch

from gpu_timing import run_benchmark  # (also puts this tree's package on the path)
from mppca_nipype.engine.estimators import marchenko_pastur_threshold
from mppca_nipype.engine.gpu.cusolver import BatchedEigh
from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

ORDERS = (32, 48, 64, 96, 128)


def patch_grams(count, m, seed=0):
    """(count, m, m) float64 Gram matrices of centred rank-5 patches on noise, and the patches' voxels."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = 1331 if m == 48 else 4 * m
    x = 4.0 * torch.randn(count, n, m, device="cuda", dtype=torch.float64, generator=g)
    scores = torch.randn(count, n, 5, device="cuda", dtype=torch.float64, generator=g)
    loads = torch.randn(count, 5, m, device="cuda", dtype=torch.float64, generator=g)
    x += scores @ (loads * torch.tensor([60.0, 30, 15, 8, 5], device="cuda", dtype=torch.float64)[:, None])
    x -= x.mean(dim=1, keepdim=True)
    return x.mT @ x, n - 1


def measure(count):
    xsyev, tridiagonal = BatchedEigh("cuda"), TridiagonalEigh("cuda")
    rows = []
    for m in ORDERS:
        matrices, n = patch_grams(count, m)
        voxels = torch.full((count,), n, dtype=torch.int64, device="cuda")

        def rank_of(values):
            return marchenko_pastur_threshold(values.to(torch.float64), voxels, m, "exp2")[0]

        values64, _ = xsyev.values(matrices.clone())
        rank64 = rank_of(values64)
        projector64 = xsyev.projector(rank64)
        work = matrices.to(torch.float32).contiguous()

        def with_vectors(solver):
            def step():
                values, _ = solver.values(work.clone())
                rank = rank_of(values)
                return values, rank, solver.projector(rank)
            return step

        def values_only():
            values, _, _ = xsyev(work.clone(), vectors=False)
            return values, rank_of(values), None

        steps = {"XsyevBatched: eigenvalues and vectors, then the projector": with_vectors(xsyev),
                 "XsyevBatched: eigenvalues alone": values_only,
                 "tridiagonal kernels: eigenvalues, then the projector": with_vectors(tridiagonal)}
        for name, step in steps.items():
            step()
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                started = time.perf_counter()
                values, rank, projector = step()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - started) * 1e3)
            scale = values64.abs().amax(dim=1)
            row = dict(m=m, count=count, variant=name, best_ms=round(min(times), 3),
                       rank_equal=float((rank == rank64).double().mean()),
                       values_error=float(((values.double() - values64).abs().amax(dim=1) / scale).max()))
            if projector is not None:
                same = rank == rank64
                row["projector_error"] = float((projector.double() - projector64).abs().amax(dim=(1, 2))[same].max())
            rows.append(row)
            print(row, flush=True)
        del matrices, projector64
        xsyev.release_workspaces()
        torch.cuda.empty_cache()
    return dict(rows=rows)


def markdown(result):
    lines = ["| T | XsyevBatched + projector ms | XsyevBatched eigenvalues alone ms | tridiagonal kernels ms | "
             "ranks equal to float64: XsyevBatched / tridiagonal |", "| ---: | ---: | ---: | ---: | ---: |"]
    for m in ORDERS:
        rows = [row for row in result["rows"] if row["m"] == m]
        full, alone, ours = rows
        lines.append(f"| {m} | {full['best_ms']:.2f} | {alone['best_ms']:.2f} | {ours['best_ms']:.2f} | "
                     f"{full['rank_equal']:.2%} / {ours['rank_equal']:.2%} |")
    return "\n".join(lines)


def main():
    run_benchmark(__doc__, "gpu_eigen_step", measure, markdown, ("--count", dict(type=int, default=12_600)))


if __name__ == "__main__":
    main()
