"""Demeaning by groups of volumes (``demean="groups"``, ``"shells"``) and multi-echo series, on the CPU,
against tests/reference.py (each voxel's mean per group removed in the patch, MP-PCA with T - G volumes).

Tolerances. The engine maps the float32 series onto its group contrasts in float64 and rounds them to float32
before MP-PCA (``groups.GroupContrasts``): a relative error of about 6e-8 per value on the contrasts, which
the projection carries to the output. We allow 1e-5 relative rms on the denoised series and 1e-5 on sigma
(still 100 times that floor), while one wrong rank, weight or degree of freedom moves them by 1e-3 or more.
"""

import numpy as np
import pytest

from mppca_nipype import MPPCAInputError, denoise
from mppca_nipype.engine.groups import GroupContrasts, check_groups, shell_labels
from reference import denoise_reference
from test_engine_cpu import rms_relative, run_engine


def grouped_series(shape, labels, seed=0, rank=3):
    """A low-rank series whose groups of volumes sit on very different baselines (as b-value shells do),
    plus unit noise."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    baseline = rng.uniform(0.3, 1.0, size=shape)[..., None] * (1000.0 / (1 + labels))[None, None, None, :]
    maps = rng.uniform(0.5, 1.5, size=(*shape, rank))
    signal = baseline + maps @ (10 * rng.standard_normal((rank, labels.size)))
    return (signal + rng.standard_normal(signal.shape)).astype(np.float32)


# (shape, labels, extent, stride, aggregation, mask fraction): time side, voxel side, ragged groups, a group
# of one volume (it adds no contrast), labels not in order
CASES = {
    "time-side": ((6, 5, 7), [0] * 3 + [1] * 7 + [2] * 8, 3, 2, "weighted", None),
    "voxel-side": ((5, 4, 6), [5, 1, 1, 5, 9, 9, 1, 5] * 5, 3, 1, "center", None),
    "single-volume-group": ((7, 6, 5), [0] + [1] * 10 + [2] * 9, 3, 3, "uniform", 0.5),
    "anisotropic": ((6, 7, 5), [2, 0, 1] * 7, (5, 3, 3), 2, "weighted", 0.6),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("estimator", ["exp2", "exp1"])
def test_groups_match_the_reference(case, estimator):
    shape, labels, extent, stride, aggregation, fraction = CASES[case]
    data = grouped_series(shape, labels, seed=len(case))
    mask = None if fraction is None else np.random.default_rng(1).random(shape) < fraction
    options = dict(extent=extent, stride=stride, aggregation=aggregation, estimator=estimator)
    result = run_engine(data, mask, demean="groups", groups=labels, **options)
    denoised, sigma, rank = denoise_reference(data, mask, demean="none", groups=labels, **options)
    assert result.denoised.shape == data.shape and result.denoised.dtype == np.float32
    assert rms_relative(result.denoised, denoised) <= 1e-5
    np.testing.assert_allclose(result.sigma, sigma, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.rank, rank, rtol=1e-5, atol=1e-6)
    assert result.info["demean"] == "groups" and result.info["usable_volumes"] == len(labels) - len(set(labels))


def test_group_means_take_the_shell_baselines_out_of_the_rank():
    """Each voxel's baselines per group are one more component after voxel demeaning; not after group
    demeaning, which keeps the signal's 3."""
    shape, labels, extent, stride, aggregation, _ = CASES["time-side"]
    data = grouped_series(shape, labels, rank=3)
    options = dict(extent=extent, stride=stride, aggregation=aggregation)
    grouped = run_engine(data, demean="groups", groups=labels, **options)
    voxel = run_engine(data, demean="voxel", **options)
    assert np.all(grouped.rank == 3)
    assert np.all(voxel.rank >= 4)


@pytest.mark.parametrize("aggregation,stride", [("weighted", 2), ("center", 1), ("uniform", 3)])
def test_one_group_is_voxel_demeaning(aggregation, stride):
    """G = 1: the same degrees of freedom (T - 1), the same weight (1 / (2 + P)), the same numbers up to the
    float32 rounding of the contrasts and, voxel demeaning's first pass being float32 (the contrasts' runs
    without demeaning are float64), float32's rounding of the noise level (1e-4, as in test_engine_cpu)."""
    data = grouped_series((7, 5, 6), [0] * 20, seed=3)
    options = dict(extent=3, stride=stride, aggregation=aggregation)
    grouped = run_engine(data, demean="groups", groups=[7] * 20, **options)
    voxel = run_engine(data, demean="voxel", **options)
    assert rms_relative(grouped.denoised, voxel.denoised) <= 1e-6
    np.testing.assert_allclose(grouped.sigma, voxel.sigma, rtol=1e-4)
    assert np.array_equal(grouped.rank, voxel.rank)


def test_nonfinite_voxels_keep_their_values_and_outside_the_mask_is_zero():
    labels = [0] * 6 + [1] * 10
    data = grouped_series((6, 5, 5), labels, seed=2)
    data[1, 2, 3, 4] = np.nan
    mask = np.ones(data.shape[:3], bool)
    mask[0] = False
    result = run_engine(data, mask, demean="groups", groups=labels, extent=3, stride=2)
    assert np.all(result.denoised[0] == 0)
    np.testing.assert_array_equal(result.denoised[1, 2, 3], data[1, 2, 3])
    elsewhere = np.ones(data.shape[:3], bool)
    elsewhere[1, 2, 3] = False
    assert np.isfinite(result.denoised[elsewhere]).all()


def test_the_helmert_contrasts_are_orthonormal_and_orthogonal_to_the_groups():
    labels = check_groups([3, 1, 1, 3, 3, 2, 1, 2, 2, 2, 4], 11)
    transform = GroupContrasts(labels)
    Q = transform.forward(np.eye(11))[0].T  # row j: contrast j of the 11 unit series
    assert Q.shape == (11 - 4, 11)
    np.testing.assert_allclose(Q @ Q.T, np.eye(7), atol=1e-14)
    indicators = np.stack([labels == g for g in range(4)]).astype(float)
    np.testing.assert_allclose(Q @ indicators.T, 0, atol=1e-14)
    rows = np.random.default_rng(0).normal(size=(5, 11))
    np.testing.assert_allclose(transform.inverse(*transform.forward(rows)), rows, atol=1e-13)


def test_shells_are_clustered_as_mrtrix3_does():
    bvals = [0, 5, 995, 1000, 1005, 2000, 0, 1990, 2010, 1000, 10, 2005, 3000, 2995, 3010, 1002]
    expected = [0, 0, 1, 1, 1, 2, 0, 2, 2, 1, 0, 2, 3, 3, 3, 1]
    np.testing.assert_array_equal(shell_labels(bvals), expected)


def test_a_b_value_left_out_of_every_shell_joins_the_nearest():
    # 1500 has no neighbour within 80: MRtrix3 leaves it unassigned; it joins the 1000 shell (nearest mean)
    bvals = [0, 1000, 1000, 1000, 1500, 2000, 2000, 2000, 3000]
    np.testing.assert_array_equal(shell_labels(bvals), [0, 1, 1, 1, 1, 2, 2, 2, 2])


def test_shells_demeaning_is_groups_demeaning_by_shell():
    bvals = [0, 5, 995, 1000, 1005, 2000, 1990, 2010, 1000, 10, 2005, 995] * 2
    data = grouped_series((5, 6, 5), shell_labels(bvals), seed=5)
    options = dict(extent=3, stride=2)
    shells = run_engine(data, demean="shells", bvals=bvals, **options)
    groups = run_engine(data, demean="groups", groups=shell_labels(bvals), **options)
    np.testing.assert_array_equal(shells.denoised, groups.denoised)
    assert shells.info["demean"] == "shells" and shells.info["group_sizes"] == [6, 10, 8]


def echo_phantom(shape=(10, 10, 8), n_volumes=24, n_echoes=3, sigma=3.0, seed=0, rank=3):
    """Echoes of one low-rank signal: S_e(t) = S0 exp(-TE_e R2*) (1 + sum_k a_k c_k(t)), R2* the same
    everywhere (so the echoes share the signal's pattern, scaled by the decay), with independent noise of
    ``sigma`` in each echo. Returns (noisy (X, Y, Z, E, T) float32, truth)."""
    rng = np.random.default_rng(seed)
    s0 = rng.uniform(600, 1000, size=shape)
    maps = rng.uniform(0.5, 1.5, size=(*shape, rank))
    fluctuation = 1 + maps @ (0.04 * rng.standard_normal((rank, n_volumes)))
    echo_times = np.linspace(15, 45, n_echoes)
    truth = np.stack([(s0 * np.exp(-te * 0.025))[..., None] * fluctuation for te in echo_times], axis=3)
    noisy = truth + sigma * rng.standard_normal(truth.shape)
    return noisy.astype(np.float32), truth


def test_echoes_denoised_jointly_come_closer_to_the_truth_than_each_alone():
    noisy, truth = echo_phantom()
    options = dict(extent=5, stride=2, demean="voxel")
    joint = run_engine(noisy, **options).denoised
    assert joint.shape == noisy.shape
    for e in range(noisy.shape[3]):
        alone = run_engine(noisy[:, :, :, e], **options).denoised
        rmse_joint = np.sqrt(np.mean((joint[:, :, :, e] - truth[:, :, :, e]) ** 2))
        rmse_alone = np.sqrt(np.mean((alone - truth[:, :, :, e]) ** 2))
        assert rmse_joint < 0.9 * rmse_alone, (e, rmse_joint, rmse_alone)


def test_a_list_of_echoes_is_the_5d_series():
    noisy, _ = echo_phantom(shape=(6, 6, 5), n_volumes=10)
    options = dict(extent=3, stride=2)
    stacked = run_engine(noisy, **options)
    listed = run_engine([noisy[:, :, :, e] for e in range(3)], **options)
    np.testing.assert_array_equal(stacked.denoised, listed.denoised)
    assert stacked.info["echoes"] == 3 and stacked.info["n_groups"] == 3


@pytest.mark.parametrize("demean", ["volume", "voxel"])
def test_echoes_match_the_reference_with_the_echoes_as_groups(demean):
    noisy, _ = echo_phantom(shape=(6, 5, 5), n_volumes=7, seed=4)
    labels = np.repeat(np.arange(3), 7)
    options = dict(extent=3, stride=2, aggregation="weighted", estimator="exp2")
    result = run_engine(noisy, demean=demean, **options)
    flat = noisy.reshape(*noisy.shape[:3], -1)
    denoised, sigma, _ = denoise_reference(flat, demean="volume" if demean == "volume" else "none",
                                           groups=labels, **options)
    assert rms_relative(result.denoised.reshape(flat.shape), denoised) <= 1e-5
    np.testing.assert_allclose(result.sigma, sigma, rtol=1e-5)


@pytest.mark.parametrize("groups,message", [
    ([0, 1] * 5, r"one integer per volume \(12\), not 10 values"),
    ([0, 1.5] + [1] * 10, "must be integers, but volume 1 has 1.5"),
    (["a"] * 12, "must be integers, not <U1 values"),
    ([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5], "6 groups of 12 volumes leave 6 after their means are removed") ,
    ([0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9], "10 groups of 12 volumes leave 2"),
])
def test_bad_group_labels_are_refused_in_one_sentence(groups, message):
    data = np.random.default_rng(0).normal(size=(4, 4, 4, 12)).astype(np.float32)
    if message.startswith("6 groups"):  # enough volumes left: no error
        run_engine(data, demean="groups", groups=groups, extent=3)
        return
    with pytest.raises(MPPCAInputError, match=message):
        denoise(data, demean="groups", groups=groups, device="cpu")


def test_groups_without_labels_and_shells_without_b_values_are_refused():
    data = np.zeros((4, 4, 4, 12), np.float32)
    with pytest.raises(MPPCAInputError, match="needs a label per volume"):
        denoise(data, demean="groups", device="cpu")
    with pytest.raises(MPPCAInputError, match="needs the b-values"):
        denoise(data, demean="shells", device="cpu")
    with pytest.raises(MPPCAInputError, match="always has each voxel's mean per echo removed"):
        denoise(np.zeros((4, 4, 4, 2, 6), np.float32), demean="none", device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("aggregation,stride", [("center", 1), ("weighted", 3)])
@pytest.mark.parametrize("series", ["shells", "echoes"])
def test_the_gpu_engine_matches_the_cpu(series, aggregation, stride):
    """The GPU runs ``none`` on the contrasts: denoised within 1e-4 rms (relative); ranks equal on >= 99.5%
    of the voxels with ``center`` (the patches' own ranks), within 1e-2 on average when weighted."""
    from mppca_nipype.engine.gpu import usable
    from mppca_nipype.phantoms import dwi_phantom

    reason = usable()
    if reason is not None:
        pytest.skip(reason)
    if series == "shells":
        noisy, _, bvals, _ = dwi_phantom(shape=(40, 36, 24), n_volumes=40, sigma=20.0, seed=1)
        bvals = bvals + np.where(bvals > 0, np.arange(bvals.size) % 3 * 5.0, 0)  # b = 1000, 1005, 1010
        options = dict(demean="shells", bvals=bvals)
    else:
        noisy, _ = echo_phantom(shape=(40, 36, 24), n_volumes=30, seed=1)
        options = dict(demean="voxel")
    options.update(aggregation=aggregation, stride=stride, extent="auto")
    gpu = denoise(noisy, device="cuda", **options)
    cpu = denoise(noisy, device="cpu", **options)
    assert gpu.info["backend"] == "gpu" and cpu.info["backend"] == "cpu"
    assert rms_relative(gpu.denoised, cpu.denoised) <= 1e-4
    rank_difference = np.abs(gpu.rank - cpu.rank)
    if aggregation == "center":
        assert np.mean(rank_difference < 1e-3) >= 0.995
    else:  # the weighted means of the covering patches' ranks
        assert rank_difference.mean() <= 1e-2


def test_a_volume_major_or_integer_series_gives_the_same_result_in_its_own_order():
    labels = [0] * 5 + [1] * 9
    data = grouped_series((6, 5, 5), labels, seed=6)
    options = dict(demean="groups", groups=labels, extent=3, stride=2)
    voxel_major = run_engine(data, **options).denoised
    volume_major = run_engine(np.asfortranarray(data), **options).denoised
    assert volume_major.flags.f_contiguous and not volume_major.flags.c_contiguous
    np.testing.assert_array_equal(volume_major, voxel_major)
    whole = np.round(data).astype(np.int16)
    np.testing.assert_array_equal(run_engine(whole, **options).denoised,
                                  run_engine(whole.astype(np.float32), **options).denoised)
