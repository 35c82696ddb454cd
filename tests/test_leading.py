"""The leading eigenpairs of the longest series (``engine.leading``) on the CPU engine: the block Krylov solver
against LAPACK in float64, and whole runs against tests/reference.py's patch-by-patch float64 MP-PCA.

The real constants take Grams of 1,024 and more; here the blocks are small (8 vectors, 12 steps, 16 kept) so
that 120 x 120 Grams take the path in seconds. Tolerances: the runs find their eigenvalues in float64 and
redo in full the windows whose rank their bounds leave open, so they match the reference as the float64
engine does (1e-6 rms on the denoised series, 1e-6 on sigma, ranks equal).
"""

import numpy as np
import pytest

from mppca_nipype.engine import cpu, leading
from mppca_nipype.engine.estimators import marchenko_pastur_threshold
from mppca_nipype.phantoms import low_rank_phantom
from reference import denoise_reference
from test_engine_cpu import rms_relative, run_engine


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(leading, "BLOCK", 8)
    monkeypatch.setattr(leading, "STEPS", 12)
    monkeypatch.setattr(leading, "KEEP", 16)
    monkeypatch.setattr(leading, "CPU_MIN_ORDER", 100)


def patch_grams(rng, n_voxels, n_volumes, rank, count):
    """Gram matrices (T side) of volume-demeaned patches: ``rank`` components of decreasing strength, the
    weakest near the noise edge, in unit Gaussian noise."""
    grams = []
    for _ in range(count):
        strength = np.geomspace(40.0, 1.3, rank) * np.sqrt(n_voxels)
        signal = (rng.standard_normal((n_voxels, rank)) * strength) @ rng.standard_normal((rank, n_volumes))
        patch = signal / np.sqrt(n_volumes) + rng.standard_normal((n_voxels, n_volumes))
        patch -= patch.mean(axis=0)
        grams.append(patch.T @ patch)
    return np.stack(grams)


def test_the_cpu_solver_keeps_its_values_within_their_bounds(small_blocks):
    """NumPy's leading eigenpairs: the kept Ritz values within their bounds of LAPACK's, the signal ones within
    1e-9 of the largest, the spectrum ascending and summing to the trace, the estimator's rank and noise level
    those of the full spectrum, the Ritz vectors LAPACK's; a window of too few usable dimensions failed, with
    zeros."""
    rng = np.random.default_rng(5)
    n_voxels, n_volumes, rank = 400, 240, 5
    grams = patch_grams(rng, n_voxels, n_volumes, rank, 4)
    usable = np.array([n_volumes] * 3 + [90])
    values, failed, bounds, vectors = leading.leading_eigenpairs(grams, usable, leading.starting_block(n_volumes),
                                                                 cpu._orthonormal, cpu._eigh)
    exact_values, exact_vectors = np.linalg.eigh(grams)
    assert failed.tolist() == [False, False, False, True]
    errors = np.abs(values[:3, -16:] - exact_values[:3, -16:])
    assert (errors <= bounds[:3]).all()
    assert errors[:, -rank:].max() < 1e-9 * exact_values[:3, -1].max()
    assert (np.diff(values, axis=1) >= 0).all()
    np.testing.assert_allclose(values[:3].sum(axis=1), np.trace(grams[:3], axis1=1, axis2=2), rtol=1e-12)
    assert not values[3].any() and not bounds[3].any() and not vectors[3].any()
    counts = np.full(3, n_voxels - 1)
    got_rank, got_sigma2 = marchenko_pastur_threshold(values[:3], counts, n_volumes, "olesen2023")
    want_rank, want_sigma2 = marchenko_pastur_threshold(exact_values[:3], counts, n_volumes, "olesen2023")
    assert got_rank.tolist() == want_rank.tolist()
    np.testing.assert_allclose(got_sigma2, want_sigma2, rtol=1e-8)
    top, want = vectors[:3, :, -rank:], exact_vectors[:3, :, -rank:]
    np.testing.assert_allclose(top @ top.transpose(0, 2, 1), want @ want.transpose(0, 2, 1), atol=1e-8)


@pytest.mark.parametrize("filter_name, noise, aggregation", [("optshrink", None, "gaussian"),
                                                             ("hard", None, "weighted"),
                                                             ("optthresh", 5.0, "center"),
                                                             ("hard", 5.0, "weighted")])
def test_runs_with_the_leading_eigenpairs_match_the_reference(small_blocks, filter_name, noise, aggregation):
    """A long series with ``olesen2023`` (or a given noise level) on the CPU: the leading eigenpairs serve its
    windows and the result is the float64 reference's."""
    noisy, _ = low_rank_phantom((11, 10, 10), n_volumes=120, rank=4, sigma=5.0, seed=17)
    options = dict(extent=7, stride=1 if aggregation == "center" else 3, estimator="olesen2023",
                   aggregation=aggregation, demean="volume", filter=filter_name, noise=noise)
    result = run_engine(noisy, **options)
    assert result.info["leading_eigenpairs"] and result.info["gram_precision"] == "float64"
    denoised, sigma, rank = denoise_reference(noisy, **options)
    assert rms_relative(result.denoised, denoised) <= 1e-6
    np.testing.assert_allclose(result.sigma, sigma, rtol=1e-6, atol=0)
    np.testing.assert_allclose(result.rank, rank, rtol=1e-6, atol=1e-9)


def test_windows_the_bounds_leave_open_are_decomposed_in_full(small_blocks, monkeypatch):
    """With too short a space (3 steps) the first noise eigenvalues' bounds leave every rank open: every
    window is redone by the full eigensolve, and the result is still the reference's."""
    monkeypatch.setattr(leading, "STEPS", 3)
    redone = []
    window_spectra = cpu.window_spectra

    def counting(*args, full=False, **kwargs):
        spectra = window_spectra(*args, full=full, **kwargs)
        if not full and spectra.unsettled is not None:
            redone.append(int(spectra.unsettled.sum()))
        return spectra

    monkeypatch.setattr(cpu, "window_spectra", counting)
    noisy, _ = low_rank_phantom((11, 10, 10), n_volumes=120, rank=4, sigma=5.0, seed=17)
    options = dict(extent=7, stride=3, estimator="olesen2023", aggregation="gaussian", demean="volume",
                   filter="optshrink")
    result = run_engine(noisy, **options)
    assert sum(redone) == result.info["n_windows"]
    denoised, sigma, _ = denoise_reference(noisy, **options)
    assert rms_relative(result.denoised, denoised) <= 1e-6
    np.testing.assert_allclose(result.sigma, sigma, rtol=1e-6, atol=0)


def test_other_estimators_and_short_series_take_the_full_eigensolve(small_blocks):
    noisy, _ = low_rank_phantom((11, 10, 10), n_volumes=120, rank=4, sigma=5.0, seed=17)
    assert not run_engine(noisy, extent=7, stride=3, estimator="exp2").info["leading_eigenpairs"]
    assert not run_engine(noisy[..., :90], extent=7, stride=3).info["leading_eigenpairs"]


def test_the_noise_map_alone_matches_denoise_with_the_leading_eigenpairs(small_blocks):
    """``estimate_noise`` settles the windows as ``denoise`` does: its maps stay bit-identical."""
    from test_noise_only import both

    noisy, _ = low_rank_phantom((11, 10, 10), n_volumes=120, rank=4, sigma=5.0, seed=17)
    full, noise = both(noisy, extent=7, stride=3, estimator="olesen2023", aggregation="gaussian", demean="volume")
    assert noise.info["leading_eigenpairs"]
    assert np.array_equal(noise.sigma, full.sigma) and np.array_equal(noise.rank, full.rank)
