"""The leading eigenpairs of the longest series' Gram matrices, by Rayleigh-Ritz on a block Krylov space.

``olesen2023`` (``estimators.LEADING_ESTIMATORS``) and a given noise level read only the leading eigenvalues
(down to the first noise-compatible P) and the trace: sigma^2(P) is the sum of the r - P smallest, the trace
less the P largest. Every filter keeps only leading components. So on the longest series (multi-echo runs,
fMRI of a thousand volumes), where a window's Gram is 1,000-2,000 wide and its full reduction to
tridiagonal form is most of the run, both engines find only the ``KEEP`` largest eigenpairs
(``leading_eigenpairs``): a Krylov space of ``STEPS`` blocks of ``BLOCK`` vectors, each orthogonalised twice
against all earlier ones and made orthonormal (by the engine's ``orthonormal``), in float64, and the
eigenpairs of its projected matrix (the engine's ``eigh``). The places below the kept ones share the rest of
the trace equally, so every sum the estimator reads up to its P is exact.

Each kept Ritz value carries a bound on its distance from an eigenvalue: its residual norm ||A y - theta y||,
or, where that is below half the distance to the next Ritz value, its square over that distance (the
Kato-Temple estimate, which holds once the neighbours have converged), and no less than ``ROUNDINGS``
float64 roundings of the largest. A window whose rank changes within the bounds of the eigenvalues it reads
(``uncertainty``), whose rank reaches the kept block less ``GUARD``, or whose space broke down is decomposed
in full instead, so the ranks are the full eigensolve's.

The engines: the GPU's gathered path (``gpu.cusolver.ProjectorFromVectors.leading``: Cholesky QR, cuSOLVER)
and the CPU's windows (``cpu.window_spectra``: the eigenvalues of the small Gram, LAPACK).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .estimators import LEADING_ESTIMATORS, array_namespace

#: A block Krylov space of ``STEPS`` blocks of ``BLOCK`` vectors (512 dimensions), of whose Ritz pairs the
#: ``KEEP`` largest are kept. On multi-echo Grams (1,800 columns) on the H200, at 16 x 16 the bounds near the
#: noise edge were ~3e-3 of the eigenvalue, at 32 x 16 ~1e-4, in 0.06 s per 64 windows either way.
BLOCK, STEPS, KEEP = 32, 16, 64
#: Smallest matrix order the GPU serves: measured on the H200 per 64 windows of 13^3 voxels, the full float32
#: eigensolve and its refinement took 0.052 / 0.100 / 0.179 / 0.450 s at m = 600 / 900 / 1,200 / 1,800 against
#: the Krylov space's 0.056 / 0.058 / 0.057 / 0.058 s (benchmarks/gpu_leading_eigenpairs.py).
GPU_MIN_ORDER = 768
#: Smallest matrix order the CPU serves: on one core, windows of 13^3 voxels of multi-echo series (Gram,
#: eigen step and reconstruction, against LAPACK's float32 reduction, eigenvalues and kept eigenvectors) took
#: 1.2x / 1.3x / 2.0x / 2.5x less time at m = 1,050 / 1,350 / 1,500 / 1,800, and more at 900.
CPU_MIN_ORDER = 1024
#: A window whose rank reaches the kept block less this many is decided outside it: decomposed in full.
GUARD = 8
#: The fewest float64 roundings of the largest eigenvalue a kept Ritz value's bound says (its rounding error
#: on a converged pair: measured up to ~3).
ROUNDINGS = 16
#: The seed of the random starting block: the same windows give the same answer in every run.
SEED = 2016


def applies(options, m: int, min_order: int) -> bool:
    """Whether windows whose Gram is m x m take the leading eigenpairs alone under ``options``, on an engine
    that serves from ``min_order`` (``GPU_MIN_ORDER``, ``CPU_MIN_ORDER``)."""
    return m >= min_order and (options.noise_given or options.estimator in LEADING_ESTIMATORS)


def width() -> int:
    """The Krylov space's dimension."""
    return BLOCK * STEPS


@lru_cache(maxsize=4)
def starting_block(m: int) -> np.ndarray:
    """(m, ``BLOCK``) float64: the random starting block every window of order m shares (read-only)."""
    block = np.random.default_rng(SEED).standard_normal((m, BLOCK))
    block.flags.writeable = False
    return block


def leading_eigenpairs(matrices, usable, start, orthonormal, eigh):
    """The ``KEEP`` largest eigenpairs of float64 ``matrices`` (B, m, m) (not overwritten).

    ``usable`` (B,) integers: each matrix's r, its top eigenvalues that are not null directions. ``start``
    (B, m, ``BLOCK``) or (m, ``BLOCK``): the starting block. ``orthonormal(block)`` gives (Q, failed): Q with
    orthonormal columns spanning ``block`` (B, m, b), failed (B,) bool where it lost its rank; ``eigh(S)`` gives
    (values ascending, vectors as columns, failed (B,) bool) of symmetric (B, k, k) matrices.

    Returns ``values`` (B, m) ascending: the kept Ritz values on top, below them r - ``KEEP`` places that share
    the rest of the trace equally, then zeros; ``failed`` (B,) bool: where the space broke down (r under
    ``STEPS + 1`` blocks, or a block that lost its rank) or an eigensolve failed, those windows' values,
    bounds and vectors 0; ``bounds`` (B, ``KEEP``): how far each kept Ritz value may be from its eigenvalue
    (see the module); ``vectors`` (B, m, ``KEEP``): the Ritz vectors, ascending.
    """
    xp = array_namespace(matrices)
    batch, m, _ = matrices.shape
    block, steps, keep = BLOCK, STEPS, KEEP
    dimensions = block * steps
    device = matrices.device
    basis = xp.empty((batch, m, dimensions), dtype=xp.float64, device=device)
    products = xp.empty_like(basis)
    current, failed = orthonormal(xp.broadcast_to(start, (batch, m, block)) if start.ndim == 2 else start)
    for step in range(steps):
        columns = slice(step * block, (step + 1) * block)
        basis[:, :, columns] = current
        products[:, :, columns] = matrices @ current
        if step == steps - 1:
            break
        earlier = basis[:, :, :columns.stop]
        following = products[:, :, columns]
        for _ in range(2):  # (once is not enough in floating point: "twice is enough")
            following = following - earlier @ (xp.matrix_transpose(earlier) @ following)
        current, broke = orthonormal(following)
        failed = failed | broke
    projected = xp.matrix_transpose(basis) @ products
    ritz_values, ritz_vectors, broke = eigh(0.5 * (projected + xp.matrix_transpose(projected)))
    usable = xp.reshape(xp.astype(xp.asarray(usable, device=device), xp.int64), (-1,))
    failed = (failed | broke | (usable < dimensions + block)
              | ~xp.all(xp.isfinite(ritz_values), axis=1))
    top = ritz_vectors[:, :, dimensions - keep:]
    top_values = ritz_values[:, dimensions - keep:]
    vectors = basis @ top
    residual = xp.linalg.vector_norm(products @ top - vectors * top_values[:, None, :], axis=1)
    beside = ritz_values[:, dimensions - keep - 1:]  # the kept ones and the Ritz value below them
    below = beside[:, 1:] - beside[:, :-1]
    above = xp.concat([below[:, 1:], xp.full_like(below[:, :1], float("inf"))], axis=1)
    gap = xp.minimum(below, above)
    tiny = float(np.finfo(np.float64).tiny)
    bounds = xp.where(2 * residual < gap, residual * residual / xp.clip(gap, min=tiny), residual)
    # (no closer than float64's own rounding of the largest: a converged residual says nothing below it)
    bounds = xp.maximum(bounds, ROUNDINGS * float(np.finfo(np.float64).eps) * xp.abs(top_values[:, -1:]))
    trace = xp.sum(xp.linalg.diagonal(matrices), axis=1)
    rest = (trace - xp.sum(top_values, axis=1)) / xp.astype(xp.clip(usable - keep, min=1), xp.float64)
    index = xp.arange(m, device=device)[None, :]
    zero = xp.zeros((), dtype=xp.float64, device=device)
    values = xp.where(index >= (m - usable)[:, None], rest[:, None], zero)
    values[:, m - keep:] = top_values
    values = xp.sort(xp.where(failed[:, None], zero, values), axis=1)
    vectors = xp.where(failed[:, None, None], zero, vectors)
    bounds = xp.where(failed[:, None], zero, bounds)
    return values, failed, bounds, vectors


def uncertainty(bounds, rank):
    """(B, 1): how far the eigenvalues a window's rank reads may be from the true ones: the largest of
    ``leading_eigenpairs``' ``bounds`` among the ``rank`` (B,) leading components and the two below them
    (the first noise eigenvalues, which the estimator tests), the rank as the Ritz values give it."""
    xp = array_namespace(bounds)
    keep = bounds.shape[1]
    index = xp.arange(keep, device=bounds.device)[None, :]
    read = index >= keep - xp.clip(xp.astype(rank, xp.int64) + 2, max=keep)[:, None]
    return xp.max(xp.where(read, bounds, xp.zeros_like(bounds)), axis=1, keepdims=True)
