"""The CPU's eigen step (engine/lapack.py) against ``numpy.linalg.eigh``: all eigenvalues, and the leading
eigenvectors of each matrix only, on Gram matrices of awkward sizes and contents.

Tolerances. Both are backward-stable float64 (or float32) decompositions of the same matrix: eigenvalues agree
to a few roundings of the largest (we allow 1e-12 of it, 1e-5 in float32), and projectors onto leading
eigenvectors to eps ||A|| / gap, the gap between the smallest kept and the largest dropped eigenvalue.
"""

import numpy as np
import pytest

from mppca_nipype.engine import lapack


def grams(rng, batch, n, m, rank=4, baseline=1000.0):
    """(batch, m, m) Gram matrices of n x m patches: a baseline, a few components and unit noise."""
    x = baseline + rng.standard_normal((batch, n, rank)) @ (20 * rng.standard_normal((batch, rank, m)))
    x = x + rng.standard_normal((batch, n, m))
    return np.matmul(x.transpose(0, 2, 1), x)


def projector(vectors, kept):
    leading = vectors[:, vectors.shape[1] - kept:]
    return leading @ leading.T


def assert_matches_eigh(gram, rank, rtol=1e-12):
    forms = lapack.eigenvalues(gram)
    vectors = lapack.leading_eigenvectors(forms, rank)
    expected_values, expected_vectors = np.linalg.eigh(gram.astype(np.float64))
    scale = np.abs(expected_values).max(axis=1, keepdims=True)
    assert forms.eigenvalues.dtype == gram.dtype and vectors.dtype == gram.dtype
    assert np.all(np.abs(forms.eigenvalues - expected_values) <= rtol * scale)
    m = gram.shape[1]
    eps = np.finfo(gram.dtype).eps
    for b, kept in enumerate(rank):
        assert np.all(vectors[b, :, :m - kept] == 0)  # only the kept ones are computed
        if kept == 0:
            continue
        gap = expected_values[b, m - kept] - expected_values[b, m - kept - 1] if kept < m else np.inf
        error = np.abs(projector(vectors[b], kept) - projector(expected_vectors[b], kept)).max()
        assert error <= 50 * m * eps + 10 * eps * scale[b, 0] / gap, (b, kept, error)
    return forms, vectors


@pytest.mark.parametrize("m", [3, 17, 48, 100])
def test_eigenvalues_and_leading_eigenvectors_match_eigh(m):
    rng = np.random.default_rng(m)
    gram = grams(rng, 12, m + 25, m)
    rank = rng.integers(0, m + 1, size=12)
    rank[:3] = [0, 1, m]
    assert_matches_eigh(gram, rank)


def test_float32_matrices_are_decomposed_in_float32():
    rng = np.random.default_rng(1)
    gram = grams(rng, 6, 40, 24, baseline=0.0).astype(np.float32)
    assert_matches_eigh(gram, np.array([0, 1, 3, 5, 12, 24]), rtol=1e-5)


def test_left_out_voxels_and_empty_windows_split_the_tridiagonal_form():
    """Rows of zeros (voxels left out of the patch, on the voxel side) and an all-zero window make exact
    zeros off the diagonal and repeated eigenvalues: the leading eigenvectors still span the right space."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 30, 12)) * 5 + 100
    x[0, :, 4:7] = 0  # three voxels left out (voxel side: the Gram is n x n = 12 x 12)
    x[1] = 0  # nothing left
    x[2, :, ::2] = 0
    gram = np.matmul(x.transpose(0, 2, 1), x)
    forms, vectors = assert_matches_eigh(gram, np.array([9, 12, 6]))
    assert np.all(forms.eigenvalues[1] == 0)
    np.testing.assert_allclose(projector(vectors[1], 12), np.eye(12), atol=1e-12)


def test_a_failed_step_falls_back_to_eigh(monkeypatch):
    """A window whose ``dsterf`` or ``dstein`` reports a failure is decomposed by ``numpy.linalg.eigh``."""
    rng = np.random.default_rng(3)
    gram = grams(rng, 4, 30, 10)
    routines = lapack._routines("float64")
    reduce, values_of, inverse_iteration, apply_reflectors = routines
    calls = {"values": 0, "vectors": 0}

    def values_failing_second(d, e):
        calls["values"] += 1
        values, info = values_of(d, e)
        return values, (1 if calls["values"] == 2 else info)

    def vectors_failing_third(d, e, w, iblock, isplit):
        calls["vectors"] += 1
        vectors, info = inverse_iteration(d, e, w, iblock, isplit)
        return vectors, (1 if calls["vectors"] == 2 else info)  # the second call: window 2 (1 fell back)

    monkeypatch.setattr(lapack, "_routines", lambda dtype: (reduce, values_failing_second, vectors_failing_third,
                                                             apply_reflectors))
    forms, _ = assert_matches_eigh(gram, np.array([2, 3, 4, 1]))
    assert list(forms.fallback) == [1] and calls == {"values": 4, "vectors": 3}
