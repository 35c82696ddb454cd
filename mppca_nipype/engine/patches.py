"""Patch geometry: the extent rule, where patches sit, which of them run, and which voxels they serve.

Everything here is index arithmetic on the spatial grid (X, Y, Z); no voxel values are touched.

Two layouts, as DESIGN.md fixes them:

* ``stride == 1`` (dwidenoise's): every voxel is the centre of one patch; near an edge the window is
  shifted to lie inside the image while its centre stays on the voxel. Windows of edge voxels therefore
  coincide (all voxels within ``extent // 2`` of an edge share the flush window), so the distinct windows
  are the positions ``0 .. size - extent`` on each axis, and a window serves one or more centre voxels.
* ``stride > 1``: windows on a grid of step ``stride``, plus one flush against the far edge of each axis so
  that every voxel is covered. A window serves no particular centre. On an axis where the extent is smaller
  than the stride, the step is the extent (a larger one would leave gaps between windows).

Two patch shapes (``PATCH_SHAPES``): ``cuboid``, the whole window; ``sphere``, the voxels within Euclidean
distance r of the window's centre voxel (``sphere_radius`` gives r), in a window (its bounding cube) of side
2r + 1. Spheres are centred on the image's own voxels, on the stride grid over the whole image (0, s, 2s, ...
and the last voxel of each axis; every voxel with stride 1), and clipped at its edges: the plan lays them out
on the image padded by r voxels on each side (``PatchPlan.padding``), where each window is a cuboid's of side
2r + 1 with its centre in the image, and the padding is wanted by no patch and takes part in none, as voxels
that are not finite take part in none. A sphere's voxels that took part make its patch matrix and are the
only voxels it reconstructs. The grid's step must leave no voxel farther than r from every centre
(``sphere_grid_gap``).

Both backends compute each *distinct* window once; a window's multiplicity (how many centre voxels chose
it) becomes a factor on its aggregation weight, which makes the result identical to computing every
voxel's patch separately.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
import warnings

import numpy as np

from .errors import MPPCAWarning

#: dwidenoise warns when a patch holds fewer voxels, or the series fewer volumes, than this.
FEW_SAMPLES = 15


def auto_extent(n_volumes: int) -> int:
    """The smallest odd ``e`` with ``e**3 >= n_volumes`` (MRtrix3 dwidenoise's default rule)."""
    e = 1
    while e**3 < n_volumes:
        e += 2
    return e


def wide_extent(n_volumes: int) -> int:
    """dwidenoise's rule, but at least 7: larger patches estimate the noise better (7 beat 5 by 5-10% in
    RMSE to the truth at 48 and 96 volumes, docs/benchmarks.md); from 344 volumes on it is dwidenoise's."""
    return max(7, auto_extent(n_volumes))


#: The named extent rules: a patch size from the number of volumes, before fitting to the image.
EXTENT_RULES = {"auto": auto_extent, "wide": wide_extent}

#: The patch shapes: the whole window, or the ball inscribed in it.
PATCH_SHAPES = ("cuboid", "sphere")


def sphere_offsets(radius: int) -> np.ndarray:
    """(n, 3) integer offsets (i, j, k) from the centre with i^2 + j^2 + k^2 <= radius^2, x slowest (C order)."""
    axis = np.arange(-radius, radius + 1)
    i, j, k = np.meshgrid(axis, axis, axis, indexing="ij")
    inside = (i * i + j * j + k * k) <= radius * radius
    return np.stack([i[inside], j[inside], k[inside]], axis=1)


def sphere_size(radius: int) -> int:
    """Voxels of the sphere of ``radius``: 1, 7, 33, 123, 257, 515, 925, ... for r = 0, 1, 2, ..."""
    return len(sphere_offsets(radius))


def sphere_radius(n_voxels: int) -> int:
    """The smallest radius whose sphere holds at least ``n_voxels`` voxels."""
    radius = 0
    while sphere_size(radius) < n_voxels:
        radius += 1
    return radius


def resolve_sphere(extent, spatial_shape) -> tuple[int, int, int]:
    """The bounding cube (2r + 1,) * 3 of the sphere for a resolved cuboid ``extent`` (``resolve_extent``): the
    smallest sphere holding at least as many voxels as that cuboid. ValueError when the cube exceeds the image."""
    needed = int(np.prod(extent))
    radius = sphere_radius(needed)
    side = 2 * radius + 1
    if side > min(spatial_shape):
        raise ValueError(
            f"a sphere of radius {radius} ({sphere_size(radius)} voxels, at least the {needed} of extent "
            f"{','.join(map(str, extent))}) needs {side} voxels along every axis, and the image is "
            f"{'x'.join(map(str, spatial_shape))}; give a smaller extent or shape 'cuboid'")
    return (side,) * 3


def sphere_centres(size: int, stride: int) -> np.ndarray:
    """Sphere centres along one axis of ``size`` voxels: 0, s, 2s, ... and the last voxel."""
    centres = np.arange(0, size, stride)
    return centres if centres[-1] == size - 1 else np.append(centres, size - 1)


def sphere_grid_gap(spatial_shape, stride: int) -> float:
    """The largest Euclidean distance from a voxel of the image to the nearest sphere centre of the grid of
    ``stride`` (``sphere_centres``): per axis the farthest voxel from its nearest centre, combined over the
    three axes (the grid is separable)."""
    squares = 0
    for size in spatial_shape:
        centres = sphere_centres(int(size), int(stride))
        voxels = np.arange(int(size))
        squares += int(np.abs(voxels[:, None] - centres[None, :]).min(axis=1).max()) ** 2
    return float(np.sqrt(squares))


def largest_sphere_stride(spatial_shape, radius: int, at_most: int) -> int:
    """The largest stride up to ``at_most`` whose grid leaves no voxel farther than ``radius`` from every sphere
    centre (``sphere_grid_gap``; stride 1 always does)."""
    return max(s for s in range(1, int(at_most) + 1) if sphere_grid_gap(spatial_shape, s) <= radius)


def check_sphere_stride(spatial_shape, radius: int, stride: int) -> None:
    """ValueError in one sentence when the grid of ``stride`` leaves a voxel farther than ``radius`` from every
    sphere centre (``sphere_grid_gap``), naming the largest stride that does not."""
    gap = sphere_grid_gap(spatial_shape, stride)
    if gap <= radius:
        return
    largest = largest_sphere_stride(spatial_shape, radius, stride)
    raise ValueError(
        f"stride {stride} leaves voxels {gap:.2f} voxels from the nearest sphere centre, farther than the "
        f"radius {radius}; give a stride of at most {largest} or a larger extent")


def resolve_extent(extent, spatial_shape, n_volumes: int) -> tuple[int, int, int]:
    """Turn ``extent`` (a rule of EXTENT_RULES, an odd int, or three odd ints) into three odd ints that fit
    the image.

    Each axis is capped at the largest odd number not above the image size on that axis. For "auto" this
    is dwidenoise's rule (which caps at the size itself; for an even size that would be an even window,
    which dwidenoise cannot handle, so we take the odd one below). An explicit extent that must be capped
    is capped with a warning.
    """
    if isinstance(extent, str):
        if extent not in EXTENT_RULES:
            raise ValueError(f"extent must be {' or '.join(map(repr, EXTENT_RULES))}, an odd integer or three "
                             f"odd integers, not {extent!r}")
        wanted = (EXTENT_RULES[extent](n_volumes),) * 3
        explicit = False
    else:
        wanted = (extent,) * 3 if np.ndim(extent) == 0 else tuple(extent)
        if len(wanted) != 3:
            raise ValueError(f"extent must have 1 or 3 values, not {len(wanted)}")
        if any(int(e) != e or e < 1 or e % 2 == 0 for e in wanted):
            raise ValueError(f"extent must be odd positive integers, got {','.join(str(e) for e in wanted)}")
        explicit = True
    fitted = tuple(int(min(e, size if size % 2 else size - 1)) for e, size in zip(wanted, spatial_shape))
    if explicit and fitted != tuple(int(e) for e in wanted):
        warnings.warn(
            f"extent {','.join(map(str, wanted))} exceeds the image {'x'.join(map(str, spatial_shape))}; "
            f"using {','.join(map(str, fitted))}",
            MPPCAWarning,
            stacklevel=3,
        )
    return fitted


def window_positions(size: int, extent: int, stride: int) -> np.ndarray:
    """Corners (first index) of the distinct windows along one axis.

    The step is ``min(stride, extent)``: a larger one would leave voxels between two windows."""
    last = size - extent
    stride = min(stride, extent)
    if stride == 1:
        return np.arange(last + 1)
    corners = np.arange(0, last + 1, stride)
    if corners[-1] != last:
        corners = np.append(corners, last)
    return corners


def centre_window(size: int, extent: int) -> np.ndarray:
    """For ``stride == 1``: the index (into ``window_positions``) of each voxel's own window along one axis."""
    return np.clip(np.arange(size) - extent // 2, 0, size - extent)


@dataclass(frozen=True)
class PatchPlan:
    """Which windows run and which voxels they serve. Indices are into the flattened spatial grid.

    Attributes
    ----------
    spatial_shape, extent, stride, shape
        The geometry: for a sphere ``extent`` is its bounding cube and ``spatial_shape`` the image's padded
        by ``padding`` voxels on each side.
    window_corner : (W, 3) int array
        Corner voxel of each active window, in processing order (sorted by x, then y, then z).
    multiplicity : (W,) int array
        Number of centre voxels that chose this window (stride 1), else 1.
    voxel_offsets : (n,) int array
        Flat offset of each patch voxel from the window's corner voxel, x slowest (C order).
    centre_voxel, centre_window, centre_position : (V,) int arrays, stride 1 only
        For every voxel that is a patch centre: its flat index, the index of its window in
        ``window_corner``, and its position (0..n-1) inside that window's patch.
    padding : int
        Voxels added on each side of the image before laying out the windows: r for a sphere (its series
        and flags padded by ``layout.padded_series``, its sums cropped by ``PatchSums.cropped``), else 0.
    """

    spatial_shape: tuple[int, int, int]
    extent: tuple[int, int, int]
    stride: int
    window_corner: np.ndarray
    multiplicity: np.ndarray
    voxel_offsets: np.ndarray
    centre_voxel: np.ndarray | None
    centre_window: np.ndarray | None
    centre_position: np.ndarray | None
    shape: str = "cuboid"
    padding: int = 0

    @property
    def sphere(self) -> bool:
        return self.shape == "sphere"

    @property
    def n_windows(self) -> int:
        return len(self.window_corner)

    @property
    def patch_size(self) -> int:
        return len(self.voxel_offsets)

    @property
    def patch_in_window(self) -> np.ndarray:
        """(n,) each patch voxel's index among its window's voxels (C order): 0..n-1 for a cuboid."""
        return patch_offsets(self.shape, self.extent, self.extent)

    def voxel_weights(self, aggregation: str) -> np.ndarray | None:
        """(n,) each patch voxel's spatial factor on its window's weight: for ``gaussian`` a Gaussian of its
        distance from the window's centre (``gaussian_window_weights``); None where every voxel counts alike."""
        if aggregation != "gaussian":
            return None
        return gaussian_window_weights(tuple(self.extent))[self.patch_in_window]

    def window_base(self, windows=slice(None)) -> np.ndarray:
        """Flat index of the corner voxel of the given windows."""
        cx, cy, cz = self.window_corner[windows].T
        _, ny, nz = self.spatial_shape
        return (cx * ny + cy) * nz + cz


#: The ``gaussian`` aggregation's standard deviation along each axis, in units of the window's half-extent
#: (e - 1) / 2 (the radius for a sphere): 1 puts exp(-1/2) at the centre of each face. Chosen on the phantoms
#: of benchmarks/shrinkage.py among 0.5, 0.75, 1 and 1.5 (docs/benchmarks.md, "Aggregation").
GAUSSIAN_WIDTH = 1.0


@lru_cache(maxsize=8)
def gaussian_window_weights(extent: tuple[int, int, int]) -> np.ndarray:
    """(prod(extent),) exp(-d^2 / 2) over a window's voxels (C order), d the distance from its centre with each
    axis in units of ``GAUSSIAN_WIDTH`` times its half-extent (a half-extent of 1/2 for an axis of extent 1).
    Computed once per extent (every batch of a run asks for it); read-only."""
    axes = [(np.arange(e) - (e - 1) / 2.0) / (GAUSSIAN_WIDTH * max((e - 1) / 2.0, 0.5)) for e in extent]
    d2 = axes[0][:, None, None] ** 2 + axes[1][None, :, None] ** 2 + axes[2][None, None, :] ** 2
    weights = np.exp(-0.5 * d2).ravel()
    weights.flags.writeable = False
    return weights


def flat_offsets(extent, spatial_shape) -> np.ndarray:
    """Flat offsets of a window's voxels from its corner voxel, x slowest."""
    _, ny, nz = spatial_shape
    dx, dy, dz = np.meshgrid(*(np.arange(e) for e in extent), indexing="ij")
    return ((dx * ny + dy) * nz + dz).ravel()


def patch_offsets(shape, extent, spatial_shape) -> np.ndarray:
    """Flat offsets of a patch's voxels from its window's corner voxel, x slowest: the whole window
    (``cuboid``), or the voxels of its inscribed sphere (``sphere``, ``extent`` a cube of odd side)."""
    if shape == "cuboid":
        return flat_offsets(extent, spatial_shape)
    radius = extent[0] // 2
    _, ny, nz = spatial_shape
    dx, dy, dz = (sphere_offsets(radius) + radius).T
    return (dx * ny + dy) * nz + dz


def plan_patches(spatial_shape, extent, stride: int, mask: np.ndarray, finite: np.ndarray,
                 shape: str = "cuboid") -> PatchPlan:
    """Lay out the windows for ``extent``/``stride`` (for a sphere: its bounding cube, on the image padded by
    its radius) and keep those the mask needs.

    ``mask`` and ``finite`` are boolean (X, Y, Z) arrays of the image: the voxels to denoise, and the voxels
    whose time courses hold no NaN/Inf (the others take part in no patch). With ``stride == 1`` a voxel is a
    patch centre when it is in the mask and finite; a window runs when it is some centre's window. With
    ``stride > 1`` a window runs when it holds at least one finite mask voxel.
    """
    spatial_shape = tuple(int(s) for s in spatial_shape)
    extent = tuple(int(e) for e in extent)
    wanted = mask & finite
    if wanted.all():
        return _plan_of_every_voxel(spatial_shape, extent, int(stride), shape)
    return _plan_of(spatial_shape, extent, stride, wanted, shape)


@lru_cache(maxsize=8)
def _plan_of_every_voxel(spatial_shape, extent, stride, shape="cuboid") -> PatchPlan:
    """The plan where every voxel is wanted (no mask, every value finite: the usual case), once per geometry
    in a process: a running process that denoises series of one shape (the BIDS app's GPU worker, a script)
    plans once (0.5 ms of a 10 ms GPU call on 96x96x48). Its arrays are read-only, being shared."""
    plan = _plan_of(spatial_shape, extent, stride, np.ones(spatial_shape, dtype=bool), shape)
    for field in fields(plan):
        value = getattr(plan, field.name)
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
    return plan


def _plan_of(spatial_shape, extent, stride, wanted, shape="cuboid") -> PatchPlan:
    """``plan_patches`` for the (X, Y, Z) bool ``wanted`` voxels."""
    if shape not in PATCH_SHAPES:
        raise ValueError(f"shape must be one of {', '.join(PATCH_SHAPES)}, not {shape!r}")
    every_voxel = bool(wanted.all())
    padding = 0
    if shape == "sphere":
        # on the image padded by r, the windows of side 2r + 1 at 0, s, ... and the flush one have their
        # centres at the image's 0, s, ... and last voxel, and a stride-1 centre's own window is centred on it
        padding = extent[0] // 2
        wanted = np.pad(wanted, padding)
        spatial_shape = tuple(s + 2 * padding for s in spatial_shape)
    positions = [window_positions(s, e, stride) for s, e in zip(spatial_shape, extent)]
    grid_shape = tuple(len(p) for p in positions)
    offsets = patch_offsets(shape, extent, spatial_shape)

    if stride == 1:
        own = [centre_window(s, e) for s, e in zip(spatial_shape, extent)]
        vx, vy, vz = np.nonzero(wanted)
        kx, ky, kz = own[0][vx], own[1][vy], own[2][vz]
        grid_index = (kx * grid_shape[1] + ky) * grid_shape[2] + kz
        counts = np.bincount(grid_index, minlength=int(np.prod(grid_shape)))
        active = np.flatnonzero(counts)
        # number each active window 0..W-1 in grid order; centres look their window up
        window_number = np.full(counts.shape, -1, dtype=np.int64)
        window_number[active] = np.arange(len(active))
        ax, ay, az = np.unravel_index(active, grid_shape)
        corner = np.stack([positions[0][ax], positions[1][ay], positions[2][az]], axis=1)
        _, ny, nz = spatial_shape
        # each centre's window and its position there (the corner per axis: no (V, 3) gather)
        own_window = window_number[grid_index]
        inside = ((vx - positions[0][kx]) * extent[1] + (vy - positions[1][ky])) * extent[2] + (vz - positions[2][kz])
        if shape == "sphere":  # the window's centre voxel, the middle one of its sphere's
            inside = np.searchsorted(patch_offsets(shape, extent, extent), inside)
        # centres sorted by window, so that a run of windows serves a contiguous run of centres
        by_window = np.argsort(own_window, kind="stable")
        return PatchPlan(
            spatial_shape, extent, stride,
            window_corner=corner,
            multiplicity=counts[active],
            voxel_offsets=offsets,
            centre_voxel=((vx * ny + vy) * nz + vz)[by_window],
            centre_window=own_window[by_window],
            centre_position=inside[by_window],
            shape=shape, padding=padding,
        )

    # stride > 1: a window runs when it holds any wanted voxel (a box sum over an integral image; every
    # window when every voxel is wanted, the usual case, which skips the integral image's passes; so too
    # for spheres, whose every window's centre is an image voxel)
    if every_voxel:
        active = np.arange(int(np.prod(grid_shape)))
    else:
        integral = np.zeros(tuple(s + 1 for s in spatial_shape), dtype=np.int64)
        integral[1:, 1:, 1:] = wanted.astype(np.int64).cumsum(0).cumsum(1).cumsum(2)
        px, py, pz = np.meshgrid(*positions, indexing="ij")
        ex, ey, ez = extent
        box = (integral[px + ex, py + ey, pz + ez]
               - integral[px, py + ey, pz + ez] - integral[px + ex, py, pz + ez] - integral[px + ex, py + ey, pz]
               + integral[px, py, pz + ez] + integral[px, py + ey, pz] + integral[px + ex, py, pz]
               - integral[px, py, pz])
        active = np.flatnonzero(box.ravel() > 0)
    ax, ay, az = np.unravel_index(active, grid_shape)
    corner = np.stack([positions[0][ax], positions[1][ay], positions[2][az]], axis=1)
    return PatchPlan(
        spatial_shape, extent, stride,
        window_corner=corner,
        multiplicity=np.ones(len(active), dtype=np.int64),
        voxel_offsets=offsets,
        centre_voxel=None, centre_window=None, centre_position=None,
        shape=shape, padding=padding,
    )
