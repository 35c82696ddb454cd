"""Patch geometry (engine/patches.py): the extent rule, where windows sit, which run, whom they serve."""

import itertools
import warnings

import numpy as np
import pytest

from mppca_nipype.engine.errors import MPPCAWarning
from mppca_nipype.engine.patches import (
    auto_extent, centre_window, plan_patches, resolve_extent, wide_extent, window_positions)
from reference import centred_corner, grid_corners, window_voxels


def test_auto_extent_is_the_smallest_odd_cube_holding_the_volumes():
    for n_volumes in range(1, 1500):
        e = auto_extent(n_volumes)
        assert e % 2 == 1 and e**3 >= n_volumes
        assert e == 1 or (e - 2) ** 3 < n_volumes


@pytest.mark.parametrize("n_volumes, want", [(1, 1), (27, 3), (28, 5), (30, 5), (65, 5), (125, 5), (126, 7),
                                             (343, 7), (1200, 11)])
def test_auto_extent_known_values(n_volumes, want):
    assert auto_extent(n_volumes) == want


@pytest.mark.parametrize("n_volumes, want", [(3, 7), (48, 7), (96, 7), (343, 7), (344, 9), (1000, 11)])
def test_wide_extent_is_the_auto_rule_but_at_least_seven(n_volumes, want):
    assert wide_extent(n_volumes) == want == max(7, auto_extent(n_volumes))
    assert resolve_extent("wide", (64, 64, 40), n_volumes) == (want,) * 3


def test_auto_extent_fits_the_image_with_odd_sizes():
    # T = 100 -> 5; an axis of 4 takes 3 (the largest odd below it), of 3 takes 3, of 1 takes 1
    assert resolve_extent("auto", (4, 10, 3), 100) == (3, 5, 3)
    assert resolve_extent("auto", (64, 64, 1), 48) == (5, 5, 1)
    assert resolve_extent("auto", (6, 10, 10), 102) == (5, 5, 5)


def test_auto_extent_that_fits_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", MPPCAWarning)
        assert resolve_extent("auto", (4, 4, 4), 100) == (3, 3, 3)
        assert resolve_extent((3, 5, 1), (7, 5, 6), 20) == (3, 5, 1)


def test_explicit_extent_is_capped_with_a_warning():
    with pytest.warns(MPPCAWarning, match="exceeds the image"):
        assert resolve_extent(9, (7, 5, 6), 20) == (7, 5, 5)


@pytest.mark.parametrize("extent", [4, 0, -3, (3, 4, 3), (3, 3, 0), (3, -1, 3), 2.5, (3, 3), (3, 3, 3, 3),
                                    "big"])
def test_even_zero_negative_or_malformed_extents_are_rejected(extent):
    with pytest.raises(ValueError):
        resolve_extent(extent, (9, 9, 9), 20)


@pytest.mark.parametrize("size, extent, stride, want", [
    (10, 3, 1, list(range(8))),
    (10, 3, 3, [0, 3, 6, 7]),  # 7 = the flush window against the far edge
    (9, 3, 3, [0, 3, 6]),  # the grid already ends flush
    (7, 5, 2, [0, 2]),
    (5, 5, 4, [0]),
    (11, 5, 4, [0, 4, 6]),
])
def test_window_positions(size, extent, stride, want):
    assert window_positions(size, extent, stride).tolist() == want


# extents fit the image (they are capped first); stride <= extent (a grid of step stride > extent leaves
# gaps: see test_engine_cpu's xfail on it)
@pytest.mark.parametrize("size, extent, stride", [
    (size, extent, stride) for size, extent, stride in itertools.product(range(1, 14), [1, 3, 5, 7], [1, 2, 3, 4])
    if extent <= size and stride <= extent])
def test_windows_cover_every_voxel_and_stay_inside(size, extent, stride):
    corners = window_positions(size, extent, stride)
    assert corners.tolist() == (list(range(size - extent + 1)) if stride == 1
                                else grid_corners(size, extent, stride))
    assert corners.min() == 0 and corners.max() == size - extent
    covered = np.zeros(size, bool)
    for c in corners:
        covered[c:c + extent] = True
    assert covered.all()


@pytest.mark.parametrize("size, extent", [(1, 1), (5, 5), (7, 3), (10, 5), (12, 7)])
def test_stride_one_windows_are_centred_and_shifted_inside_at_edges(size, extent):
    own = centre_window(size, extent)
    for voxel in range(size):
        assert own[voxel] == centred_corner(voxel, size, extent)
        assert own[voxel] <= voxel < own[voxel] + extent
        if extent // 2 <= voxel < size - extent // 2:
            assert own[voxel] == voxel - extent // 2  # centre of its own window


def random_mask(shape, fraction, seed):
    return np.random.default_rng(seed).random(shape) < fraction


@pytest.mark.parametrize("shape, extent", [((7, 5, 6), (3, 3, 3)), ((6, 9, 4), (3, 5, 1)), ((5, 5, 5), (5, 5, 5))])
def test_stride_one_plan_serves_each_wanted_voxel_from_its_own_window(shape, extent):
    mask = random_mask(shape, 0.6, 1)
    finite = ~random_mask(shape, 0.1, 2)
    plan = plan_patches(shape, extent, 1, mask, finite)
    wanted = mask & finite
    _, ny, nz = shape

    centres = np.unravel_index(plan.centre_voxel, shape)
    assert sorted(plan.centre_voxel.tolist()) == np.flatnonzero(wanted).tolist()
    # multiplicity: how many centres chose each window; they add up to the number of centres
    assert plan.multiplicity.sum() == wanted.sum()
    assert np.array_equal(np.bincount(plan.centre_window, minlength=plan.n_windows), plan.multiplicity)
    assert np.all(plan.multiplicity >= 1)
    # each centre's window is the reference's centred-and-shifted one, and it sits at centre_position in it
    for voxel, window, position in zip(zip(*centres), plan.centre_window, plan.centre_position):
        corner = tuple(centred_corner(v, s, e) for v, s, e in zip(voxel, shape, extent))
        assert tuple(plan.window_corner[window]) == corner
        flat = plan.window_base([window])[0] + plan.voxel_offsets[position]
        assert flat == np.ravel_multi_index(voxel, shape)
    # offsets list the window's voxels, x slowest
    want = [np.ravel_multi_index(v, shape) for v in window_voxels((0, 0, 0), extent)]
    assert plan.voxel_offsets.tolist() == want
    # windows are distinct and sorted by corner (x, then y, then z)
    corners = [tuple(c) for c in plan.window_corner]
    assert corners == sorted(set(corners))


@pytest.mark.parametrize("everything_wanted", [False, True])
@pytest.mark.parametrize("stride", [2, 3])
@pytest.mark.parametrize("shape, extent", [((7, 5, 6), (3, 3, 3)), ((9, 6, 4), (3, 5, 1)), ((8, 8, 3), (5, 5, 3))])
def test_strided_plan_runs_exactly_the_windows_holding_a_wanted_voxel(shape, extent, stride, everything_wanted):
    mask = np.ones(shape, bool) if everything_wanted else random_mask(shape, 0.15, 3)
    finite = np.ones(shape, bool) if everything_wanted else ~random_mask(shape, 0.2, 4)
    plan = plan_patches(shape, extent, stride, mask, finite)
    wanted = mask & finite
    grid = itertools.product(*(grid_corners(s, e, stride) for s, e in zip(shape, extent)))
    want = [c for c in grid if any(wanted[v] for v in window_voxels(c, extent))]
    assert [tuple(c) for c in plan.window_corner] == want
    assert plan.multiplicity.tolist() == [1] * len(want)
    assert plan.centre_voxel is None
    if stride > min(extent):
        return  # gaps between windows: see test_engine_cpu's stride xfail
    # every wanted voxel is covered by some running window
    covered = np.zeros(shape, bool)
    for c in plan.window_corner:
        covered[tuple(slice(a, a + e) for a, e in zip(c, extent))] = True
    assert covered[wanted].all()


def test_empty_mask_runs_no_window():
    shape = (5, 5, 5)
    for stride in (1, 2):
        plan = plan_patches(shape, (3, 3, 3), stride, np.zeros(shape, bool), np.ones(shape, bool))
        assert plan.n_windows == 0
