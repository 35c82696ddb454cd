"""Spherical patches (``shape="sphere"``): the radius rule, the plan's offsets, and the CPU engine against a
float64 reference written here from docs/options.md ("Patch shape"), sharing no code with the engine.

The reference: spheres centred on every voxel (stride 1) or on the grid 0, s, 2s, ... and the last voxel of
each axis (stride s), each clipped at the image's edges and holding only the finite voxels within distance r
of its centre; their count is the patch's n in the Marchenko-Pastur rule and the filter
(``reference.denoise_patch``); each sphere's own voxels, and only they, are reconstructed, x_hat = (x - mu)
V diag(w) V^T + mu, and aggregated (``center``: each voxel from its own sphere).
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest

from mppca_nipype.engine import (DEFAULTS, NOISE_STRIDE, MPPCAInputError, denoise, estimate_noise, noise_stride,
                                 resolve_options)
from mppca_nipype.engine.backend import PatchSums
from mppca_nipype.engine.cpu import denoise_cpu
from mppca_nipype.engine.errors import MPPCAWarning
from mppca_nipype.engine.patches import GAUSSIAN_WIDTH, plan_patches, sphere_grid_gap, sphere_radius, sphere_size
from reference import denoise_patch


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


def test_the_plan_lays_spheres_on_the_padded_image_centred_on_the_stride_grid():
    """Radius 2 on 9x8x7, stride 2: the plan's grid is the image padded by 2 on each side, where a window's
    corner is its sphere's centre in the image's coordinates: 0, 2, 4, ... and the last voxel of each axis."""
    mask = finite = np.ones((9, 8, 7), dtype=bool)
    plan = plan_patches((9, 8, 7), (5, 5, 5), 2, mask, finite, "sphere")
    assert plan.padding == 2 and plan.spatial_shape == (13, 12, 11) and plan.patch_size == 33
    # offsets back to (i, j, k) from the corner: exactly the voxels within distance 2 of the cube's centre
    i, rest = np.divmod(plan.voxel_offsets, 12 * 11)
    j, k = np.divmod(rest, 11)
    assert sorted(zip(i - 2, j - 2, k - 2)) == sorted(brute_force_sphere(2))
    centres = itertools.product([0, 2, 4, 6, 8], [0, 2, 4, 6, 7], [0, 2, 4, 6])
    assert sorted(map(tuple, plan.window_corner.tolist())) == sorted(centres)
    cuboid = plan_patches((9, 8, 7), (5, 5, 5), 2, mask, finite)
    assert cuboid.padding == 0 and cuboid.spatial_shape == (9, 8, 7)


def test_with_stride_1_every_voxel_is_the_centre_of_its_own_sphere():
    mask = np.ones((6, 5, 4), dtype=bool)
    mask[0, 0, 0] = False
    plan = plan_patches((6, 5, 4), (5, 5, 5), 1, mask, np.ones_like(mask), "sphere")
    assert plan.n_windows == mask.sum() and (plan.multiplicity == 1).all()
    # each centre's window has its corner at the centre's own (x, y, z), and the centre is its sphere's middle
    x, rest = np.divmod(plan.centre_voxel, 9 * 8)
    y, z = np.divmod(rest, 8)
    np.testing.assert_array_equal(plan.window_corner[plan.centre_window], np.stack([x, y, z], axis=1) - 2)
    assert (plan.centre_position == brute_force_sphere(2).index((0, 0, 0))).all()


def test_sphere_grid_gap_is_the_distance_to_the_farthest_voxel():
    # 9 voxels at stride 4: centres 0, 4, 8, the farthest voxels 2 away on each axis
    assert sphere_grid_gap((9, 9, 9), 4) == pytest.approx(2 * math.sqrt(3))
    # 8 voxels at stride 3: centres 0, 3, 6, 7
    assert sphere_grid_gap((8, 8, 8), 3) == pytest.approx(math.sqrt(3))
    assert sphere_grid_gap((8, 8, 8), 1) == 0


def test_a_stride_leaving_voxels_outside_every_sphere_is_refused_in_one_sentence():
    with pytest.raises(MPPCAInputError, match=r"^stride 4 leaves voxels 3\.46 voxels from the nearest sphere "
                                              r"centre, farther than the radius 2; give a stride of at most 3 "
                                              r"or a larger extent$"):
        resolve_options((9, 8, 7, 12), extent=3, stride=4, estimator="exp2", aggregation="weighted",
                        demean="volume", shape="sphere")
    resolve_options((9, 8, 7, 12), extent=3, stride=3, estimator="exp2", aggregation="weighted",
                    demean="volume", shape="sphere")


def test_a_sphere_whose_bounding_cube_exceeds_the_image_is_refused_in_one_sentence():
    with pytest.raises(MPPCAInputError, match=r"^a sphere of radius 5 \(515 voxels, at least the 343 of extent "
                                              r"7,7,7\) needs 11 voxels along every axis, and the image is "
                                              r"9x8x7; give a smaller extent or shape 'cuboid'$"):
        resolve_options((9, 8, 7, 12), extent="wide", stride=3, estimator="exp2", aggregation="weighted",
                        demean="volume", shape="sphere")


def test_an_unknown_shape_is_refused():
    with pytest.raises(MPPCAInputError, match="shape must be one of cuboid, sphere, not 'ball'"):
        denoise(np.ones((5, 5, 5, 6), np.float32), shape="ball", device="cpu")


# -- the reference ------------------------------------------------------------------------------------------

def reference_centres(shape3, stride):
    """The spheres' centres: every voxel (stride 1), else the grid 0, s, 2s, ... and the last voxel per axis."""
    axes = [range(size) if stride == 1 else sorted(set(range(0, size, stride)) | {size - 1}) for size in shape3]
    return list(itertools.product(*axes))


def sphere_reference(data, *, extent_voxels, stride, aggregation, demean, estimator, filter=DEFAULTS["filter"]):
    """Denoise ``data`` (X, Y, Z, T) with spherical patches, one sphere at a time, in float64 (each patch as
    ``reference.denoise_patch`` does): (denoised, sigma, rank, weight). ``extent_voxels``: the voxels the
    cuboid would hold (the sphere holds at least as many). Voxels holding NaN take part in no sphere."""
    data = np.asarray(data, dtype=np.float64)
    shape3 = data.shape[:3]
    finite = np.isfinite(data).all(axis=3)
    radius = 0
    while len(brute_force_sphere(radius)) < extent_voxels:
        radius += 1
    ball = brute_force_sphere(radius)
    image, weight = np.zeros(data.shape), np.zeros(shape3)
    sigma_sum, rank_sum = np.zeros(shape3), np.zeros(shape3)
    for centre in reference_centres(shape3, stride):
        voxels = [tuple(c + o for c, o in zip(centre, offset)) for offset in ball]
        patch = [v for v in voxels if all(0 <= i < s for i, s in zip(v, shape3)) and finite[v]]
        X = np.array([data[v] for v in patch])
        restored, P, sigma2 = denoise_patch(X, demean, estimator, filter=filter)
        if aggregation == "center":
            if finite[centre]:
                image[centre], weight[centre] = restored[patch.index(centre)], 1.0
                sigma_sum[centre], rank_sum[centre] = math.sqrt(sigma2), P
            continue
        w = 1.0 / (1 + P + (demean != "none")) if aggregation in ("weighted", "gaussian") else 1.0
        for voxel, row in zip(patch, restored):
            # gaussian: exp(-d^2 / 2), d the distance from the centre in units of GAUSSIAN_WIDTH radii
            d2 = sum((v - c) ** 2 for v, c in zip(voxel, centre)) / (GAUSSIAN_WIDTH * radius) ** 2
            v = w * (math.exp(-d2 / 2) if aggregation == "gaussian" else 1.0)
            image[voxel] += v * row
            weight[voxel] += v
            sigma_sum[voxel] += v * math.sqrt(sigma2)
            rank_sum[voxel] += v * P
    assert (weight[finite] > 0).all()  # every finite voxel lies in some sphere
    served = np.maximum(weight, 1e-300)
    return image / served[..., None], sigma_sum / served, rank_sum / served, weight


def low_rank_series(shape3=(9, 8, 7), n_volumes=12, rank=3, sigma=1.0, seed=0):
    """A random rank-``rank`` signal on a baseline of 100, plus Gaussian noise of ``sigma``."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape3))
    signal = 100 + 8 * rng.normal(size=(n, rank)) @ rng.normal(size=(rank, n_volumes))
    return (signal + sigma * rng.normal(size=(n, n_volumes))).reshape(*shape3, n_volumes).astype(np.float32)


@pytest.mark.parametrize("stride, aggregation, demean, estimator, nan", [
    (2, "weighted", "volume", "exp2", False), (3, "uniform", "voxel", "exp1", False),
    (1, "center", "none", "exp2", False), (1, "weighted", "volume", "exp1", False),
    (1, "center", "voxel", "exp2", False), (2, "weighted", "volume", "exp2", True),
    (1, "center", "volume", "exp2", True), (2, "gaussian", "volume", "exp2", True),
    (1, "gaussian", "voxel", "olesen2023", False)])
def test_sphere_denoising_matches_the_float64_reference(stride, aggregation, demean, estimator, nan):
    """9x8x7x12, extent 3 (27 voxels) -> spheres of radius 2 (33 voxels where whole, 11 at a corner): the CPU
    engine's series within 1e-6 rms of the reference's (relative; float32 output), ranks equal, noise as
    precise as the first pass's precision (as tests/test_engine_cpu.py holds cuboids to); ``nan``: a voxel
    holding a NaN takes part in no sphere and is left as it was."""
    noisy = low_rank_series()
    if nan:
        noisy[4, 3, 2, 5] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)  # (12 volumes: fewer than dwidenoise likes)
        result = denoise(noisy, extent=3, stride=stride, aggregation=aggregation, demean=demean,
                         estimator=estimator, shape="sphere", device="cpu", nprocs=1)
    denoised, sigma, rank, _ = sphere_reference(noisy, extent_voxels=27, stride=stride, aggregation=aggregation,
                                                demean=demean, estimator=estimator)
    assert result.info["shape"] == "sphere" and result.info["extent"] == [5, 5, 5]
    finite = np.isfinite(noisy).all(axis=3)
    np.testing.assert_array_equal(result.denoised[~finite], noisy[~finite])
    got, want = result.denoised[finite], denoised[finite]
    rms = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
    assert rms < 1e-6
    np.testing.assert_allclose(result.rank[finite], rank[finite], rtol=1e-6, atol=0)
    # the noise level at float32's precision where the first pass ran in it (cpu.first_pass_dtype)
    tolerance = 1e-3 if result.info["gram_precision"] == "float32" else 1e-6
    np.testing.assert_allclose(result.sigma[finite], sigma[finite], rtol=tolerance, atol=0)
    # the noise level found is the phantom's (sigma 1)
    assert 0.8 < np.median(result.sigma) < 1.2


def test_a_sphere_reconstructs_only_its_own_voxels():
    """Stride 3 on 9x8x7, radius 2, uniform aggregation: the CPU engine's weight at each voxel counts the
    spheres within distance 2 of it (the corner (0, 0, 0) and the voxel (1, 1, 1), sqrt(3) from the centre
    (0, 0, 0), are in one sphere each), and its sums come on the image's grid, the padding dropped."""
    noisy = low_rank_series()
    options = resolve_options(noisy.shape, extent=3, stride=3, estimator="exp2", aggregation="uniform",
                              demean="volume", shape="sphere")
    everywhere = np.ones(noisy.shape[:3], dtype=bool)
    plan = plan_patches(noisy.shape[:3], options.extent, options.stride, everywhere, everywhere, "sphere")
    sums = denoise_cpu(noisy, everywhere, plan, options, nprocs=1)
    centres = np.array(reference_centres((9, 8, 7), 3))
    grid = np.stack(np.meshgrid(*(np.arange(s) for s in (9, 8, 7)), indexing="ij"), axis=-1)
    within = (((grid[..., None, :] - centres) ** 2).sum(axis=-1) <= 4).sum(axis=-1)
    assert plan.n_windows == len(centres) == 4 * 4 * 3
    assert sums.image.shape == (9 * 8 * 7, 12)
    np.testing.assert_array_equal(sums.weight.reshape(9, 8, 7), within)
    assert within[0, 0, 0] == 1 and within[1, 1, 1] == 1 and within.min() >= 1


def test_sums_on_the_padded_grid_are_cropped_to_the_image_in_its_order():
    """``PatchSums.cropped``: (V, T) rows and flat maps of the padded grid, or a divided series in the
    caller's (volume-major) order, give the image's inner voxels, in that order."""
    rng = np.random.default_rng(5)
    padded = rng.normal(size=(7, 6, 5, 3))
    inner = padded[2:-2, 2:-2, 2:-2]
    rows = PatchSums(padded.reshape(-1, 3), padded[..., 0].ravel(), padded[..., 1].ravel(), padded[..., 2].ravel(),
                     lambda_plus=padded[..., 0].ravel()).cropped((7, 6, 5), 2)
    np.testing.assert_array_equal(rows.image, inner.reshape(-1, 3))
    np.testing.assert_array_equal(rows.weight, inner[..., 0].ravel())
    np.testing.assert_array_equal(rows.rank, inner[..., 2].ravel())
    np.testing.assert_array_equal(rows.lambda_plus, inner[..., 0].ravel())
    series = PatchSums(np.asfortranarray(padded), padded[..., 0].ravel(), padded[..., 1].ravel(),
                       padded[..., 2].ravel(), normalized=True).cropped((7, 6, 5), 2)
    assert series.image.flags.f_contiguous and series.normalized and series.lambda_plus is None
    np.testing.assert_array_equal(series.image, inner)


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


def test_the_noise_maps_default_stride_is_the_largest_whose_spheres_cover_the_image():
    noisy = low_rank_series(seed=4)  # extent 3: spheres of radius 2, which take a stride of at most 3 here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        alone = estimate_noise(noisy, extent=3, shape="sphere", nprocs=1)
        assert alone.info["stride"] == noise_stride(noisy.shape, extent=3, shape="sphere") == 3
        assert noise_stride(noisy.shape, extent=3) == NOISE_STRIDE == 7
        with pytest.raises(MPPCAInputError, match="^stride 7 leaves voxels"):
            estimate_noise(noisy, extent=3, stride=7, shape="sphere", nprocs=1)


def test_sphere_results_do_not_depend_on_the_number_of_processes():
    noisy = low_rank_series((12, 8, 7), seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        one = denoise(noisy, extent=3, stride=2, shape="sphere", device="cpu", nprocs=1)
        two = denoise(noisy, extent=3, stride=2, shape="sphere", device="cpu", nprocs=2)
    np.testing.assert_array_equal(one.denoised, two.denoised)


def test_spheres_denoise_as_well_as_cuboids_of_about_as_many_voxels():
    """The DWI phantom of docs/options.md ("Patch shape"), sigma 20: the default sphere (r = 5, 515 voxels)
    within 5% of the better of the cuboids on either side of its count (7^3 = 343, 9^3 = 729) in RMSE to the
    truth in the head (measured: 7.59 against 7.70 and 7.80)."""
    from mppca_nipype.phantoms import dwi_phantom

    noisy, truth = dwi_phantom((40, 40, 30), 64, sigma=20.0, seed=1)[:2]
    head = truth[..., 0] > 0

    def rmse(**options):
        denoised = denoise(noisy, device="cpu", nprocs=1, **options).denoised
        return float(np.sqrt(np.mean((denoised[head] - truth[head]) ** 2)))

    sphere = rmse(shape="sphere")
    assert sphere < 1.05 * min(rmse(extent=7), rmse(extent=9))
    assert sphere < 0.4 * 20.0
