"""The noise map alone (``estimate_noise``; ``mppca-noise IN SIGMA`` and its alias ``mppca-denoise --noise-only``).

At the options of a ``denoise`` run, stride included, it must give that run's noise and rank maps bit for bit
(the same windows, batches, thresholds and sums, without eigenvectors or reconstruction); at its own default
stride, a map close to the full run's and to the truth. The commands write the map and nothing else, and a
bad input is one sentence, a non-zero exit and no file.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import nibabel as nib
import numpy as np
import pytest

from mppca_nipype import MPPCAInputError, MPPCAWarning, denoise, estimate_noise
from mppca_nipype.engine import NOISE_STRIDE
from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom
from test_engine_cpu import case_data, nonfinite_data


def both(data, mask=None, nprocs=1, **options):
    """(denoise's result, estimate_noise's) on the CPU, their MPPCAWarnings (tiny patches) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        return (denoise(data, mask, device="cpu", nprocs=nprocs, **options),
                estimate_noise(data, mask, nprocs=nprocs, **options))


# -- the same maps as denoise's at the same options ----------------------------------------------------------

OPTION_SETS = [dict(aggregation="center", demean="none", stride=1, estimator="exp2"),
               dict(aggregation="center", demean="voxel", stride=1, estimator="exp1"),
               dict(aggregation="weighted", demean="volume", stride=2, estimator="exp2"),
               dict(aggregation="weighted", demean="voxel", stride=3, estimator="exp1"),
               dict(aggregation="uniform", demean="none", stride=2, estimator="exp2")]


@pytest.mark.parametrize("case", ["time-side", "voxel-side", "anisotropic", "mask"])
@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: f"{o['aggregation']}-{o['demean']}-{o['stride']}")
def test_maps_are_bit_identical_to_denoise_s_at_the_same_options(case, options):
    data, mask, extent = case_data(case, seed=31)
    full, noise = both(data, mask, extent=extent, **options)
    assert noise.sigma.dtype == np.float32 and noise.sigma.shape == data.shape[:3]
    assert np.array_equal(noise.sigma, full.sigma) and np.array_equal(noise.rank, full.rank)
    assert noise.info["n_windows"] == full.info["n_windows"] and noise.info["stride"] == options["stride"]


@pytest.mark.parametrize("stride", [1, 3])
def test_nonfinite_voxels_are_left_out_as_denoise_leaves_them(stride):
    data, mask = nonfinite_data("time-side")
    aggregation = "center" if stride == 1 else "weighted"
    full, noise = both(data, mask, extent=3, stride=stride, aggregation=aggregation, demean="none")
    assert np.array_equal(noise.sigma, full.sigma) and np.array_equal(noise.rank, full.rank)
    assert noise.info["n_nonfinite_voxels"] == full.info["n_nonfinite_voxels"] > 0


def test_two_processes_give_the_one_process_maps_and_denoise_s():
    data, _ = low_rank_phantom((24, 14, 12), 30, rank=4, sigma=5.0, seed=5)
    one = estimate_noise(data, stride=3, nprocs=1)
    full, two = both(data, nprocs=2, stride=3)
    assert two.info["nprocs"] == 2
    assert np.array_equal(two.sigma, one.sigma) and np.array_equal(two.sigma, full.sigma)


# -- the default grid ------------------------------------------------------------------------------------

def test_the_default_stride_is_coarser_and_its_map_close_to_the_full_run_s_and_the_truth():
    """On the head phantom (T = 48, extent 7: stride 7 puts the patches side by side): 14% of the windows, the
    map within 1% of the full run's in the median voxel of the head and within 3% in 99%, and its median as
    close to the true sigma as the full run's (within half a percent)."""
    noisy, truth, _, _ = dwi_phantom((40, 40, 30), 48, sigma=20.0, seed=2)
    head = truth[..., 0] > 0
    full = denoise(noisy, device="cpu", nprocs=2)
    noise = estimate_noise(noisy, nprocs=2)
    assert noise.info["stride"] == NOISE_STRIDE == 7 and noise.info["extent"] == [7, 7, 7]
    assert noise.info["n_windows"] <= 0.15 * full.info["n_windows"]  # 180 of 1296 (the flush edges count)
    deviation = np.abs(noise.sigma[head] / full.sigma[head] - 1)
    assert np.median(deviation) < 0.01 and np.percentile(deviation, 99) < 0.03
    truth_error = [abs(np.median(result.sigma[head]) / 20.0 - 1) for result in (full, noise)]
    assert truth_error[1] <= truth_error[0] + 0.005 and truth_error[1] < 0.05


def test_every_voxel_of_the_mask_gets_a_value_at_any_stride():
    data, _ = low_rank_phantom((17, 13, 11), 30, rank=3, sigma=2.0, seed=6)
    mask = np.zeros(data.shape[:3], bool)
    mask[2:15:3, 1:12:2, ::5] = True
    for stride in (5, 7, 50):
        noise = estimate_noise(data, mask, extent=5, stride=stride, nprocs=1)
        assert np.all(noise.sigma[mask] > 0) and np.all(noise.sigma[~mask] == 0)
        assert abs(np.median(noise.sigma[mask]) - 2.0) < 0.1


@pytest.mark.parametrize("options, match", [
    (dict(stride=0), "stride"), (dict(aggregation="center", stride=2), "needs stride 1"),
    (dict(estimator="exp3"), "estimator"), (dict(extent=4), "odd"), (dict(nprocs=0), "nprocs"),
])
def test_bad_options_are_refused(options, match):
    data, _, _ = case_data("time-side")
    with pytest.raises(MPPCAInputError, match=match):
        estimate_noise(data, **options)


# -- the commands ------------------------------------------------------------------------------------------

SHAPE, N_VOLUMES = (12, 10, 9), 20


def run_command(module, *args):
    command = [sys.executable, "-m", f"mppca_nipype.cli.{module}", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def series():
    noisy, _ = low_rank_phantom(SHAPE, N_VOLUMES, rank=3, sigma=4.0, seed=7)
    return noisy


@pytest.fixture
def series_path(tmp_path, series):
    affine = np.diag([2.0, 2.0, 2.5, 1.0])
    nib.save(nib.Nifti1Image(series, affine), tmp_path / "bold.nii.gz")
    return tmp_path / "bold.nii.gz"


def test_mppca_noise_writes_the_estimate_noise_map_on_the_input_grid(tmp_path, series_path, series):
    result = run_command("noise", series_path, tmp_path / "sigma.nii.gz", "--rank", tmp_path / "rank.nii",
                         "--nprocs", "1")
    assert result.returncode == 0, result.stderr
    expected = estimate_noise(series, nprocs=1)
    sigma, rank = nib.load(tmp_path / "sigma.nii.gz"), nib.load(tmp_path / "rank.nii")
    assert sigma.shape == SHAPE and sigma.get_data_dtype() == np.float32
    np.testing.assert_array_equal(sigma.affine, nib.load(series_path).affine)
    np.testing.assert_array_equal(np.asarray(sigma.dataobj), expected.sigma)
    np.testing.assert_array_equal(np.asarray(rank.dataobj), expected.rank)
    (line,) = result.stderr.splitlines()
    assert line.startswith("mppca-noise: estimated the noise of 12x10x9x20 in ") and f"stride {NOISE_STRIDE}" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bold.nii.gz", "rank.nii", "sigma.nii.gz"]


def test_mppca_noise_at_denoise_s_options_writes_mppca_denoise_s_noise_map(tmp_path, series_path):
    options = ["--stride", "3", "--nprocs", "1", "--quiet"]
    assert run_command("noise", series_path, tmp_path / "alone.nii", *options).returncode == 0
    assert run_command("denoise", series_path, tmp_path / "out.nii", "--noise", tmp_path / "full.nii",
                       "--device", "cpu", *options).returncode == 0
    assert (np.asarray(nib.load(tmp_path / "alone.nii").dataobj).tobytes()
            == np.asarray(nib.load(tmp_path / "full.nii").dataobj).tobytes())


def test_mppca_noise_takes_the_patch_shape(tmp_path, series_path, series):
    result = run_command("noise", series_path, tmp_path / "sigma.nii", "--shape", "sphere", "--extent", "3",
                         "--nprocs", "1")
    assert result.returncode == 0, result.stderr
    expected = estimate_noise(series, extent=3, shape="sphere", nprocs=1)
    assert expected.info["shape"] == "sphere" and expected.info["extent"] == [5, 5, 5]
    np.testing.assert_array_equal(np.asarray(nib.load(tmp_path / "sigma.nii").dataobj), expected.sigma)


def test_noise_only_is_the_same_command(tmp_path, series_path):
    alias = run_command("denoise", series_path, "--noise-only", "--noise", tmp_path / "a.nii", "--nprocs", "1")
    primary = run_command("noise", series_path, tmp_path / "b.nii", "--nprocs", "1")
    assert alias.returncode == primary.returncode == 0
    assert alias.stderr.startswith("mppca-denoise: estimated the noise of") and f"stride {NOISE_STRIDE}" in alias.stderr
    assert (tmp_path / "a.nii").read_bytes() == (tmp_path / "b.nii").read_bytes()
    assert not (tmp_path / "out.nii").exists()


def _with(*options, output="sigma.nii.gz"):
    return lambda tmp_path: [tmp_path / "bold.nii.gz", tmp_path / output,
                             *(str(o).replace("TMP", str(tmp_path)) for o in options)]


BAD = {
    "output over the input": ("noise", _with(output="bold.nii.gz"), 2, "would overwrite the input"),
    "rank over the map": ("noise", _with("--rank", "TMP/sigma.nii.gz"), 2, "also given as another output"),
    "center with stride 7": ("noise", _with("--aggregation", "center"), 2, "needs stride 1"),
    "even extent": ("noise", _with("--extent", "4"), 2, "--extent"),
    "missing folder": ("noise", _with(output="absent/sigma.nii.gz"), 1, "does not exist"),
    "not NIfTI": ("noise", _with(output="sigma.mif"), 1, ".nii or .nii.gz"),
    "missing input": ("noise", lambda tmp_path: [tmp_path / "absent.nii.gz", tmp_path / "sigma.nii"], 1,
                      "does not exist"),
    "noise-only with OUT": ("denoise", lambda tmp_path: [tmp_path / "bold.nii.gz", tmp_path / "out.nii",
                                                         "--noise-only", "--noise", tmp_path / "s.nii"], 2,
                            "takes no OUT"),
    "noise-only without --noise": ("denoise", lambda tmp_path: [tmp_path / "bold.nii.gz", "--noise-only"], 2,
                                   "needs IN and --noise SIGMA"),
    "noise-only with --noise-in": ("denoise", lambda tmp_path: [tmp_path / "bold.nii.gz", "--noise-only", "--noise",
                                                                tmp_path / "s.nii", "--noise-in", "3"], 2,
                                   "takes no --noise-in"),
    "noise-only on cuda": ("denoise", lambda tmp_path: [tmp_path / "bold.nii.gz", "--noise-only", "--noise",
                                                        tmp_path / "s.nii", "--device", "cuda"], 2,
                           "runs on the CPU"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_input_fails_with_one_sentence_and_writes_nothing(tmp_path, series_path, case):
    module, make_args, status, phrase = case
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_command(module, *make_args(tmp_path), "--nprocs", "1")
    assert result.returncode == status
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"mppca-{module}: error: ") and phrase in line, line
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before
