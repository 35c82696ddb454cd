"""The CPU's eigen step: every eigenvalue of each window's Gram matrix, then only the kept eigenvectors.

MP-PCA needs all m eigenvalues of a window's Gram matrix (the threshold sums them) but only its P leading
eigenvectors (the projector), and P is small: 5-10 of m = 48-100 on DWI. A full ``eigh`` (LAPACK's
``dsyevd``) computes all m eigenvectors and transforms all of them back. Here LAPACK's steps run one by one,
through SciPy, one window at a time (each call is a few microseconds of Python for 30-300 of work):

1. ``eigenvalues``: the Householder reduction to tridiagonal form Q^T A Q = T (``dsytrd``), then all
   eigenvalues of T without vectors (``dsterf``, Pal-Walker-Kahan QR);
2. the threshold decides P (``estimators.marchenko_pastur_threshold``, for the whole batch);
3. ``leading_eigenvectors``: inverse iteration on T for its P largest eigenvalues (``dstein``), and Q's
   reflectors applied to those P vectors (``dormqr``).

On 100 x 100 Grams of the DWI phantom's windows that is 295 us a window against 452 for MKL's batched
``dsyevd`` (torch) and 555 for OpenBLAS's (NumPy); at m = 48 (the defaults) 90 against 107 and 147
(docs/benchmarks.md, "The CPU's eigen step"). A window whose steps fail (or, for ``dstein``, whose matrix is 0) is decomposed by
``numpy.linalg.eigh`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.linalg import get_lapack_funcs


@lru_cache(maxsize=None)
def _routines(dtype: str):
    return get_lapack_funcs(("sytrd", "sterf", "stein", "ormqr"), dtype=np.dtype(dtype))


@lru_cache(maxsize=None)
def _reduction_workspace(dtype: str, m: int) -> int:
    query = get_lapack_funcs("sytrd_lwork", dtype=np.dtype(dtype))
    size, info = query(m, lower=1)
    return max(int(size), 1) if info == 0 else max(m * 64, 1)


@dataclass
class TridiagonalForms:
    """A batch of Gram matrices reduced to tridiagonal form, and their eigenvalues.

    ``reflectors`` (B, m, m): each matrix as ``dsytrd`` leaves it (Fortran order, so ``reflectors[b].T``: the
    reflectors of Q below the sub-diagonal); ``diagonal`` (B, m) and ``off_diagonal`` (B, m - 1): T;
    ``tau`` (B, m - 1): the reflectors' scales; ``eigenvalues`` (B, m) ascending; ``fallback``: windows
    decomposed by ``numpy.linalg.eigh`` instead (a step failed), with ``fallback_vectors`` (their full
    eigenvectors, columns ascending)."""

    gram: np.ndarray
    reflectors: np.ndarray
    diagonal: np.ndarray
    off_diagonal: np.ndarray
    tau: np.ndarray
    eigenvalues: np.ndarray
    fallback: dict


def eigenvalues(gram) -> TridiagonalForms:
    """All eigenvalues of each symmetric matrix of ``gram`` (B, m, m), float32 or float64 (left as it is),
    ascending in ``.eigenvalues``; the forms ``leading_eigenvectors`` continues from."""
    batch, m, _ = gram.shape
    dtype = gram.dtype.name
    reduce, values_of, _, _ = _routines(dtype)
    workspace = _reduction_workspace(dtype, m)
    reflectors = np.array(gram, order="C", copy=True)  # reflectors[b].T: Fortran order, overwritten in place
    diagonal = np.empty((batch, m), dtype=gram.dtype)
    off_diagonal = np.empty((batch, max(m - 1, 0)), dtype=gram.dtype)
    tau = np.empty_like(off_diagonal)
    values = np.empty((batch, m), dtype=gram.dtype)
    failed = []
    for b in range(batch):
        matrix = reflectors[b].T  # symmetric: the transposed view is the same matrix, in Fortran order
        reduced, diagonal[b], off_diagonal[b], tau[b], info = reduce(matrix, lower=1, lwork=workspace,
                                                                      overwrite_a=1)
        if not np.shares_memory(reduced, matrix):
            matrix[...] = reduced
        if info == 0:
            values[b], info = values_of(diagonal[b], off_diagonal[b])
        if info != 0:
            failed.append(b)
    fallback = {}
    if failed:
        full_values, full_vectors = np.linalg.eigh(gram[failed])
        values[failed] = full_values
        fallback = dict(zip(failed, full_vectors))
    return TridiagonalForms(gram, reflectors, diagonal, off_diagonal, tau, values, fallback)


def leading_eigenvectors(forms: TridiagonalForms, rank) -> np.ndarray:
    """(B, m, m): the ``rank[b]`` leading eigenvectors of each matrix in its last ``rank[b]`` columns
    (ascending, as ``eigh`` orders them), zeros elsewhere."""
    batch, m = forms.eigenvalues.shape
    dtype = forms.eigenvalues.dtype
    _, _, inverse_iteration, apply_reflectors = _routines(dtype.name)
    vectors = np.zeros((batch, m, m), dtype=dtype)
    one_block = np.ones(m, dtype=np.int32)  # T as one block: dstein orthogonalises close eigenvalues in it
    block_ends = np.zeros(m, dtype=np.int32)
    block_ends[0] = m
    for b in np.flatnonzero(rank > 0):
        kept = int(rank[b])
        if b in forms.fallback:
            vectors[b, :, m - kept:] = forms.fallback[b][:, m - kept:]
            continue
        leading, info = inverse_iteration(forms.diagonal[b], forms.off_diagonal[b], forms.eigenvalues[b, m - kept:],
                                          one_block, block_ends)
        if info == 0 and m > 1:
            leading[1:], _, info = apply_reflectors("L", "N", forms.reflectors[b].T[1:, :-1], forms.tau[b],
                                                    leading[1:], max(kept, 1) * 64, overwrite_c=1)
        if info != 0 or not np.isfinite(leading).all():  # a failure, or T = 0 (dstein divides by its norm)
            leading = np.linalg.eigh(forms.gram[b])[1][:, m - kept:]
        vectors[b, :, m - kept:] = leading
    return vectors
