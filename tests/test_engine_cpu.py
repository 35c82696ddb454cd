"""``mppca_nipype.denoise`` on the CPU against tests/reference.py, on tiny series of awkward shapes.

Tolerances. Both sides read the same float32 input; the reference computes and returns float64. In float64
(no demeaning, the filters, a given noise level) the engine's difference from it is the float32 rounding of
the output (about 3e-8 relative rms, at most 6e-8 relative per value) plus float64 round-off: we allow 1e-6,
still 20 times that floor, while one wrong rank decision, weight, window or voxel moves the result by 1e-3
or more. With demeaning and the hard threshold the engine's first pass is float32 (``cpu.first_pass_dtype``;
windows it cannot settle redone in float64): the denoised series stays within 1e-6 (at most 3.4e-7 on these
cases), the noise level within 1e-3 (float32's rounding of the largest eigenvalue against the noise's: at
most 3.8e-5 in a series of one scale, 5.7e-4 where windows straddle a background of zeros, whose largest
eigenvalue is the edge's; a wrong rank moves it by several per cent). The rank map is an integer per patch
(center) or a weighted mean of them (float32 output): exact, or 1e-6 relative, in either precision: the
ranks are float64's.
"""

import itertools
import threading
import warnings

import numpy as np
import pytest

from mppca_nipype import MPPCAInputError, MPPCAWarning, denoise
from mppca_nipype.engine import MIN_VOLUMES
from reference import denoise_reference

ALL_COMBINATIONS = [
    (aggregation, demean, estimator, stride)
    for aggregation, demean, estimator, stride in itertools.product(
        ["center", "weighted", "uniform", "gaussian"], ["none", "voxel", "volume"],
        ["exp1", "exp2", "med", "olesen2023"],
        [1, 2, 3])
    if aggregation != "center" or stride == 1
]
SOME_COMBINATIONS = [
    ("center", "none", "exp2", 1), ("center", "voxel", "exp1", 1), ("weighted", "voxel", "exp2", 1),
    ("weighted", "voxel", "exp2", 2), ("weighted", "none", "exp1", 3), ("uniform", "voxel", "exp1", 1),
    ("uniform", "none", "exp2", 2), ("weighted", "volume", "exp2", 2), ("center", "volume", "exp1", 1),
    ("center", "none", "med", 1), ("weighted", "volume", "med", 2), ("uniform", "voxel", "olesen2023", 1),
    ("weighted", "none", "olesen2023", 3), ("gaussian", "volume", "exp2", 2), ("gaussian", "voxel", "med", 1),
]

# name: (shape, volumes, extent, fraction of voxels in the mask or None); strides stay <= every extent
CASES = {
    "time-side": ((7, 5, 6), 16, 3, None),  # n = 27 > T = 16: T x T Gram
    "voxel-side": ((5, 4, 6), 32, 3, None),  # n = 27 < T = 32: n x n Gram
    "square": ((5, 5, 5), 27, 3, None),  # n = T (T - 1 < n after demeaning)
    "anisotropic": ((6, 7, 5), 16, (5, 3, 3), None),
    "larger-than-image": ((4, 5, 3), 20, 7, None),  # capped to (3, 5, 3)
    "auto": ((6, 5, 7), 30, "auto", None),  # 5, capped to (5, 5, 5)
    "mask": ((7, 6, 5), 16, 3, 0.4),
}


def rms_relative(a, b):
    return float(np.sqrt(np.mean((np.asarray(a, float) - b) ** 2)) / np.sqrt(np.mean(np.asarray(b, float) ** 2)))


def run_engine(data, mask=None, **options):
    """denoise on the CPU in this process; its MPPCAWarnings (tiny patches) are tested on their own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        return denoise(data, mask, device="cpu", nprocs=1, **options)


def assert_matches_reference(data, mask=None, **options):
    result = run_engine(data, mask, **options)
    denoised, sigma, rank = denoise_reference(data, mask, **options)
    assert result.denoised.dtype == np.float32 and result.denoised.shape == data.shape
    finite = np.isfinite(denoised)
    assert np.array_equal(np.isfinite(result.denoised), finite)
    assert rms_relative(result.denoised[finite], denoised[finite]) <= 1e-6
    if result.info["gram_precision"] == "float32":
        np.testing.assert_allclose(result.sigma, sigma, rtol=1e-3, atol=0)
    else:
        np.testing.assert_allclose(result.sigma, sigma, rtol=1e-6, atol=0)
    if options["aggregation"] == "center":
        assert np.array_equal(result.rank, rank)
    else:
        np.testing.assert_allclose(result.rank, rank, rtol=1e-6, atol=0)
    return result, (denoised, sigma, rank)


def case_data(name, seed=0):
    shape, n_volumes, extent, fraction = CASES[name]
    rng = np.random.default_rng(seed)
    maps = rng.uniform(0.5, 1.5, size=(*shape, 3))
    data = (100 + maps @ (10 * rng.standard_normal((3, n_volumes)))
            + rng.standard_normal((*shape, n_volumes))).astype(np.float32)
    mask = None if fraction is None else rng.random(shape) < fraction
    return data, mask, extent


@pytest.mark.parametrize("aggregation, demean, estimator, stride", ALL_COMBINATIONS)
def test_every_option_combination_matches_the_reference(aggregation, demean, estimator, stride):
    data, mask, extent = case_data("time-side")
    assert_matches_reference(data, mask, extent=extent, stride=stride, aggregation=aggregation, demean=demean,
                             estimator=estimator)


@pytest.mark.parametrize("aggregation, demean, estimator, stride", [
    (aggregation, demean, estimator, stride) for aggregation, demean, estimator, stride in ALL_COMBINATIONS
    if demean != "none" and stride < 3])
def test_the_float32_first_pass_in_float64_matches_the_reference_as_closely(monkeypatch, aggregation, demean,
                                                                           estimator, stride):
    """The windows the float32 pass takes, run in float64 instead: the noise level within 1e-6 too (the
    float32 pass's looser noise level is its precision, not the method's)."""
    from mppca_nipype.engine import cpu

    monkeypatch.setattr(cpu, "first_pass_dtype", lambda options: np.float64)
    data, mask, extent = case_data("time-side")
    result, _ = assert_matches_reference(data, mask, extent=extent, stride=stride, aggregation=aggregation,
                                         demean=demean, estimator=estimator)
    assert result.info["gram_precision"] == "float64"


@pytest.mark.parametrize("demean", ["voxel", "volume"])
def test_the_float32_first_pass_gives_float64_ranks_and_redoes_what_it_cannot_settle(monkeypatch, demean):
    """On a DWI phantom (a signal far above its noise: float32's rounding of the largest eigenvalue is a large
    share of the noise's), every rank equals float64's; some windows are redone, and with an uncertainty too
    large to settle any, all of them are: the result is then float64's ranks and noise, the series within
    float32's rounding of the projection."""
    from mppca_nipype.engine import cpu
    from mppca_nipype.phantoms import dwi_phantom

    data = dwi_phantom(shape=(20, 18, 12), n_volumes=40, sigma=15.0, seed=4)[0]
    options = dict(extent=5, stride=2, demean=demean, device="cpu", nprocs=1)
    first = denoise(data, **options)
    redone = []
    take_exact = cpu.take_exact
    monkeypatch.setattr(cpu, "take_exact", lambda windows, where, exact: (redone.append(int(where.sum())),
                                                                          take_exact(windows, where, exact)))
    again = denoise(data, **options)
    np.testing.assert_array_equal(again.denoised, first.denoised)
    monkeypatch.setattr(cpu, "SETTLE_SLACK", 1e30)
    redone.clear()
    every = denoise(data, **options)
    monkeypatch.setattr(cpu, "first_pass_dtype", lambda options: np.float64)
    exact = denoise(data, **options)
    assert first.info["gram_precision"] == "float32" and exact.info["gram_precision"] == "float64"
    np.testing.assert_array_equal(first.rank, exact.rank)
    np.testing.assert_array_equal(every.rank, exact.rank)
    np.testing.assert_array_equal(every.sigma, exact.sigma)
    assert sum(redone) == exact.info["n_windows"]
    assert rms_relative(every.denoised, exact.denoised) <= 1e-6
    assert rms_relative(first.denoised, exact.denoised) <= 1e-5  # float32's projectors: 1.3e-6 here


@pytest.mark.parametrize("aggregation, demean, estimator, stride", SOME_COMBINATIONS)
@pytest.mark.parametrize("case", [name for name in CASES if name != "time-side"])
def test_awkward_shapes_match_the_reference(case, aggregation, demean, estimator, stride):
    data, mask, extent = case_data(case, seed=1)
    result, (denoised, _, _) = assert_matches_reference(
        data, mask, extent=extent, stride=stride, aggregation=aggregation, demean=demean, estimator=estimator)
    assert rms_relative(result.denoised, data) > 1e-3  # it did denoise


@pytest.mark.parametrize("estimator", ["med", "olesen2023"])
def test_the_edge_estimators_find_a_phantoms_sigma_and_rank(estimator):
    """A rank-5 phantom on a baseline near 1000 with noise of sigma 4 (48 volumes, 5x5x5 patches): the noise
    map within 1% of 4 in the median voxel and 3% at its 5th and 95th percentiles, the rank 5 almost
    everywhere; exp2 on the same series is 2.5% low (its mean of the noise eigenvalues divides by q, not
    q - P)."""
    from mppca_nipype.phantoms import low_rank_phantom

    noisy, _ = low_rank_phantom((24, 24, 16), n_volumes=48, rank=5, sigma=4.0, seed=1)
    options = dict(extent="auto", stride=2, aggregation="weighted", demean="volume")
    result = run_engine(noisy, estimator=estimator, **options)
    assert abs(np.median(result.sigma) / 4.0 - 1) < 0.01
    assert 0.97 * 4.0 < np.percentile(result.sigma, 5) and np.percentile(result.sigma, 95) < 1.03 * 4.0
    assert np.median(result.rank) == 5 and 5.0 <= result.rank.mean() < 5.05
    exp2 = run_engine(noisy, estimator="exp2", **options)
    assert np.median(exp2.sigma) < 0.98 * 4.0


@pytest.mark.parametrize("aggregation", ["center", "weighted", "uniform", "gaussian"])
def test_anisotropic_slab_extent_with_stride_one(aggregation):
    # extent 1 along z; with stride > 1 this leaves gaps (test_stride_larger_than_the_extent_...)
    data, _, _ = case_data("anisotropic", seed=2)
    assert_matches_reference(data, extent=(3, 5, 1), stride=1, aggregation=aggregation, demean="voxel",
                             estimator="exp2")


@pytest.mark.parametrize("aggregation, demean, stride", [("center", "none", 1), ("weighted", "none", 2),
                                                         ("weighted", "volume", 1)])
def test_windows_of_zeros_match_the_reference(aggregation, demean, stride):
    """A background of exact zeros (no mask): windows whose Gram matrix is 0 keep everything, as the
    reference does, and nothing non-finite appears."""
    data, _, _ = case_data("time-side", seed=6)
    data[:4] = 0
    result, _ = assert_matches_reference(data, extent=3, stride=stride, aggregation=aggregation, demean=demean,
                                         estimator="exp2")
    assert np.all(np.isfinite(result.denoised)) and np.all(result.denoised[:2] == 0)  # planes only zeros cover


def test_outputs_are_zero_outside_the_mask():
    data, mask, _ = case_data("mask", seed=3)
    for aggregation, stride in [("center", 1), ("weighted", 2)]:
        result = run_engine(data, mask, extent=3, stride=stride, aggregation=aggregation, demean="voxel",
                            estimator="exp2")
        assert np.all(result.denoised[~mask] == 0)
        assert np.all(result.sigma[~mask] == 0) and np.all(result.rank[~mask] == 0)
        assert np.all(result.sigma[mask] > 0)


def nonfinite_data(case="time-side", seed=4):
    data, _, _ = case_data(case, seed=seed)
    mask = np.ones(data.shape[:3], bool)
    mask[4, 3, :] = False
    data[3, 2, 2, 5] = np.nan  # inside, one volume
    data[0, 0, 0, :] = np.inf  # inside, a corner, every volume
    data[2, 3, 3, 0] = -np.inf  # inside, a neighbour of the first
    data[4, 3, 1, 7] = np.nan  # outside the mask
    return data, mask


# square: n = 27 = T, so a patch that loses voxels has n_eff < T; the engine keeps the T x T Gram there
@pytest.mark.parametrize("case", ["time-side", "voxel-side", "square"])
@pytest.mark.parametrize("aggregation, demean, stride", [("center", "none", 1), ("weighted", "voxel", 1),
                                                         ("uniform", "none", 2), ("weighted", "voxel", 3),
                                                         ("weighted", "volume", 2), ("center", "volume", 1)])
def test_nonfinite_voxels_are_left_out_and_never_spread(case, aggregation, demean, stride):
    data, mask = nonfinite_data(case)
    bad = ~np.isfinite(data).all(axis=3)
    result, _ = assert_matches_reference(data, mask, extent=3, stride=stride, aggregation=aggregation,
                                         demean=demean, estimator="exp2")
    inside = bad & mask
    assert np.array_equal(result.denoised[inside], data[inside], equal_nan=True)  # left as they were
    assert np.all(result.denoised[bad & ~mask] == 0)
    assert np.all(np.isfinite(result.denoised[~bad]))  # nothing spread to the neighbours
    assert np.all(result.sigma[bad] == 0) and np.all(result.rank[bad] == 0)
    assert np.all(np.isfinite(result.sigma)) and np.all(np.isfinite(result.rank))


@pytest.mark.parametrize("given_noise", [False, True], ids=["estimated", "given noise map"])
@pytest.mark.parametrize("aggregation, stride", [("center", 1), ("weighted", 2)])
def test_two_processes_give_bit_identical_results(aggregation, stride, given_noise):
    data, _, _ = case_data("time-side", seed=5)
    data[2, 2, 2, 3] = np.nan
    options = dict(extent=3, stride=stride, aggregation=aggregation, demean="voxel", estimator="exp2",
                   device="cpu")
    if given_noise:
        options["noise"] = np.random.default_rng(26).uniform(0.5, 1.5, data.shape[:3]) * np.nanstd(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        one = denoise(data, nprocs=1, **options)
        two = denoise(data, nprocs=2, **options)
    assert two.info["nprocs"] == 2
    assert np.array_equal(one.denoised, two.denoised, equal_nan=True)
    assert np.array_equal(one.sigma, two.sigma)
    assert np.array_equal(one.rank, two.rank)


@pytest.mark.parametrize("case", ["time-side", "voxel-side", "anisotropic", "mask"])
@pytest.mark.parametrize("aggregation, demean, stride", [("center", "none", 1), ("weighted", "volume", 1),
                                                         ("uniform", "voxel", 2)])
def test_any_number_of_processes_gives_bit_identical_results(case, aggregation, demean, stride):
    """Units add into each x-plane in unit order whichever process runs them, so 1, 2 and 3 processes
    give the same bits, NaN voxels and a mask included."""
    data, mask, extent = case_data(case, seed=7)
    data = np.concatenate([data, data[::-1]], axis=0)  # x-planes enough for 3 units or more
    mask = None if mask is None else np.concatenate([mask, mask], axis=0)
    data[1, 2, 3, 4] = np.nan
    options = dict(extent=extent, stride=stride, aggregation=aggregation, demean=demean, estimator="exp2",
                   device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        runs = {nprocs: denoise(data, mask, nprocs=nprocs, **options) for nprocs in (1, 2, 3)}
    assert [run.info["nprocs"] for run in runs.values()] == [1, 2, 3]
    for nprocs in (2, 3):
        assert np.array_equal(runs[1].denoised, runs[nprocs].denoised, equal_nan=True)
        assert np.array_equal(runs[1].sigma, runs[nprocs].sigma)
        assert np.array_equal(runs[1].rank, runs[nprocs].rank)


def test_workers_started_by_a_forkserver_give_the_same_bits(monkeypatch):
    """Where workers cannot be forked (a CUDA context in the caller, or not Linux) they start from a forkserver
    and receive the shared sums as a file descriptor instead of inheriting them."""
    import multiprocessing

    from mppca_nipype.engine import cpu

    data, _, _ = case_data("time-side", seed=9)
    options = dict(extent=3, stride=1, aggregation="weighted", demean="volume", estimator="exp2", device="cpu")
    one = denoise(data, nprocs=1, **options)
    monkeypatch.setattr(cpu, "_process_context", lambda nprocs: multiprocessing.get_context("forkserver"))
    two = denoise(data, nprocs=2, **options)
    assert two.info["nprocs"] == 2
    assert np.array_equal(one.denoised, two.denoised) and np.array_equal(one.sigma, two.sigma)
    assert np.array_equal(one.rank, two.rank)


def test_a_unit_adds_into_a_plane_only_after_the_units_before_it():
    from mppca_nipype.engine.cpu import PlaneTurns, work_units
    from mppca_nipype.engine.patches import plan_patches

    shape = (7, 5, 6)
    everything = np.ones(shape, bool)
    units = work_units(plan_patches(shape, (3, 3, 3), 1, everything, everything))  # unit k: x-planes k..k+2
    assert [unit.x0 for unit in units] == [0, 1, 2, 3, 4]
    assert [list(unit.turns) for unit in units[:3]] == [[0, 0, 0], [1, 1, 0], [2, 1, 0]]
    turns = PlaneTurns(np.zeros(shape[0], dtype=np.int64), threading.Condition())
    assert turns.ready(units[1], [0, 1, 2]) == [2]  # x-plane 3: no unit before it adds there
    turns.done(units[1], [2])
    waiting = threading.Thread(target=turns.ready, args=(units[1], [0, 1]))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive()  # x-planes 1 and 2 wait for unit 0
    assert turns.ready(units[0], [0, 1, 2]) == [0, 1, 2]
    turns.done(units[0], [0, 1, 2])
    waiting.join(5)
    assert not waiting.is_alive()
    assert list(turns.added) == [1, 1, 1, 1, 0, 0, 0]


def test_a_unit_that_fails_fails_the_run_without_leaving_the_others_waiting(monkeypatch):
    from mppca_nipype.engine import cpu

    fit_windows = cpu.fit_windows

    def failing(volume, finite, plan, options, windows, clock=cpu.NO_CLOCK, dtype=np.float64):
        if plan.window_corner[windows.start, 0] == 1:  # the second unit (x-plane 1), in whichever worker
            raise FloatingPointError("unit 1 failed")
        return fit_windows(volume, finite, plan, options, windows, clock, dtype)

    monkeypatch.setattr(cpu, "fit_windows", failing)  # the forked workers inherit it
    data, _, _ = case_data("time-side", seed=10)
    outcome = []

    def run():
        try:
            denoise(data, extent=3, stride=1, device="cpu", nprocs=2)
        except FloatingPointError as err:
            outcome.append(str(err))

    running = threading.Thread(target=run, daemon=True)
    running.start()
    running.join(60)
    assert not running.is_alive() and outcome == ["unit 1 failed"]


@pytest.mark.parametrize("nprocs", [1, 2])
def test_the_profile_reports_each_phase_and_the_workers_threads_when_asked(monkeypatch, nprocs):
    from mppca_nipype.engine import cpu

    data, _, _ = case_data("time-side", seed=8)
    options = dict(extent=3, stride=1, device="cpu", nprocs=nprocs)
    assert "profile" not in denoise(data, **options).info
    monkeypatch.setattr(cpu, "PROFILE", True)
    result = denoise(data, **options)
    profile = result.info["profile"]
    assert result.info["nprocs"] == nprocs and len(profile["units"]) == profile["n_units"] == 5
    assert 1 <= len(profile["workers"]) <= nprocs  # (a worker may run every unit before another starts)
    phases = {"gather", "demean", "Gram", "eigenvalues", "threshold", "eigenvectors", "reconstruction",
              "accumulation", "turn wait", "deposit"}
    for worker in profile["workers"]:
        assert set(worker["phases"]) >= phases
        assert sum(worker["phases"].values()) <= worker["busy"] <= worker["span"] + 1e-6
        assert worker["threads"] >= 1
        assert {pool["threads"] for pool in worker["threadpools"] if pool["api"] == "blas"} == {1}
    assert sum(worker["units"] for worker in profile["workers"]) == 5
    assert {"setup", "outputs"} <= set(profile["parent"]) and 0 < profile["wall"]


@pytest.mark.parametrize("extent, stride", [(3, 4), ((3, 5, 1), 2)])
def test_stride_larger_than_the_extent_still_denoises_every_voxel(extent, stride):
    # the step on an axis is capped at the extent there: a larger one would leave gaps between windows
    data, _, _ = case_data("time-side", seed=6)
    data = np.concatenate([data, data[:2]], axis=0)  # 9 x 5 x 6: with extent 3, stride 4 would leave x = 3 out
    result, _ = assert_matches_reference(data, extent=extent, stride=stride, aggregation="weighted",
                                         demean="voxel", estimator="exp2")
    assert not np.any(np.all(result.denoised == 0, axis=3))


# -- errors -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [
    dict(aggregation="center", stride=2),
    dict(aggregation="center", stride=3),
    dict(estimator="exp3"),
    dict(aggregation="mean"),
    dict(demean="global"),
    dict(device="tpu"),
    dict(stride=0),
    dict(stride=1.5),
    dict(extent=4),
    dict(extent=(3, 3)),
    dict(extent="big"),
    dict(nprocs=0),
], ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()))
def test_bad_options_are_refused(options):
    data, _, _ = case_data("time-side")
    with pytest.raises(MPPCAInputError):
        denoise(data, **{"device": "cpu", "nprocs": 1, **options})


def test_mask_of_another_shape_is_refused():
    data, _, _ = case_data("time-side")
    with pytest.raises(MPPCAInputError, match="mask"):
        denoise(data, np.ones((7, 5, 5), bool), device="cpu", nprocs=1)


@pytest.mark.parametrize("n_volumes", range(1, MIN_VOLUMES))
def test_too_few_volumes_are_refused(n_volumes):
    data, _, _ = case_data("time-side")
    with pytest.raises(MPPCAInputError, match="volumes"):
        denoise(data[..., :n_volumes], device="cpu", nprocs=1)


def test_not_a_4d_series_is_refused():
    data, _, _ = case_data("time-side")
    with pytest.raises(MPPCAInputError):
        denoise(data[..., 0], device="cpu", nprocs=1)


# -- warnings ---------------------------------------------------------------------------------------------

def mppca_warnings(data, mask=None, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        denoise(data, mask, device="cpu", nprocs=1, **options)
    return [str(w.message) for w in caught if issubclass(w.category, MPPCAWarning)]


def test_patches_of_fewer_than_15_voxels_warn():
    data, _, _ = case_data("time-side")
    assert any("15" in m for m in mppca_warnings(data, extent=(3, 3, 1), stride=1, demean="none"))


@pytest.mark.parametrize("n_volumes, demean", [(14, "none"), (15, "voxel")])
def test_fewer_than_15_usable_volumes_warn(n_volumes, demean):
    data, _, _ = case_data("time-side")
    data = np.concatenate([data, data], axis=3)[..., :n_volumes]
    assert any("15" in m for m in mppca_warnings(data, extent=3, stride=1, demean=demean))


def test_enough_voxels_and_volumes_do_not_warn():
    data, _, _ = case_data("time-side")  # 27 voxels, 16 volumes (15 after demeaning)
    assert mppca_warnings(data, extent=3, stride=2, demean="voxel") == []


def test_nonfinite_voxels_in_the_mask_warn_with_their_number():
    data, mask = nonfinite_data()
    messages = mppca_warnings(data, mask, extent=3, stride=2)
    assert any(m.startswith("3 voxels") and "NaN" in m for m in messages)


@pytest.mark.parametrize("layout, threads", [("C", 1), ("F", 1), ("C", 4)])
def test_finite_voxels_finds_every_non_finite_value_even_where_squares_overflow(monkeypatch, layout, threads):
    """The quick check (the sum of squares, by parts on threads) must never call a series finite that is not,
    and values whose squares overflow float32 (finite, so every voxel is kept) must not be taken for
    non-finite ones."""
    from mppca_nipype import engine
    from mppca_nipype.engine import _finite_voxels

    monkeypatch.setattr(engine, "available_cpus", lambda: threads)
    monkeypatch.setattr(engine, "FINITE_CHECK_BYTES", 64)  # the 1,440-byte series in parts
    rng = np.random.default_rng(5)
    data = np.asarray(rng.standard_normal((5, 4, 3, 6)).astype(np.float32), order=layout)
    assert _finite_voxels(data).all()
    with warnings.catch_warnings():  # the overflow is expected and silent, on the checking threads too
        warnings.simplefilter("error")
        with np.errstate(over="raise"):
            assert _finite_voxels(data * np.float32(1e30)).all()
    for bad in (np.nan, np.inf, -np.inf):
        spoilt = data.copy(order=layout)
        spoilt[1, 2, 0, 3] = bad
        finite = _finite_voxels(spoilt)
        assert not finite[1, 2, 0] and finite.sum() == 5 * 4 * 3 - 1
