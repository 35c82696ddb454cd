"""The extra maps ``denoise(maps=...)`` returns: each patch's Marchenko-Pastur upper edge aggregated to voxels
(``lambda_plus``) against a float64 loop over the patches, and the variance each voxel lost
(``variance_removed``) against its definition."""

from __future__ import annotations

import math
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from mppca_nipype.engine import MPPCAInputError, check_data, denoise, plan_patches, resolve_options
from mppca_nipype.engine.cpu import denoise_cpu
from mppca_nipype.phantoms import low_rank_phantom
from reference import (mp_threshold, given_noise_rank, patch_matrix, patch_spectrum, reference_extent,
                       reference_patches, window_voxels)

pytestmark = [pytest.mark.filterwarnings("ignore:patches of"), pytest.mark.filterwarnings("ignore:1 voxels hold NaN")]


def lambda_plus_reference(data, mask, *, extent, stride, aggregation, demean, estimator, noise=None):
    """(X, Y, Z) float64: each patch's lambda_+ = sigma^2 (1 + sqrt(gamma))^2 at its P_hat, one patch at a time,
    aggregated as the noise map is (its centre's own patch, or the mean weighted by 1 / (1 + P + demeaned) or
    by 1), 0 outside the mask and at non-finite voxels. gamma = (r - P) / q (exp1), (r - P) / (q - P) (exp2),
    or r / q (med, olesen2023, and a given noise level: one number)."""
    shape3, n_volumes = data.shape[:3], data.shape[3]
    finite = np.isfinite(data).all(axis=3)
    extent = reference_extent(extent, shape3, n_volumes)
    total, weight = np.zeros(shape3), np.zeros(shape3)
    for corner, centre in reference_patches(shape3, extent, stride, mask, finite):
        X, kept = patch_matrix(data, window_voxels(corner, extent), finite)
        n, T = X.shape
        if demean == "voxel":
            X, T = X - X.mean(axis=1, keepdims=True), T - 1
        elif demean == "volume":
            X, n = X - X.mean(axis=0, keepdims=True), n - 1
        eigenvalues = patch_spectrum(X)[0]
        r, q = min(n, T), max(n, T)
        if noise is None:
            P, sigma2 = mp_threshold(eigenvalues, n, T, estimator)
            if estimator in ("med", "olesen2023"):  # their test: the whole patch's upper edge
                gamma = r / q
            else:
                gamma = (r - P) / q if estimator == "exp1" else ((r - P) / (q - P) if q > P else 0.0)
        else:
            sigma2 = float(noise) ** 2
            P, gamma = given_noise_rank(eigenvalues, n, T, sigma2), r / q
        edge = sigma2 * (1.0 + math.sqrt(gamma)) ** 2
        if aggregation == "center":
            total[centre], weight[centre] = edge, 1.0
            continue
        w = 1.0 / (1 + P + (demean != "none")) if aggregation == "weighted" else 1.0
        for voxel in kept:
            total[voxel] += w * edge
            weight[voxel] += w
    served = mask & finite & (weight > 0)
    return np.where(served, total / np.where(served, weight, 1.0), 0.0)


def awkward_phantom(shape, n_volumes, seed):
    """A low-rank phantom with one voxel of NaN and a mask that leaves out a corner."""
    noisy, _ = low_rank_phantom(shape, n_volumes=n_volumes, rank=3, sigma=5.0, seed=seed)
    noisy = noisy.astype(np.float32)
    noisy[1, 2, 3, 4] = np.nan
    mask = np.ones(shape, dtype=bool)
    mask[:2, :2, :] = False
    return noisy, mask


@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("uniform", 3), ("center", 1)])
@pytest.mark.parametrize("demean, estimator", [("none", "exp1"), ("voxel", "exp2"), ("volume", "exp2"),
                                               ("volume", "med"), ("voxel", "olesen2023")])
def test_lambda_plus_is_each_patchs_edge_aggregated_as_sigma(monkeypatch, aggregation, stride, demean, estimator):
    noisy, mask = awkward_phantom((7, 6, 5), 13, seed=stride)
    options = dict(extent=(3, 5, 3), stride=stride, aggregation=aggregation, demean=demean, estimator=estimator)
    result = denoise(noisy, mask, device="cpu", nprocs=1, maps="lambda_plus", **options)
    expected = lambda_plus_reference(noisy, mask, **options)
    assert result.lambda_plus.dtype == np.float32 and result.lambda_plus.shape == noisy.shape[:3]
    assert np.count_nonzero(expected) > 0.8 * mask.sum()
    # lambda_+ is the noise variance times a factor: in the float32 first pass (demeaning) it carries the
    # noise level's float32 precision, twice sigma's relative error (test_engine_cpu: sigma within 1e-3);
    # the same windows in float64 within 1e-5
    if result.info["gram_precision"] == "float32":
        np.testing.assert_allclose(result.lambda_plus, expected, rtol=2e-3, atol=1e-6 * expected.max())
        from mppca_nipype.engine import cpu

        monkeypatch.setattr(cpu, "first_pass_dtype", lambda options: np.float64)
        exact = denoise(noisy, mask, device="cpu", nprocs=1, maps="lambda_plus", **options)
        assert exact.info["gram_precision"] == "float64"
        np.testing.assert_allclose(exact.lambda_plus, expected, rtol=1e-5, atol=1e-6 * expected.max())
    else:
        np.testing.assert_allclose(result.lambda_plus, expected, rtol=1e-5, atol=1e-6 * expected.max())
    # the edge lies above the noise variance, by (1 + sqrt(gamma))^2 < 4
    inside = expected > 0
    assert np.all(result.lambda_plus[inside] > result.sigma[inside] ** 2 * 0.99)


@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("center", 1)])
def test_lambda_plus_of_a_given_noise_level_takes_gamma_r_over_q(aggregation, stride):
    noisy, mask = awkward_phantom((6, 7, 5), 11, seed=5)
    options = dict(extent=3, stride=stride, aggregation=aggregation, demean="volume", estimator="exp2")
    result = denoise(noisy, mask, noise=4.0, device="cpu", nprocs=1, maps=["lambda_plus"], **options)
    expected = lambda_plus_reference(noisy, mask, noise=4.0, **options)
    np.testing.assert_allclose(result.lambda_plus, expected, rtol=1e-6, atol=1e-9)


def test_lambda_plus_is_the_same_for_any_number_of_processes():
    noisy, mask = awkward_phantom((9, 6, 5), 13, seed=2)
    one, two = (denoise(noisy, mask, extent=3, stride=2, device="cpu", nprocs=nprocs, maps="lambda_plus")
                for nprocs in (1, 2))
    np.testing.assert_array_equal(one.lambda_plus, two.lambda_plus)


@pytest.mark.parametrize("aggregation, stride", [("weighted", 3), ("center", 1)])
def test_variance_removed_is_the_mean_square_of_input_minus_denoised(aggregation, stride):
    noisy, mask = awkward_phantom((7, 5, 6), 12, seed=3)
    result = denoise(noisy, mask, extent=3, stride=stride, aggregation=aggregation, device="cpu", nprocs=1,
                     maps="variance_removed")
    finite = np.isfinite(noisy).all(axis=3)
    residual = noisy.astype(np.float64) - result.denoised.astype(np.float64)
    expected = np.where(mask & finite, np.mean(np.where(finite[..., None], residual, 0) ** 2, axis=3), 0)
    np.testing.assert_allclose(result.variance_removed, expected, rtol=1e-6, atol=1e-9)
    assert result.variance_removed[1, 2, 3] == 0 and not result.variance_removed[~mask].any()
    # noise of sigma 5 on a rank-3 signal: about sigma^2 removed, a little less (kept components keep some)
    inside = mask & finite
    assert 0.5 * 25 < np.median(result.variance_removed[inside]) < 25


def test_variance_removed_of_a_volume_major_series_is_the_same():
    noisy, mask = awkward_phantom((6, 5, 5), 10, seed=4)
    c_order = denoise(noisy, mask, extent=3, stride=2, device="cpu", nprocs=1, maps="variance_removed")
    f_order = denoise(np.asfortranarray(noisy), mask, extent=3, stride=2, device="cpu", nprocs=1,
                      maps="variance_removed")
    np.testing.assert_array_equal(c_order.variance_removed, f_order.variance_removed)


def test_maps_not_asked_for_are_none_and_cost_the_backend_nothing():
    noisy, _ = low_rank_phantom((6, 5, 5), n_volumes=10, rank=2, sigma=3.0, seed=6)
    result = denoise(noisy, extent=3, stride=2, device="cpu", nprocs=1)
    assert result.lambda_plus is None and result.variance_removed is None
    only_one = denoise(noisy, extent=3, stride=2, device="cpu", nprocs=1, maps="variance_removed")
    assert only_one.lambda_plus is None and only_one.variance_removed is not None
    data, mask = check_data(noisy, None)
    options = resolve_options(data.shape, extent=3, stride=2, estimator="exp2", aggregation="weighted",
                              demean="volume")
    finite = np.ones(data.shape[:3], dtype=bool)
    sums = denoise_cpu(data, finite, plan_patches(data.shape[:3], options.extent, options.stride, mask, finite),
                       options, nprocs=1)
    assert sums.lambda_plus is None


def test_an_unknown_map_is_refused_in_one_sentence():
    noisy, _ = low_rank_phantom((5, 5, 5), n_volumes=8, rank=2, sigma=3.0, seed=7)
    with pytest.raises(MPPCAInputError, match="maps must be among lambda_plus, variance_removed, not 'lamplus'"):
        denoise(noisy, device="cpu", maps=("lambda_plus", "lamplus"))


def test_with_a_noise_floor_variance_removed_is_given_and_lambda_plus_refused():
    noisy, _ = low_rank_phantom((6, 5, 5), n_volumes=10, rank=2, sigma=3.0, seed=8)
    magnitude = np.abs(noisy)
    with pytest.raises(MPPCAInputError, match="lambda_plus map is not available with a noise floor"):
        denoise(magnitude, noise_floor="rician", device="cpu", maps="lambda_plus")
    result = denoise(magnitude, extent=3, stride=2, noise_floor="rician", device="cpu", nprocs=1,
                     maps="variance_removed")
    expected = np.mean((magnitude.astype(np.float64) - result.denoised) ** 2, axis=3)
    np.testing.assert_allclose(result.variance_removed, expected, rtol=1e-6)


def test_groups_of_volumes_and_echoes_give_both_maps():
    """With each voxel's mean removed per group of volumes, lambda_plus is that of the patches of the group
    contrasts (orthonormal: the noise keeps its variance), and variance_removed is over every volume (of
    every echo)."""
    from mppca_nipype.engine.groups import GroupContrasts

    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=16, rank=3, sigma=5.0, seed=15)
    labels = np.repeat([0, 1], 8)
    both = ("lambda_plus", "variance_removed")
    options = dict(extent=3, stride=2, device="cpu", nprocs=1)
    result = denoise(noisy, demean="groups", groups=labels, maps=both, **options)
    transform = GroupContrasts(labels)
    contrasts = transform.forward(noisy.reshape(-1, 16).astype(np.float64))[0].reshape(7, 6, 5, -1)
    inner = denoise(contrasts.astype(np.float32), demean="none", _removed_means=2, maps="lambda_plus", **options)
    np.testing.assert_allclose(result.lambda_plus, inner.lambda_plus, rtol=1e-6)
    expected = np.mean((noisy.astype(np.float64) - result.denoised) ** 2, axis=3)
    np.testing.assert_allclose(result.variance_removed, expected, rtol=1e-5)

    echoes = np.stack([noisy[..., :8], noisy[..., 8:] * 0.7], axis=3)  # (X, Y, Z, E, T)
    result = denoise(echoes, maps="variance_removed", **options)
    assert result.lambda_plus is None
    expected = np.mean((echoes.astype(np.float64) - result.denoised) ** 2, axis=(3, 4))
    np.testing.assert_allclose(result.variance_removed, expected, rtol=1e-5)


def run_command(*args):
    return subprocess.run([sys.executable, "-m", "mppca_nipype.cli.denoise", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_the_command_writes_the_maps_asked_for(tmp_path):
    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=16, rank=3, sigma=5.0, seed=12)
    source = tmp_path / "in.nii.gz"
    nib.save(nib.Nifti1Image(noisy, np.diag([2.0, 2.0, 2.5, 1.0])), source)
    edge, removed = tmp_path / "lambda_plus.nii.gz", tmp_path / "removed.nii"
    done = run_command(source, tmp_path / "out.nii.gz", "--lambda-plus", edge, "--variance-removed", removed,
                       "--extent", "3", "--device", "cpu", "--nprocs", "1", "--quiet")
    assert done.returncode == 0, done.stderr
    expected = denoise(noisy, extent=3, device="cpu", nprocs=1, maps=("lambda_plus", "variance_removed"))
    for path, values in ((edge, expected.lambda_plus), (removed, expected.variance_removed)):
        image = nib.load(path)
        assert image.shape == noisy.shape[:3] and image.get_data_dtype() == np.float32
        np.testing.assert_array_equal(image.affine, nib.load(source).affine)
        np.testing.assert_allclose(np.asarray(image.dataobj), values, rtol=1e-6)


@pytest.mark.parametrize("options, message", [
    (["--noise-floor", "rician"], "--lambda-plus is not available with --noise-floor"),
    (["--noise-only", "--noise", "NOISE"], "--noise-only writes the noise map alone (--noise SIGMA) and takes no "
                                           "OUT, --lambda-plus"),
])
def test_the_command_refuses_lambda_plus_where_it_has_none_in_one_line(tmp_path, options, message):
    noisy, _ = low_rank_phantom((5, 5, 5), n_volumes=8, rank=2, sigma=3.0, seed=13)
    source = tmp_path / "in.nii"
    nib.save(nib.Nifti1Image(noisy, np.eye(4)), source)
    options = [str(tmp_path / "noise.nii") if option == "NOISE" else option for option in options]
    done = run_command(source, tmp_path / "out.nii", "--lambda-plus", tmp_path / "edge.nii", *options)
    assert done.returncode == 2 and message in done.stderr
    assert len([line for line in done.stderr.splitlines() if line.startswith("mppca-denoise: error")]) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.nii"]


def test_the_command_refuses_the_maps_of_a_complex_series_before_reading(tmp_path):
    noisy, _ = low_rank_phantom((5, 5, 5), n_volumes=8, rank=2, sigma=3.0, seed=16)
    source = tmp_path / "in.nii"
    nib.save(nib.Nifti1Image(noisy.astype(np.complex64) * np.exp(0.3j), np.eye(4)), source)
    done = run_command(source, tmp_path / "out.nii", "--variance-removed", tmp_path / "removed.nii")
    assert done.returncode == 2 and "is a complex series; --lambda-plus and --variance-removed" in done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.nii"]


def test_the_interface_writes_the_maps_its_inputs_ask_for(tmp_path, monkeypatch):
    from mppca_nipype.interfaces import MPPCADenoise

    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=16, rank=3, sigma=5.0, seed=14)
    source = tmp_path / "dwi.nii.gz"
    nib.save(nib.Nifti1Image(noisy, np.eye(4)), source)
    monkeypatch.chdir(tmp_path)
    plain = MPPCADenoise(in_file=str(source), use_gpu=False, extent=3).run().outputs
    assert not any(isinstance(getattr(plain, name), str) for name in ("out_lambda_plus", "out_variance_removed"))
    outputs = MPPCADenoise(in_file=str(source), use_gpu=False, extent=3, lambda_plus=True,
                           variance_removed=True).run().outputs
    expected = denoise(noisy, extent=3, device="cpu", nprocs=1, maps=("lambda_plus", "variance_removed"))
    assert outputs.out_lambda_plus.endswith("dwi_lambdaplus.nii.gz")
    np.testing.assert_allclose(nib.load(outputs.out_lambda_plus).get_fdata(), expected.lambda_plus, rtol=1e-6)
    np.testing.assert_allclose(nib.load(outputs.out_variance_removed).get_fdata(), expected.variance_removed,
                               rtol=1e-6)


def test_the_bids_app_writes_the_maps_asked_for_under_their_desc_names(tmp_path, capsys):
    from bids_helpers import make_dataset, read_json
    from mppca_nipype.bids import BIDSIGNORE
    from mppca_nipype.cli.bids_app import main

    bids_dir = make_dataset(tmp_path / "raw")
    output_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        main([str(bids_dir), str(output_dir), "participant", "--participant-label", "01", "--datatype", "dwi",
              "--lambda-plus", "--variance-removed", "--skip-bids-validation", "--no-reports", "--nprocs", "1",
              "--device", "cpu"])
    assert stopped.value.code == 0, capsys.readouterr().err
    raw = nib.load(bids_dir / "sub-01/ses-1/dwi/sub-01_ses-1_dwi.nii.gz").get_fdata(dtype=np.float32)
    expected = denoise(raw, device="cpu", nprocs=1, maps=("lambda_plus", "variance_removed"))
    folder = output_dir / "sub-01/ses-1/dwi"
    for desc, values in (("lambdaplus", expected.lambda_plus), ("varianceremoved", expected.variance_removed)):
        np.testing.assert_allclose(nib.load(folder / f"sub-01_ses-1_desc-{desc}_dwimap.nii.gz").get_fdata(),
                                   values, rtol=1e-6)
        sidecar = read_json(folder / f"sub-01_ses-1_desc-{desc}_dwimap.json")
        assert sidecar["Sources"] == ["bids:raw:sub-01/ses-1/dwi/sub-01_ses-1_dwi.nii.gz"]
        assert f"*_desc-{desc}_*" in BIDSIGNORE
        assert f"*_desc-{desc}_*" in (output_dir / ".bidsignore").read_text().splitlines()


def test_the_bids_app_writes_each_echo_the_maps_of_its_run(tmp_path, capsys):
    from bids_helpers import SHAPE, make_dataset
    from mppca_nipype.cli.bids_app import main
    from mppca_nipype.demo import write_series
    from test_groups import echo_phantom

    root = make_dataset(tmp_path / "bids", subjects=("01",))
    func = root / "sub-01/ses-1/func"
    noisy, _ = echo_phantom(shape=SHAPE, n_volumes=14)
    for echo in (1, 2):
        write_series(func / f"sub-01_ses-1_task-me_echo-{echo}_bold.nii.gz", noisy[:, :, :, echo - 1],
                     repetition_time=2.0)
    with pytest.raises(SystemExit) as stopped:
        main([str(root), str(tmp_path / "out"), "participant", "--datatype", "func", "--variance-removed",
              "--skip-bids-validation", "--no-reports", "--nprocs", "1", "--device", "cpu", "--bids-filter-file",
              str(_filter_file(tmp_path, {"bold": {"task": "me"}}))])
    assert stopped.value.code == 0, capsys.readouterr().err
    expected = denoise(noisy[:, :, :, :2], device="cpu", nprocs=1, maps="variance_removed")
    for echo in (1, 2):
        name = f"sub-01_ses-1_task-me_echo-{echo}_desc-varianceremoved_boldmap.nii.gz"
        written = tmp_path / "out/sub-01/ses-1/func" / name
        np.testing.assert_allclose(nib.load(written).get_fdata(), expected.variance_removed, rtol=1e-6)


def _filter_file(folder, filters):
    import json

    path = folder / "filters.json"
    path.write_text(json.dumps(filters))
    return path


def test_the_bids_app_refuses_lambda_plus_with_a_noise_floor_before_reading(tmp_path, capsys):
    from mppca_nipype.cli.bids_app import EXIT, main

    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path / "raw"), str(tmp_path / "out"), "participant", "--lambda-plus", "--noise-floor",
              "rician"])
    assert stopped.value.code == EXIT["usage"]
    assert "--lambda-plus is not available with --noise-floor" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bids_names_the_maps_only_when_asked_and_the_outputs_page_shows_them():
    from pathlib import Path

    from mppca_nipype.bids import derivative_names

    source = "sub-01/ses-1/func/sub-01_ses-1_task-rest_run-1_bold.nii.gz"
    plain, asked = derivative_names(source), derivative_names(source, maps=("lambda_plus", "variance_removed"))
    assert set(asked) - set(plain) == {"lambda_plus", "lambda_plus_json", "variance_removed",
                                       "variance_removed_json"}
    assert asked["lambda_plus"] == "sub-01/ses-1/func/sub-01_ses-1_task-rest_run-1_desc-lambdaplus_boldmap.nii.gz"
    text = (Path(__file__).resolve().parents[1] / "docs" / "outputs.md").read_text()
    assert all(name in text for name in asked.values())


@pytest.mark.gpu
@pytest.mark.parametrize("aggregation, stride, demean", [("weighted", 3, "volume"), ("uniform", 2, "voxel"),
                                                         ("center", 1, "none")])
def test_the_gpus_maps_are_the_cpus(aggregation, stride, demean):
    """On a CUDA device: lambda_plus and variance_removed within 1e-4 rms (relative) of the CPU engine's."""
    from mppca_nipype.engine.gpu import usable

    reason = usable()
    if reason is not None:
        pytest.skip(reason)
    noisy, _ = low_rank_phantom((24, 22, 13), n_volumes=30, rank=4, sigma=5.0, seed=11)
    noisy[6, 4, 5, 6] = np.nan
    mask = np.ones(noisy.shape[:3], dtype=bool)
    mask[:4] = False
    options = dict(extent=5, stride=stride, aggregation=aggregation, demean=demean,
                   maps=("lambda_plus", "variance_removed"))
    gpu = denoise(noisy, mask, device="cuda", **options)
    cpu = denoise(noisy, mask, device="cpu", nprocs=2, **options)
    assert gpu.info["backend"] == "gpu"
    for name in ("lambda_plus", "variance_removed"):
        got, want = getattr(gpu, name).astype(np.float64), getattr(cpu, name).astype(np.float64)
        assert np.count_nonzero(want) > 0.9 * np.count_nonzero(mask)
        assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)) <= 1e-4, name
    assert gpu.lambda_plus[~mask].max() == 0 and gpu.variance_removed[6, 4, 5] == 0
