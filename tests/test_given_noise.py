"""A given noise level (``denoise(noise=...)``): the rank is the number of lambda_i above the Marchenko-Pastur
edge sigma^2 (1 + sqrt(r / q))^2. ``estimators.given_noise_threshold`` against reference.given_noise_rank (a
plain float64 loop written from that formula), and the CPU engine against reference.denoise_reference
(same tolerances as test_engine_cpu.py)."""

import numpy as np
import pytest

from mppca_nipype import MPPCAInputError, denoise
from mppca_nipype.engine.estimators import given_noise_threshold
from mppca_nipype.phantoms import low_rank_phantom
from reference import given_noise_rank
from test_engine_cpu import assert_matches_reference, case_data, nonfinite_data, run_engine
from test_estimators import noisy_spectra

torch = pytest.importorskip("torch")


def reference_ranks(eigenvalues, n_voxels, n_volumes, sigma2):
    n_volumes = np.broadcast_to(n_volumes, len(eigenvalues))
    sigma2 = np.broadcast_to(sigma2, len(eigenvalues))
    return np.array([given_noise_rank(e, int(n), int(t), float(s))
                     for e, n, t, s in zip(eigenvalues, n_voxels, n_volumes, sigma2)])


# -- the threshold ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_voxels, n_volumes", [(125, 40), (27, 60), (48, 48), (343, 30), (8, 96)])
def test_threshold_matches_the_formula_loop_and_finds_the_planted_rank(n_voxels, n_volumes):
    rng = np.random.default_rng(11)
    eigenvalues = noisy_spectra(rng, 40, n_voxels, n_volumes, planted_rank=3, sigma=2.0)
    counts = np.full(40, n_voxels)
    rank = given_noise_threshold(eigenvalues, counts, n_volumes, 4.0)
    assert np.array_equal(rank, reference_ranks(eigenvalues, counts, n_volumes, 4.0))
    # the signal stands far above the edge and the noise below it: the planted rank, give or take one
    assert np.median(rank) == 3 and np.all(np.abs(rank - 3) <= 1)


def test_per_patch_counts_and_variances_match_the_formula_loop():
    # patches that lost voxels (NaN) use only their top r = min(n, T) eigenvalues; T - 1 after voxel demeaning
    rng = np.random.default_rng(12)
    eigenvalues = np.sort(rng.gamma(1.5, size=(300, 24)) ** 2, axis=1)
    eigenvalues[:, :2] -= 1e-9  # negative round-off is clamped at 0
    n_voxels = rng.integers(3, 60, size=300)
    n_volumes = rng.choice([23, 24], size=300)
    sigma2 = rng.uniform(0.05, 0.5, size=300)
    rank = given_noise_threshold(eigenvalues, n_voxels, n_volumes, sigma2)
    want = reference_ranks(eigenvalues, n_voxels, n_volumes, sigma2)
    assert np.array_equal(rank, want)
    assert 0 < want.mean() < 20  # neither all kept nor none: the edge decides
    assert np.all(rank <= np.minimum(n_voxels, n_volumes))


def test_a_tiny_noise_level_keeps_every_usable_component_and_a_huge_one_none():
    rng = np.random.default_rng(13)
    eigenvalues = noisy_spectra(rng, 5, 27, 40)
    counts = np.array([27, 20, 27, 10, 27])
    assert given_noise_threshold(eigenvalues, counts, 39, 1e-12).tolist() == [27, 20, 27, 10, 27]
    assert given_noise_threshold(eigenvalues, counts, 39, 1e12).tolist() == [0] * 5


def test_numpy_and_torch_agree_exactly():
    rng = np.random.default_rng(14)
    n_voxels = rng.integers(5, 80, size=200)
    eigenvalues = np.sort(rng.gamma(1.5, size=(200, 30)) ** 2, axis=1)
    sigma2 = rng.uniform(0.1, 1.0, size=200)
    rank = given_noise_threshold(eigenvalues, n_voxels, 30, sigma2)
    t_rank = given_noise_threshold(torch.from_numpy(eigenvalues), torch.from_numpy(n_voxels), 30,
                                   torch.from_numpy(sigma2))
    assert isinstance(t_rank, torch.Tensor)
    assert np.array_equal(t_rank.numpy(), rank)
    assert np.array_equal(given_noise_threshold(torch.from_numpy(eigenvalues), torch.from_numpy(n_voxels), 30,
                                                0.5).numpy(), given_noise_threshold(eigenvalues, n_voxels, 30, 0.5))


# -- the CPU engine against the reference -----------------------------------------------------------------

def noise_map(shape, seed):
    """A sigma map near the case data's noise (1), varying by +-20% across the image."""
    return np.random.default_rng(seed).uniform(0.8, 1.2, size=shape)


OPTION_SETS = [("center", "none", 1), ("center", "voxel", 1), ("weighted", "volume", 2),
               ("weighted", "voxel", 3), ("uniform", "none", 2), ("center", "volume", 1)]


@pytest.mark.parametrize("case", ["time-side", "voxel-side", "square", "anisotropic", "mask"])
@pytest.mark.parametrize("aggregation, demean, stride", OPTION_SETS)
@pytest.mark.parametrize("given", ["number", "map"])
def test_given_noise_matches_the_reference(case, aggregation, demean, stride, given):
    data, mask, extent = case_data(case, seed=21)
    noise = 1.0 if given == "number" else noise_map(data.shape[:3], 22)
    result, (_, sigma, _) = assert_matches_reference(data, mask, extent=extent, stride=stride,
                                                     aggregation=aggregation, demean=demean, estimator="exp2",
                                                     noise=noise)
    assert result.info["noise"] == "given"
    served = sigma > 0
    if given == "number":  # every patch reports the given sigma
        np.testing.assert_allclose(result.sigma[served], 1.0, rtol=1e-6)
    else:  # each patch reports sqrt of the mean sigma^2 over it: within the map's range
        assert np.all((result.sigma[served] >= 0.8) & (result.sigma[served] <= 1.2))


@pytest.mark.parametrize("case", ["time-side", "voxel-side"])
@pytest.mark.parametrize("aggregation, demean, stride", [("center", "none", 1), ("weighted", "volume", 2)])
def test_given_noise_leaves_nonfinite_voxels_out(case, aggregation, demean, stride):
    data, mask = nonfinite_data(case)
    noise = noise_map(data.shape[:3], 23)
    noise[~mask] = np.nan  # outside the mask the map may hold anything: those voxels are skipped
    result, _ = assert_matches_reference(data, mask, extent=3, stride=stride, aggregation=aggregation,
                                         demean=demean, estimator="exp2", noise=noise)
    bad = ~np.isfinite(data).all(axis=3)
    assert np.all(result.sigma[bad] == 0) and np.all(np.isfinite(result.sigma))


def test_a_constant_map_gives_the_number_s_result():
    data, mask, extent = case_data("mask", seed=24)
    options = dict(extent=extent, stride=2, aggregation="weighted", demean="volume", estimator="exp2")
    number = run_engine(data, mask, noise=1.1, **options)
    constant = run_engine(data, mask, noise=np.full(data.shape[:3], 1.1), **options)
    assert np.array_equal(number.denoised, constant.denoised)
    assert np.array_equal(number.rank, constant.rank)
    np.testing.assert_allclose(number.sigma, constant.sigma, rtol=1e-7)


@pytest.mark.parametrize("options", [dict(), dict(extent="auto", stride=1, aggregation="center", demean="none")],
                         ids=["defaults", "dwidenoise"])
def test_the_true_sigma_on_a_phantom_keeps_the_estimated_rank(options):
    data, clean = low_rank_phantom(shape=(20, 20, 12), n_volumes=40, rank=4, sigma=5.0)
    estimated = denoise(data, device="cpu", nprocs=1, **options)
    given = denoise(data, device="cpu", nprocs=1, noise=5.0, **options)
    assert np.mean(np.abs(given.rank - estimated.rank) <= 1) >= 0.95
    assert abs(np.median(given.rank) - 4) <= 1
    np.testing.assert_allclose(given.sigma, 5.0, rtol=1e-6)
    # as close to the truth as the estimated run: within 5% in RMSE
    error = [np.sqrt(np.mean((result.denoised - clean) ** 2)) for result in (estimated, given)]
    assert error[1] <= 1.05 * error[0] and error[1] < 5.0 / 2


# -- what is refused, and where it runs --------------------------------------------------------------------

@pytest.mark.parametrize("noise, match", [
    (-1.0, "positive number"), (0, "positive number"), (float("nan"), "positive number"),
    (float("inf"), "positive number"), (np.ones((7, 5, 5)), "shape"), (np.ones((7, 5, 6, 2)), "shape"),
    (np.array(["1"] * 210).reshape(7, 5, 6), "numbers"),
], ids=["negative", "zero", "nan", "inf", "grid", "4D", "text"])
def test_bad_noise_levels_are_refused(noise, match):
    data, _, _ = case_data("time-side")
    with pytest.raises(MPPCAInputError, match=match):
        denoise(data, noise=noise, device="cpu", nprocs=1)


def test_a_map_must_be_positive_inside_the_mask_only():
    data, _, _ = case_data("time-side")
    noise = np.ones(data.shape[:3])
    noise[0, 0, 0], noise[1, 0, 0] = np.nan, -1
    with pytest.raises(MPPCAInputError, match=r"2 voxels .*first at \(0, 0, 0\)"):
        denoise(data, noise=noise, device="cpu", nprocs=1)
    mask = np.ones(data.shape[:3], bool)
    mask[:2, 0, 0] = False
    with pytest.raises(MPPCAInputError, match="1 voxels inside the mask"):
        denoise(data, mask=np.where(np.arange(7)[:, None, None] == 0, mask, True), noise=noise, device="cpu")
    result = run_engine(data, mask, noise=noise, extent=3, stride=1, aggregation="center", demean="none",
                        estimator="exp2")
    assert np.all(result.sigma[mask] == 1.0)


def test_a_trailing_axis_of_length_one_is_allowed():
    data, _, _ = case_data("time-side")
    options = dict(extent=3, stride=2, aggregation="weighted", demean="volume", estimator="exp2")
    flat = run_engine(data, noise=np.full(data.shape[:3], 1.0), **options)
    trailing = run_engine(data, noise=np.full((*data.shape[:3], 1), 1.0), **options)
    assert np.array_equal(flat.denoised, trailing.denoised)
