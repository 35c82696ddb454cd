"""Spherical patches (``shape="sphere"``): the radius rule, the plan's offsets, and the CPU engine against a
float64 reference written here from docs/options.md ("Patch shape"), sharing no code with the engine.

The reference: for each window of the cuboid layout of the sphere's bounding cube (side 2r + 1), the patch
matrix holds the voxels within distance r of the window's centre; its components are chosen by the
Marchenko-Pastur rule (``reference.mp_threshold``); every voxel of the bounding cube is centred as the
patch was and projected on the kept components, x_hat = (x - mu) V_P V_P^T + mu, and aggregated.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest

from mppca_nipype.engine import MPPCAInputError, denoise, estimate_noise, resolve_options
from mppca_nipype.engine.errors import MPPCAWarning
from mppca_nipype.engine.patches import plan_patches, sphere_radius, sphere_size
from reference import centred_corner, grid_corners, mp_threshold


def brute_force_sphere(radius):
    """The integer offsets within Euclidean distance ``radius`` of the origin, by looking at every one."""
    span = range(-radius, radius + 1)
    return [(i, j, k) for i, j, k in itertools.product(span, span, span) if i * i + j * j + k * k <= radius**2]


def test_sphere_sizes_count_the_voxels_within_the_radius():
    assert [sphere_size(r) for r in range(6)] == [len(brute_force_sphere(r)) for r in range(6)]
    assert [sphere_size(r) for r in range(6)] == [1, 7, 33, 123, 257, 515]


@pytest.mark.parametrize("needed, radius", [(1, 0), (7, 1), (8, 2), (27, 2), (33, 2), (34, 3), (125, 4),
                                            (343, 5), (729, 6), (1331, 7)])
def test_the_radius_is_the_smallest_whose_sphere_holds_the_needed_voxels(needed, radius):
    assert sphere_radius(needed) == radius
    assert sphere_size(radius) >= needed and (radius == 0 or sphere_size(radius - 1) < needed)


@pytest.mark.parametrize("extent, n_volumes, cube", [("wide", 48, 11), ("auto", 48, 9), ("auto", 20, 5),
                                                     (3, 12, 5), ((3, 5, 3), 40, 7)])
def test_a_sphere_holds_at_least_the_voxels_of_the_extents_cuboid(extent, n_volumes, cube):
    """wide at 48 volumes: 7^3 = 343 -> r = 5 (515 voxels, cube 11); auto at 48: 5^3 = 125 -> r = 4 (257,
    cube 9); at 20: 3^3 = 27 -> r = 2 (33, cube 5); 3x5x3 = 45 -> r = 3 (123, cube 7)."""
    cuboid = resolve_options((24, 24, 24, n_volumes), extent=extent, stride=3, estimator="exp2",
                             aggregation="weighted", demean="volume")
    sphere = resolve_options((24, 24, 24, n_volumes), extent=extent, stride=3, estimator="exp2",
                             aggregation="weighted", demean="volume", shape="sphere")
    radius = sphere_radius(int(np.prod(cuboid.extent)))
    assert sphere.extent == (2 * radius + 1,) * 3 == (cube,) * 3
    assert sphere.shape == "sphere" and cuboid.shape == "cuboid"


def test_the_plan_reads_the_sphere_and_serves_its_bounding_cube():
    mask = finite = np.ones((9, 8, 7), dtype=bool)
    plan = plan_patches((9, 8, 7), (5, 5, 5), 2, mask, finite, "sphere")
    cube = plan_patches((9, 8, 7), (5, 5, 5), 2, mask, finite)
    # offsets back to (i, j, k) from the corner: exactly the voxels within distance 2 of the cube's centre
    i, rest = np.divmod(plan.voxel_offsets, 8 * 7)
    j, k = np.divmod(rest, 7)
    assert sorted(zip(i - 2, j - 2, k - 2)) == sorted(brute_force_sphere(2))
    assert plan.patch_size == 33
    np.testing.assert_array_equal(plan.served_offsets, cube.voxel_offsets)
    np.testing.assert_array_equal(plan.window_corner, cube.window_corner)
    assert cube.served_offsets is cube.voxel_offsets


def test_a_sphere_whose_bounding_cube_exceeds_the_image_is_refused_in_one_sentence():
    with pytest.raises(MPPCAInputError, match=r"^a sphere of radius 5 \(515 voxels, at least the 343 of extent "
                                              r"7,7,7\) needs 11 voxels along every axis, and the image is "
                                              r"9x8x7; give a smaller extent or shape 'cuboid'$"):
        resolve_options((9, 8, 7, 12), extent="wide", stride=3, estimator="exp2", aggregation="weighted",
                        demean="volume", shape="sphere")


def test_a_sphere_with_fewer_voxels_than_volumes_is_refused():
    with pytest.raises(MPPCAInputError, match="needs at least as many voxels in a patch as volumes, and the "
                                              "sphere of radius 1 holds 7 for 12 volumes"):
        resolve_options((9, 8, 7, 12), extent=(1, 1, 3), stride=1, estimator="exp2", aggregation="weighted",
                        demean="volume", shape="sphere")


def test_an_unknown_shape_is_refused():
    with pytest.raises(MPPCAInputError, match="shape must be one of cuboid, sphere, not 'ball'"):
        denoise(np.ones((5, 5, 5, 6), np.float32), shape="ball", device="cpu")


# -- the reference ------------------------------------------------------------------------------------------

def reference_windows(shape3, side, stride, wanted):
    """(corner, centre) of the windows that run: stride 1, every wanted voxel's own window (centred on it,
    shifted inside the image); stride > 1, the grid's windows holding a wanted voxel."""
    if stride == 1:
        return [(tuple(centred_corner(v, s, side) for v, s in zip(centre, shape3)), centre)
                for centre in itertools.product(*(range(s) for s in shape3)) if wanted[centre]]
    windows = []
    for corner in itertools.product(*(grid_corners(s, side, stride) for s in shape3)):
        cube = itertools.product(*(range(c, c + side) for c in corner))
        if any(wanted[v] for v in cube):
            windows.append((corner, None))
    return windows


def sphere_reference(data, *, extent_voxels, stride, aggregation, demean, estimator):
    """Denoise ``data`` (X, Y, Z, T) with spherical patches, one window at a time, in float64: (denoised,
    sigma, rank). ``extent_voxels``: the voxels the cuboid would hold (the sphere holds at least as many)."""
    data = np.asarray(data, dtype=np.float64)
    shape3, T = data.shape[:3], data.shape[3]
    radius = 0
    while len(brute_force_sphere(radius)) < extent_voxels:
        radius += 1
    side = 2 * radius + 1
    ball = brute_force_sphere(radius)
    image, weight = np.zeros(data.shape), np.zeros(shape3)
    sigma_sum, rank_sum = np.zeros(shape3), np.zeros(shape3)
    for corner, centre in reference_windows(shape3, side, stride, np.ones(shape3, dtype=bool)):
        middle = tuple(c + radius for c in corner)
        patch = [tuple(m + o for m, o in zip(middle, offset)) for offset in ball]
        X = np.array([data[v] for v in patch])
        n = len(patch)
        if demean == "volume":
            mu, n_eff, t_eff = X.mean(axis=0), n - 1, T
        elif demean == "voxel":
            mu, n_eff, t_eff = None, n, T - 1
        else:
            mu, n_eff, t_eff = np.zeros(T), n, T
        centred = X - (X.mean(axis=1, keepdims=True) if mu is None else mu)
        eigenvalues, eigenvectors = np.linalg.eigh(centred.T @ centred)  # T x T: the sphere holds >= T voxels
        P, sigma2 = mp_threshold(eigenvalues, n_eff, t_eff, estimator)
        top = eigenvectors[:, ::-1][:, :P]

        def projected(voxel):
            x = data[voxel]
            mean = x.mean() if mu is None else mu
            return (x - mean) @ top @ top.T + mean

        if aggregation == "center":
            image[centre], weight[centre] = projected(centre), 1.0
            sigma_sum[centre], rank_sum[centre] = math.sqrt(sigma2), P
            continue
        w = 1.0 / (1 + P + (demean != "none")) if aggregation == "weighted" else 1.0
        for voxel in itertools.product(*(range(c, c + side) for c in corner)):
            image[voxel] += w * projected(voxel)
            weight[voxel] += w
            sigma_sum[voxel] += w * math.sqrt(sigma2)
            rank_sum[voxel] += w * P
    assert (weight > 0).all()
    return image / weight[..., None], sigma_sum / weight, rank_sum / weight


def low_rank_series(shape3=(9, 8, 7), n_volumes=12, rank=3, sigma=1.0, seed=0):
    """A random rank-``rank`` signal on a baseline of 100, plus Gaussian noise of ``sigma``."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape3))
    signal = 100 + 8 * rng.normal(size=(n, rank)) @ rng.normal(size=(rank, n_volumes))
    return (signal + sigma * rng.normal(size=(n, n_volumes))).reshape(*shape3, n_volumes).astype(np.float32)


@pytest.mark.parametrize("stride, aggregation, demean, estimator", [
    (2, "weighted", "volume", "exp2"), (3, "uniform", "voxel", "exp1"), (1, "center", "none", "exp2"),
    (1, "weighted", "volume", "exp1"), (1, "center", "voxel", "exp2")])
def test_sphere_denoising_matches_the_float64_reference(stride, aggregation, demean, estimator):
    """9x8x7x12, extent 3 (27 voxels) -> spheres of radius 2 (33 voxels) in cubes of 5: the CPU engine's
    series within 1e-6 rms of the reference's (relative; float32 output), ranks equal, noise as precise as
    the first pass's precision (as tests/test_engine_cpu.py holds cuboids to)."""
    noisy = low_rank_series()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)  # (12 volumes: fewer than dwidenoise likes)
        result = denoise(noisy, extent=3, stride=stride, aggregation=aggregation, demean=demean,
                         estimator=estimator, shape="sphere", device="cpu", nprocs=1)
    denoised, sigma, rank = sphere_reference(noisy, extent_voxels=27, stride=stride, aggregation=aggregation,
                                             demean=demean, estimator=estimator)
    assert result.info["shape"] == "sphere" and result.info["extent"] == [5, 5, 5]
    rms = np.sqrt(np.mean((result.denoised - denoised) ** 2) / np.mean(denoised**2))
    assert rms < 1e-6
    np.testing.assert_allclose(result.rank, rank, rtol=1e-6, atol=0)
    # the noise level at float32's precision where the first pass ran in it (cpu.first_pass_dtype)
    tolerance = 1e-3 if result.info["gram_precision"] == "float32" else 1e-6
    np.testing.assert_allclose(result.sigma, sigma, rtol=tolerance, atol=0)
    # the noise level found is the phantom's (sigma 1)
    assert 0.8 < np.median(result.sigma) < 1.2


def test_sphere_and_cuboid_patches_differ():
    noisy = low_rank_series(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        sphere = denoise(noisy, extent=3, stride=2, shape="sphere", device="cpu", nprocs=1)
        cuboid = denoise(noisy, extent=3, stride=2, device="cpu", nprocs=1)
    assert cuboid.info["shape"] == "cuboid" and cuboid.info["extent"] == [3, 3, 3]
    assert np.abs(sphere.denoised - cuboid.denoised).max() > 1e-2


def test_the_noise_map_alone_is_that_of_denoise_with_spheres():
    noisy = low_rank_series(seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        alone = estimate_noise(noisy, extent=3, stride=2, shape="sphere", nprocs=1)
        denoised = denoise(noisy, extent=3, stride=2, shape="sphere", device="cpu", nprocs=1)
    assert alone.info["shape"] == "sphere"
    np.testing.assert_array_equal(alone.sigma, denoised.sigma)
    np.testing.assert_array_equal(alone.rank, denoised.rank)


def test_sphere_results_do_not_depend_on_the_number_of_processes():
    noisy = low_rank_series((12, 8, 7), seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        one = denoise(noisy, extent=3, stride=2, shape="sphere", device="cpu", nprocs=1)
        two = denoise(noisy, extent=3, stride=2, shape="sphere", device="cpu", nprocs=2)
    np.testing.assert_array_equal(one.denoised, two.denoised)
