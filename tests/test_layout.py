"""A series in either memory order: the blocked copies between the orders, and ``denoise`` taking a
volume-major (Fortran-order) series as nibabel reads it, without a transpose, into the same values as its
C-order copy, returned in its own order."""

from __future__ import annotations

import numpy as np
import pytest

from mppca_nipype.engine import denoise, layout
from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks and thread shares small enough that these shapes cross their edges."""
    monkeypatch.setattr(layout, "BLOCK_VOLUMES", 7)
    monkeypatch.setattr(layout, "COPY_MIN_VALUES", 1000)


def series(shape, order, seed=0):
    return np.asarray(np.random.default_rng(seed).standard_normal(shape), np.float32, order=order)


@pytest.mark.parametrize("shape", [(9, 7, 5, 23), (1, 3, 2, 7), (4, 1, 1, 3)])
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("threads", [1, 3, None])
def test_rows_of_planes_copies_any_planes_in_either_order(shape, order, threads):
    data = series(shape, order)
    rows = np.ascontiguousarray(data).reshape(-1, shape[3])
    plane = shape[1] * shape[2]
    for planes in (slice(None), slice(1, shape[0]), slice(0, 1)):
        first, stop, _ = planes.indices(shape[0])
        out = np.full(((stop - first) * plane, shape[3]), np.nan, np.float32)
        layout.rows_of_planes(data, planes, out, threads=threads)
        np.testing.assert_array_equal(out, rows[first * plane:stop * plane])


@pytest.mark.parametrize("order", ["C", "F"])
def test_rows_of_planes_in_parts_of_z_planes_fill_the_rows(order):
    data = series((6, 5, 7, 11), order)
    out = np.full((4 * 35, 11), np.nan, np.float32)
    for zs in (slice(0, 2), slice(2, 2), slice(2, 7)):
        layout.rows_of_planes(data, slice(2, 6), out, z_planes=zs)
    np.testing.assert_array_equal(out, np.ascontiguousarray(data[2:6]).reshape(-1, 11))


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("threads", [1, 4])
def test_planes_of_rows_writes_and_divides_into_either_order(order, threads):
    data = series((8, 6, 5, 19), "C", seed=1)
    rows = data.reshape(-1, 19)
    divisor = np.random.default_rng(2).uniform(0.5, 2.0, 8 * 6 * 5)
    out = np.zeros(data.shape, np.float32, order=order)
    layout.planes_of_rows(rows, out, divisor=divisor, threads=threads)
    expected = np.empty_like(rows)
    np.divide(rows, divisor[:, None], out=expected, casting="unsafe")  # in float64, rounded once
    np.testing.assert_array_equal(out, expected.reshape(data.shape))
    assert out.flags.f_contiguous == (order == "F")
    part = np.zeros(data.shape, np.float32, order=order)
    layout.planes_of_rows(rows[:3 * 30], part, slice(5, 8), threads=threads)
    np.testing.assert_array_equal(part[5:], data[:3])
    assert not part[:5].any()


def test_voxel_rows_gather_a_volume_major_series_like_its_rows():
    data = series((7, 6, 5, 9), "F")
    rows = np.ascontiguousarray(data).reshape(-1, 9)
    voxels = np.random.default_rng(3).integers(0, 7 * 6 * 5, (4, 13))
    np.testing.assert_array_equal(layout.voxel_rows(data)[voxels], rows[voxels])
    assert layout.voxel_rows(rows.reshape(data.shape)).base is not None  # a view of C-order data


def test_as_float32_keeps_the_order_and_copies_only_what_it_must():
    f32 = series((3, 4, 5, 6), "F")
    assert layout.as_float32(f32) is f32
    f64 = np.asfortranarray(f32, dtype=np.float64)
    assert layout.as_float32(f64).flags.f_contiguous
    strided = np.ascontiguousarray(f32)[:, ::2]
    assert layout.as_float32(strided).flags.c_contiguous


@pytest.mark.parametrize("nprocs", [1, 2])
@pytest.mark.parametrize("options", [
    dict(),
    dict(extent="auto", stride=1, aggregation="center", demean="none"),
    dict(extent=5, stride=2, aggregation="uniform", demean="voxel"),
])
def test_the_cpu_engine_gives_the_same_values_for_either_order(nprocs, options):
    noisy, *_ = dwi_phantom((17, 14, 9), n_volumes=21, sigma=20.0, seed=5)
    mask = np.zeros(noisy.shape[:3], bool)
    mask[2:15, 1:13, 1:8] = True
    noisy[4, 5, 3, 7] = np.nan
    volume_major = np.asfortranarray(noisy)
    before = volume_major.copy(order="K")
    with pytest.warns(UserWarning):
        c_order = denoise(noisy, mask, device="cpu", nprocs=nprocs, **options)
    with pytest.warns(UserWarning):
        f_order = denoise(volume_major, mask, device="cpu", nprocs=nprocs, **options)
    assert f_order.denoised.flags.f_contiguous and c_order.denoised.flags.c_contiguous
    np.testing.assert_array_equal(f_order.denoised, c_order.denoised)  # same sums, same order of addition
    np.testing.assert_array_equal(f_order.sigma, c_order.sigma)
    np.testing.assert_array_equal(f_order.rank, c_order.rank)
    assert np.isnan(f_order.denoised[4, 5, 3]).any()  # the caller's NaN voxel kept
    np.testing.assert_array_equal(volume_major, before)  # the input untouched


def test_a_volume_major_integer_series_is_denoised_like_its_float_copy():
    noisy, _ = low_rank_phantom((12, 11, 10), n_volumes=16, rank=3, sigma=5.0, baseline=500.0, seed=4)
    integers = np.asfortranarray(np.rint(noisy).astype(np.int16))
    a = denoise(integers, device="cpu", nprocs=1)
    b = denoise(np.asfortranarray(integers, dtype=np.float32), device="cpu", nprocs=1)
    np.testing.assert_array_equal(a.denoised, b.denoised)
    assert a.denoised.flags.f_contiguous
