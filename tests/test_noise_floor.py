"""The magnitude noise floor (``denoise(noise_floor=...)``, ``engine.noise_floor``): the non-central chi moments
against Monte Carlo, the variance-stabilising transform's unit variance, its inverse's lack of bias, the
bias it removes from a denoised Rician phantom, and the errors of the API and the command."""

import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from mppca_nipype import MPPCAInputError, denoise
from mppca_nipype.engine.noise_floor import (magnitude_density, magnitude_mean, magnitude_second_moment,
                                             magnitude_sd, noise_level_from_magnitude, stabilizer)
from mppca_nipype.phantoms import dwi_phantom

SAMPLES = 200_000


def magnitudes(theta, coils, size=SAMPLES, seed=0):
    """y = m / sigma of ``coils`` channels with noise of unit sigma, the signal theta in the first."""
    rng = np.random.default_rng(seed)
    channels = rng.standard_normal((2 * coils, size))
    channels[0] += theta
    return np.sqrt(np.square(channels).sum(axis=0))


# -- the moments (Koay & Basser 2006) ---------------------------------------------------------------------

@pytest.mark.parametrize("coils", [1, 4])
@pytest.mark.parametrize("theta", [0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0])
def test_the_moments_match_monte_carlo(theta, coils):
    y = magnitudes(theta, coils)
    standard_error = y.std() / np.sqrt(y.size)
    assert abs(magnitude_mean(theta, coils) - y.mean()) < 5 * standard_error  # about 0.01
    assert magnitude_second_moment(theta, coils) == pytest.approx(np.mean(y**2), rel=0.01)
    assert magnitude_sd(theta, coils) == pytest.approx(y.std(), rel=0.01)


@pytest.mark.parametrize("coils", [1, 4])
@pytest.mark.parametrize("theta", [0.0, 1.0, 30.0])
def test_the_density_integrates_to_one_with_the_mean_of_the_formula(theta, coils):
    y = np.arange(0.0005, theta + 15, 0.001)
    density = magnitude_density(y, theta, coils)
    assert np.sum(density) * 0.001 == pytest.approx(1, abs=1e-6)
    assert np.sum(y * density) * 0.001 == pytest.approx(magnitude_mean(theta, coils), abs=1e-6)


# -- the transform (Foi 2011) -----------------------------------------------------------------------------

@pytest.mark.parametrize("coils", [1, 4])
def test_the_transform_gives_unit_variance_within_5_percent_at_any_snr(coils):
    transform = stabilizer(coils)
    variances = [transform.mean_and_variance(theta)[1] for theta in np.arange(0, 20.01, 0.25)]
    assert 0.95 < min(variances) and max(variances) < 1.05
    # the same on samples (the raw magnitude's variance is 0.43 at theta = 0 for Rician data)
    for theta in (0.0, 1.5, 6.0):
        assert transform.forward(magnitudes(theta, coils, seed=1)).var() == pytest.approx(1, abs=0.06)


@pytest.mark.parametrize("coils", [1, 4])
@pytest.mark.parametrize("theta", [0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0])
def test_the_inverse_of_the_mean_transformed_magnitude_is_the_signal(theta, coils):
    transform = stabilizer(coils)
    y = magnitudes(theta, coils, seed=2)
    assert transform.inverse(transform.forward(y).mean()) == pytest.approx(theta, abs=0.03)
    assert y.mean() - theta > 0.02  # what the floor adds to the plain mean


def test_the_transform_and_its_inverse_continue_past_the_tables():
    transform = stabilizer(1)
    y = np.array([0.0, 45.0, 1000.0])
    x = transform.forward(y)
    assert np.all(np.diff(x) > 0) and x[2] - x[1] == pytest.approx(955, rel=1e-3)
    assert transform.inverse(x[2]) == pytest.approx(1000, rel=1e-3)
    assert transform.inverse(-5.0) == 0


@pytest.mark.parametrize("coils", [1, 4])
def test_the_noise_level_is_recovered_from_the_magnitudes_spread(coils):
    # per voxel: MP-PCA sees sigma * rms of s(theta_t); the denoised magnitudes are sigma * mu(theta_t)
    thetas = np.array([[0.0] * 6, [0.0, 0.5, 1.0, 2.0, 0.3, 0.0], [2.0, 4.0, 8.0, 16.0, 3.0, 1.0]])
    sigma = np.array([3.0, 10.0, 0.5])
    spread = sigma * np.sqrt(np.mean(magnitude_sd(thetas, coils) ** 2, axis=1))
    means = (sigma[:, None] * magnitude_mean(thetas, coils)).astype(np.float32)
    recovered = noise_level_from_magnitude(spread[:, None, None], means[:, None, None, :], coils)
    np.testing.assert_allclose(recovered[:, 0, 0], sigma, rtol=0.01)
    assert np.all(spread[:2] < 0.8 * sigma[:2])  # the raw spread is far below sigma at low SNR


@pytest.mark.parametrize("order", ["C", "F"])
def test_the_host_steps_give_the_same_numbers_on_any_number_of_threads(order, monkeypatch):
    """The transforms and the noise level's bisection, spread over threads in chunks and slabs, are
    bit-identical to one thread, for a series in either memory order."""
    from mppca_nipype.engine import noise_floor

    monkeypatch.setattr(noise_floor, "CHUNK", 1000)  # many chunks and slabs on this small series
    rng = np.random.default_rng(5)
    means = np.asarray(rng.uniform(0, 30, (13, 7, 5, 11)).astype(np.float32), order=order)
    spread = rng.uniform(0.5, 3, (13, 7, 5))
    spread[2, 3, 4] = 0  # stays 0
    one = noise_level_from_magnitude(spread, means, 1, threads=1)
    np.testing.assert_array_equal(noise_level_from_magnitude(spread, means, 1, threads=3), one)
    assert one[2, 3, 4] == 0 and np.all(one[spread > 0] >= spread[spread > 0])
    transform = stabilizer(1)
    for function in (transform.forward, transform.inverse):
        single, spread_out = np.empty_like(means), np.empty_like(means)
        noise_floor._in_chunks(function, means, single, threads=1)
        noise_floor._in_chunks(function, means, spread_out, threads=4)
        np.testing.assert_array_equal(spread_out, single)
        np.testing.assert_array_equal(single, function(means).astype(np.float32))


# -- denoising a magnitude phantom ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rician_phantom():
    sigma = 200.0  # b = 0 signal near 1000: SNR 5
    noisy, truth, _, _ = dwi_phantom(shape=(24, 24, 16), n_volumes=24, sigma=sigma, rician=True, seed=3)
    return noisy, truth, sigma


def floor_scores(denoised, truth, sigma):
    head = truth[..., 0] > 0
    low = (truth < 3 * sigma) & head[..., None]
    error = denoised.astype(np.float64) - truth
    return np.sqrt(np.mean(error[head] ** 2)), error[low].mean()


@pytest.mark.parametrize("given", [False, True], ids=["sigma estimated", "sigma given"])
def test_the_rician_floor_halves_the_low_signal_bias_without_raising_the_error(rician_phantom, given):
    # measured (seed 3): bias where the truth is below 3 sigma 55.0 without the floor, 15.3 with it
    # (sigma estimated: median 176 in the head) and 5.1 (given); RMSE in the head 90.3, 84.1 and 82.3
    noisy, truth, sigma = rician_phantom
    plain_rmse, plain_bias = floor_scores(denoise(noisy, device="cpu", nprocs=2).denoised, truth, sigma)
    result = denoise(noisy, noise_floor="rician", noise=sigma if given else None, device="cpu", nprocs=2)
    rmse, bias = floor_scores(result.denoised, truth, sigma)
    assert plain_bias > 0.2 * sigma
    assert abs(bias) <= 0.5 * plain_bias
    assert rmse <= plain_rmse
    assert result.info["noise_floor"] == "rician" and result.info["coils"] == 1
    assert result.info["noise"] == ("given" if given else "estimated")
    head = truth[..., 0] > 0
    assert np.median(result.sigma[head]) == pytest.approx(sigma, rel=0.15)


def test_a_four_channel_floor_with_the_given_sigma():
    # measured (seed 3): low-signal bias 110.7 without the floor, -11.6 with it; RMSE 85.7 and 50.8
    sigma = 100.0
    noisy, truth, _, _ = dwi_phantom(shape=(24, 24, 16), n_volumes=24, sigma=sigma, rician=True, coils=4, seed=3)
    plain_rmse, plain_bias = floor_scores(denoise(noisy, device="cpu", nprocs=2).denoised, truth, sigma)
    result = denoise(noisy, noise_floor="ncchi", coils=4, noise=sigma, device="cpu", nprocs=2)
    rmse, bias = floor_scores(result.denoised, truth, sigma)
    assert abs(bias) <= 0.5 * plain_bias and rmse <= 0.8 * plain_rmse


def test_no_floor_is_the_plain_run_bit_for_bit(rician_phantom):
    noisy = rician_phantom[0]
    plain = denoise(noisy, device="cpu", nprocs=2)
    none = denoise(noisy, noise_floor="none", coils=1, device="cpu", nprocs=2)
    assert np.array_equal(plain.denoised, none.denoised) and np.array_equal(plain.sigma, none.sigma)
    assert "noise_floor" not in none.info


def test_a_mask_and_nan_voxels_are_kept_as_denoise_keeps_them(rician_phantom):
    noisy = rician_phantom[0].copy()
    noisy[3, 4, 5, 2] = np.nan
    mask = np.zeros(noisy.shape[:3], bool)
    mask[2:20, 2:20, 2:14] = True
    with pytest.warns(UserWarning, match="NaN"):
        result = denoise(noisy, mask, noise_floor="rician", noise=200.0, device="cpu", nprocs=2)
    assert np.all(result.denoised[~mask] == 0) and np.all(result.sigma[~mask] == 0)
    np.testing.assert_array_equal(result.denoised[3, 4, 5], noisy[3, 4, 5])
    assert np.all(np.isfinite(result.denoised[mask & ~np.isnan(noisy).any(axis=3)]))


# -- errors -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    (dict(noise_floor="gaussian"), "noise_floor must be one of none, rician, ncchi"),
    (dict(coils=4), "needs noise_floor 'ncchi'"),
    (dict(noise_floor="rician", coils=2), "needs noise_floor 'ncchi'"),
    (dict(noise_floor="ncchi", coils=0), "coils must be a positive integer"),
])
def test_bad_combinations_fail_with_one_sentence(rician_phantom, options, message):
    with pytest.raises(MPPCAInputError, match=message):
        denoise(rician_phantom[0], **options)


def test_negative_data_with_a_floor_fail_with_one_sentence(rician_phantom):
    with pytest.raises(MPPCAInputError, match="negative values, but a noise floor models magnitude"):
        denoise(rician_phantom[0] - 500, noise_floor="rician")


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mppca_nipype.cli.denoise", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("options, status, message", [
    (["--noise-floor", "ncchi"], 2, "--noise-floor ncchi needs --coils N"),
    (["--coils", "4"], 2, "--coils describes a non-central chi floor and needs --noise-floor ncchi"),
    (["--noise-floor", "rician", "--coils", "2"], 2, "needs --noise-floor ncchi (not rician)"),
])
def test_the_command_refuses_bad_combinations_before_reading(tmp_path, options, status, message):
    result = run_cli(tmp_path / "absent.nii", tmp_path / "out.nii", *options)
    assert result.returncode == status
    assert result.stderr.strip().endswith("(see mppca-denoise --help)") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_command_denoises_with_a_floor_and_refuses_negative_data(tmp_path, rician_phantom):
    noisy = rician_phantom[0][:16, :16, :12]
    nib.save(nib.Nifti1Image(noisy, np.eye(4)), tmp_path / "mag.nii")
    nib.save(nib.Nifti1Image(noisy - 500, np.eye(4)), tmp_path / "signed.nii")
    done = run_cli(tmp_path / "mag.nii", tmp_path / "out.nii", "--noise-floor", "ncchi", "--coils", "1",
                   "--noise-in", "200", "--device", "cpu", "--quiet")
    assert done.returncode == 0, done.stderr
    expected = denoise(noisy, noise_floor="ncchi", noise=200.0, device="cpu").denoised
    np.testing.assert_allclose(nib.load(tmp_path / "out.nii").get_fdata(), expected, rtol=1e-5, atol=1e-3)
    failed = run_cli(tmp_path / "signed.nii", tmp_path / "out2.nii", "--noise-floor", "rician", "--device", "cpu")
    assert failed.returncode == 1 and "negative values" in failed.stderr
    assert not (tmp_path / "out2.nii").exists()


def test_the_interface_passes_the_floor_and_records_it(tmp_path, rician_phantom):
    import json

    from mppca_nipype.interfaces import MPPCADenoise

    noisy = rician_phantom[0][:16, :16, :12]
    nib.save(nib.Nifti1Image(noisy, np.eye(4)), tmp_path / "mag.nii")
    node = MPPCADenoise(in_file=str(tmp_path / "mag.nii"), noise_floor="ncchi", coils=1, noise_in=200.0,
                        use_gpu=False)
    node.base_dir = str(tmp_path)
    outputs = node.run(cwd=str(tmp_path)).outputs
    expected = denoise(noisy, noise_floor="ncchi", noise=200.0, device="cpu").denoised
    np.testing.assert_allclose(nib.load(outputs.out_file).get_fdata(), expected, rtol=1e-5, atol=1e-3)
    provenance = json.loads(open(outputs.provenance_file).read())
    assert provenance["Parameters"]["noise_floor"] == "ncchi" and provenance["Parameters"]["coils"] == 1
    assert provenance["EngineInfo"]["noise_floor"] == "ncchi" and provenance["EngineInfo"]["noise"] == "given"
