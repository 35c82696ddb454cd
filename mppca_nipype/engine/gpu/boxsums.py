"""Gram matrices and reconstruction of a whole grid of windows by separable box sums (voxel demeaning).

With voxel demeaning, a window's Gram is a sum over its voxels of each voxel's own outer product,
G_W = sum_{v in W} x_v x_v^T (x_v: the voxel's centred time course), and its reconstruction adds, to each
voxel it holds, w_W x_v P_W + w_W m_v (m_v: the voxel's mean). When the windows are boxes on a grid (stride
> 1, every window active: ``applies``), both sums are separable along the three axes. The fused kernels
(``kernels.gram``, ``kernels.reconstruct_accumulate``) instead compute each window's X^T X and X P from its
n voxels: 2 n T^2 multiply-adds per window each, ~49 windows over every voxel at the seed's 11^3 stride 3, and
every output element added with an atomic.

Here, for windows at corners (a, b, c) of extent (ex, ey, ez) on a (X, Y, Z) slab of rows:

* Gram: ``_outer_sums_kernel`` sums the outer products of the ez voxels of each z-window of each (x, y) line
  (one ``tl.dot`` per line and window, the voxel's mean removed in registers): S1 (X, Y, C, T, T); then
  ``_range_sums_kernel`` sums ey consecutive y-rows (S2 (X, B, C, T, T)) and ex consecutive x-planes
  (G (A, B, C, T, T): the windows in the plan's order). Each voxel's outer product is formed once per
  z-window holding it (~ez / stride times), not once per window (~(ez / stride)^3 times).
* Reconstruction: the adjoint. The projectors scaled by their window's weight, Q (A, B, C, T, T), are spread
  back over x (``_range_sums_kernel`` again: each plane sums the run of windows holding it) and over y, giving
  R (X, Y, C, T, T); ``_apply_kernel`` then adds to each voxel x_v (sum over its z-windows c of R[x, y, c])
  + m_v sum_W w_W, and the voxel's sums of w, w sigma, w rank to the maps. No atomics: every voxel is written
  by one program. The windows' (w, w sigma, w rank)
  go through the same spreads.

Float32 throughout: the sums are in a tree (ez, then ey, then ex terms) rather than one running sum, and
the centring happens per voxel before any product, as in the fused Gram kernel.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..patches import window_positions
from . import kernels
from .upload import to_device

#: Largest T the box sums take (their T x T tiles, and the per-window buffers of T^2 floats per line).
MAX_VOLUMES = 64
#: Elements of a row (T x T blocks side by side) each program of ``_range_sums_kernel`` adds up.
BLOCK_Q = 1024
#: Voxels along z per program of ``_apply_kernel``.
BLOCK_Z = 16
#: How ``tl.dot`` multiplies in the outer-product and apply kernels (as ``kernels.DOT_PRECISIONS``). Measured
#: on the H200 (suite part x, the seed's 12,600 windows): Gram 1.26 ms with "ieee" outer products vs 1.41
#: with "tf32x3"; reconstruction 2.17 ms with "ieee" vs 2.00 with "tf32x3"; the Gram 1.9e-6 from float64
#: and the sums 1.2e-7 from the fused kernels' either way.
DOT_PRECISION = dict(outer="ieee", apply="tf32x3")


@triton.jit
def _outer_sums_kernel(volume_ptr, corner_ptr, out_ptr, first_line, n_windows, width, n_z: tl.constexpr,
                       n_volumes: tl.constexpr, extent: tl.constexpr, DOT: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    program = tl.program_id(0).to(tl.int64)  # the z-window varies fastest: neighbours share rows
    window = program % n_windows
    line = first_line + program // n_windows
    z0 = tl.load(corner_ptr + window)
    j = tl.arange(0, BLOCK_E)
    t = tl.arange(0, BLOCK_T)
    volume_valid = t < n_volumes
    valid = (j < extent)[:, None] & volume_valid[None, :]
    rows = line * n_z + z0 + j
    x = tl.load(volume_ptr + rows[:, None] * n_volumes + t[None, :], mask=valid, other=0.0)
    mean = tl.sum(x, axis=1) / n_volumes
    x = tl.where(valid, x - mean[:, None], 0.0)
    gram = tl.dot(tl.trans(x), x, input_precision=DOT)
    out = out_ptr + (line * n_windows + window) * width
    tl.store(out + t[:, None] * n_volumes + t[None, :], gram, mask=volume_valid[:, None] & volume_valid[None, :])


@triton.jit
def _range_sums_kernel(in_ptr, start_ptr, count_ptr, out_ptr, n_in_rows, n_out_rows, width, BLOCK_Q: tl.constexpr):
    program = tl.program_id(0).to(tl.int64)  # the output row varies fastest: neighbours share input rows
    row = program % n_out_rows
    outer = program // n_out_rows
    q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    valid = q < width
    first = outer * n_in_rows + tl.load(start_ptr + row)
    total = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    for i in range(tl.load(count_ptr + row)):
        total += tl.load(in_ptr + (first + i) * width + q, mask=valid, other=0.0)
    tl.store(out_ptr + (outer * n_out_rows + row) * width + q, total, mask=valid)


@triton.jit
def _apply_kernel(volume_ptr, spread_ptr, corner_ptr, lowest_ptr, highest_ptr, maps_ptr, image_ptr, weight_ptr,
                  sigma_ptr, rank_ptr, first_line, n_windows, width, n_z: tl.constexpr, n_volumes: tl.constexpr,
                  extent: tl.constexpr, DOT: tl.constexpr, BLOCK_Z: tl.constexpr, BLOCK_T: tl.constexpr):
    program = tl.program_id(0).to(tl.int64)
    n_blocks: tl.constexpr = (n_z + BLOCK_Z - 1) // BLOCK_Z
    block = program % n_blocks
    line = first_line + program // n_blocks
    z = block * BLOCK_Z + tl.arange(0, BLOCK_Z)
    t = tl.arange(0, BLOCK_T)
    volume_valid = t < n_volumes
    z_valid = z < n_z
    valid = z_valid[:, None] & volume_valid[None, :]
    rows = line * n_z + z
    x = tl.load(volume_ptr + rows[:, None] * n_volumes + t[None, :], mask=valid, other=0.0)
    mean = tl.sum(x, axis=1) / n_volumes
    x = tl.where(valid, x - mean[:, None], 0.0)
    restored = tl.zeros((BLOCK_Z, BLOCK_T), dtype=tl.float32)
    tile = volume_valid[:, None] & volume_valid[None, :]
    offsets = t[:, None] * n_volumes + t[None, :]
    for window in range(tl.load(lowest_ptr + block), tl.load(highest_ptr + block)):
        z0 = tl.load(corner_ptr + window)
        inside = (z >= z0) & (z < z0 + extent)
        spread = tl.load(spread_ptr + (line * n_windows + window) * width + offsets, mask=tile, other=0.0)
        restored = tl.dot(tl.where(inside[:, None], x, 0.0), spread, restored, input_precision=DOT)
    # the voxel's sums of w, w sigma, w rank over its windows (``spread``), added into the maps here too
    weight = tl.load(maps_ptr + rows * 3, mask=z_valid, other=0.0)
    restored += mean[:, None] * weight[:, None]
    image = image_ptr + rows[:, None] * n_volumes + t[None, :]
    tl.store(image, tl.load(image, mask=valid, other=0.0) + restored, mask=valid)
    tl.store(weight_ptr + rows, tl.load(weight_ptr + rows, mask=z_valid, other=0.0) + weight, mask=z_valid)
    tl.store(sigma_ptr + rows, tl.load(sigma_ptr + rows, mask=z_valid, other=0.0)
             + tl.load(maps_ptr + rows * 3 + 1, mask=z_valid, other=0.0), mask=z_valid)
    tl.store(rank_ptr + rows, tl.load(rank_ptr + rows, mask=z_valid, other=0.0)
             + tl.load(maps_ptr + rows * 3 + 2, mask=z_valid, other=0.0), mask=z_valid)


def applies(plan, options, finite, n_volumes, dtype, fused) -> bool:
    """Whether a run's first pass can take the box sums: voxel demeaning, weighted or uniform aggregation,
    the fused kernels' shapes in float32 with T <= ``MAX_VOLUMES``, a stride > 1 grid with every window
    active, and every voxel finite (``finite``: the host's (X, Y, Z) flags)."""
    grid = [len(window_positions(s, e, plan.stride)) for s, e in zip(plan.spatial_shape, plan.extent)]
    return (options.demean == "voxel" and options.aggregation != "center" and fused and dtype == torch.float32
            and n_volumes <= MAX_VOLUMES and plan.stride > 1 and plan.n_windows == int(np.prod(grid))
            and bool(np.all(finite)))


def scratch_bytes(plan, n_volumes, planes=None) -> int:
    """Device memory the box sums of a slab of ``planes`` x-planes (default all) take beside the sums."""
    nx, ny, nz = plan.spatial_shape
    nx = min(nx, planes + plan.extent[0] - 1) if planes else nx
    a, b, c = (len(window_positions(s, e, plan.stride)) for s, e in zip((nx, ny, nz), plan.extent))
    # S1 (also R), S2 (also the x-spread), Q and G, in T x T blocks; the maps
    blocks = nx * ny * c + nx * b * c + 2 * a * b * c
    return 4 * (blocks * n_volumes * n_volumes + 3 * nx * ny * nz)


def _cover(corners, extent, size):
    """For each index 0..size-1 along an axis: the first window holding it and how many do (windows sorted)."""
    index = np.arange(size)
    first = np.searchsorted(corners + extent, index, side="right")
    stop = np.searchsorted(corners, index, side="right")
    return first, stop - first


#: The device tables of the last few slab geometries (``_geometry``), kept across runs: a dataset's runs share
#: one geometry, and each table's upload is a few CUDA calls of the set-up before the first kernel.
GEOMETRY_CACHE = 4
_geometries = {}


def _geometry(plan, slab, device):
    """The slab's grid of windows (a, b, c) and its tables on ``device``: per axis, the runs of rows each sum
    reads (a window's extent of rows from its corner: the Gram) and the run of windows holding each row (the
    reconstruction's spread); the z-windows each block of ``BLOCK_Z`` voxels meets (``_apply_kernel``); and
    on the host, the x-plane after each corner's windows along x (``gram_in_parts``).
    Cached by the plan's geometry and the slab's bounds (the windows of a full grid follow from them)."""
    if device.type == "cuda" and device.index is None:  # the GPU "cuda" means now
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), plan.spatial_shape, plan.extent, plan.stride, slab.windows.start, slab.windows.stop,
           slab.first, slab.stop)
    if key in _geometries:
        return _geometries[key]
    _, ny, nz = plan.spatial_shape
    shape = (slab.stop - slab.first, ny, nz)
    corner_x = np.unique(plan.window_corner[slab.windows, 0]) - slab.first
    corners = [corner_x] + [window_positions(s, e, plan.stride) for s, e in zip((ny, nz), plan.extent[1:])]
    grid = tuple(len(c) for c in corners)
    if int(np.prod(grid)) != slab.windows.stop - slab.windows.start:
        raise ValueError("the box sums take a slab whose windows are a full grid")

    def on_device(*arrays):
        return tuple(to_device(np.asarray(a, dtype=np.int32), device) for a in arrays)

    windows = [on_device(c, np.full(len(c), e)) for c, e in zip(corners, plan.extent)]
    cover = [on_device(*_cover(c, e, s)) for c, e, s in zip(corners, plan.extent, shape)]
    starts = np.arange(0, nz, BLOCK_Z)
    stops = np.minimum(starts + BLOCK_Z, nz)
    lowest = np.searchsorted(corners[2] + plan.extent[2], starts, side="right")
    highest = np.searchsorted(corners[2], stops - 1, side="right")
    while len(_geometries) >= GEOMETRY_CACHE:
        _geometries.pop(next(iter(_geometries)))
    _geometries[key] = grid, windows, cover, on_device(lowest, highest), corners[0] + plan.extent[0]
    return _geometries[key]


class BoxSums:
    """One slab's windows (a full grid of corners) by box sums: ``gram(volume)`` (W, T, T) in the plan's
    window order; then ``add_windows`` per batch (the weighted projectors and scalars), ``accumulate`` once
    (``spread`` first to run its first half earlier).
    The geometry's tables and the scratch are set up at construction, before the slab's (V, T) float32
    ``volume`` need be on the device (its upload runs meanwhile)."""

    def __init__(self, plan, slab, n_volumes, device, dot_precision=None):
        self.dot = dict(DOT_PRECISION, **(dot_precision or {}))  # per kernel: "outer", "apply"
        if set(self.dot) != set(DOT_PRECISION) or not set(self.dot.values()) <= set(kernels.DOT_PRECISIONS):
            raise ValueError(f"dot_precision maps 'outer' and 'apply' to one of {kernels.DOT_PRECISIONS}, "
                             f"not {dot_precision!r}")
        _, ny, nz = plan.spatial_shape
        nx = slab.stop - slab.first
        self.shape, self.extent, self.n_volumes = (nx, ny, nz), plan.extent, n_volumes
        self.grid, self.windows, self.cover, self.z_blocks, self.x_corner_ends = _geometry(plan, slab,
                                                                                         torch.device(device))
        a, b, c = self.grid
        self.width = self.n_volumes ** 2  # floats per T x T block
        # (every window's place is written by the first pass's batches before anything reads it)
        self.projectors = torch.empty((a * b * c, self.width), dtype=torch.float32, device=device)
        self.scalars = torch.empty((a * b * c, 3), dtype=torch.float32, device=device)
        self._lines = torch.empty((nx * ny * c, self.width), dtype=torch.float32, device=device)  # S1, then R
        self._planes = torch.empty((nx * b * c, self.width), dtype=torch.float32, device=device)  # S2, x-spread
        self._voxel_maps = None  # (V, 3) w, w sigma, w rank per voxel, once ``spread``

    def gram(self, volume, arrivals=()):
        """The Gram matrices (W, T, T) float32 of every window, in the plan's order (x, then y, then z), of
        the slab's ``volume`` (its rows, (V, T) float32); ``arrivals`` as for ``gram_in_parts``."""
        for _ in self.gram_in_parts(volume, arrivals):
            pass
        return self.grams

    def gram_in_parts(self, volume, arrivals=()):
        """Queue the Gram matrices of every window into ``self.grams`` (W, T, T) as the slab's rows arrive,
        yielding the number of windows (in the plan's order) whose Gram is queued so far each time it grows.
        ``arrivals``: while the rows are arriving, the number of whole rows there so far after each part;
        the outer products of the lines there and the y-sums of the x-planes there are queued then, and the
        x-sums of the windows all of whose planes are there; the rest once it is exhausted."""
        (nx, ny, nz), ez, (a, b, c), width = self.shape, self.extent[2], self.grid, self.width
        m = self.n_volumes
        z_corners = self.windows[2][0]
        self.grams = torch.empty((a * b * c, m, m), dtype=torch.float32, device=volume.device)
        grams = self.grams.view(a * b * c, width)
        x_starts, x_counts = self.windows[0]
        # lines whose outer products, x-planes whose y-sums, corners along x whose windows' x-sums are queued
        lines_done = planes_done = corners_done = 0
        for stop in _then_all(arrivals, nx * ny * nz):
            lines = min(stop // nz, nx * ny)
            if lines > lines_done:
                _outer_sums_kernel[(c * (lines - lines_done),)](
                    volume, z_corners, self._lines, lines_done, c, width, nz, m, ez, DOT=self.dot["outer"],
                    BLOCK_E=max(16, triton.next_power_of_2(ez)), BLOCK_T=kernels.block_volumes(m), num_warps=4)
                lines_done = lines
            planes = lines // ny
            if planes > planes_done:  # (the planes' rows of S1 and S2 as tensors of their own)
                _range_sums(self._lines[planes_done * ny * c:planes * ny * c], self.windows[1],
                            self._planes[planes_done * b * c:planes * b * c], planes - planes_done, ny, b, c * width)
                planes_done = planes
            corners = int(np.searchsorted(self.x_corner_ends, planes, side="right"))
            if corners > corners_done:
                _range_sums(self._planes, (x_starts[corners_done:corners], x_counts[corners_done:corners]),
                            grams[corners_done * b * c:corners * b * c], 1, nx, corners - corners_done,
                            b * c * width)
                corners_done = corners
                yield corners * b * c

    def add_windows(self, windows, projector, weight, sigma, rank):
        """A batch's projectors (B, T, T) and its windows' weight, sigma and rank (B,), for ``accumulate``:
        ``windows`` a slice of the slab's windows or a (B,) tensor of their places (distinct), replacing what
        an earlier batch gave there."""
        self.projectors[windows] = (projector * weight[:, None, None]).reshape(len(weight), -1)
        self.scalars[windows] = torch.stack((weight, weight * sigma, weight * rank), dim=1)

    def spread(self):
        """The first half of ``accumulate``: the windows' weighted projectors and scalars spread back over x
        and y (and the scalars over z), from what ``add_windows`` holds now."""
        (nx, ny, nz), (a, b, c), width = self.shape, self.grid, self.width
        device = self.projectors.device
        _range_sums(self.projectors, self.cover[0], self._planes, 1, a, nx, b * c * width)
        _range_sums(self._planes, self.cover[1], self._lines, nx, b, ny, c * width)
        maps = torch.empty((nx * b * c, 3), dtype=torch.float32, device=device)
        _range_sums(self.scalars, self.cover[0], maps, 1, a, nx, b * c * 3)
        lines = torch.empty((nx * ny * c, 3), dtype=torch.float32, device=device)
        _range_sums(maps, self.cover[1], lines, nx, b, ny, c * 3)
        self._voxel_maps = torch.empty((nx * ny * nz, 3), dtype=torch.float32, device=device)
        _range_sums(lines, self.cover[2], self._voxel_maps, nx * ny, c, nz, 3)

    def accumulate(self, volume, image, weight, sigma, rank, planes_per_piece=None, on_final=None):
        """Add every window's w (X_c P + mean) of the slab's ``volume`` into ``image`` (V, T) and w, w sigma,
        w rank into the maps (V,) (after ``spread``, or spreading first).
        The last step (each voxel's row) runs in pieces of ``planes_per_piece`` x-planes (default all), each
        followed by ``on_final(stop)``: the rows before ``stop`` hold their sums (a caller's download of them
        can run beside the next piece)."""
        if self._voxel_maps is None:
            self.spread()
        (nx, ny, nz), c, width = self.shape, self.grid[2], self.width
        voxels, self._voxel_maps = self._voxel_maps, None
        step = planes_per_piece or nx
        for x0 in range(0, nx, step):
            x1 = min(x0 + step, nx)
            _apply_kernel[(triton.cdiv(nz, BLOCK_Z) * (x1 - x0) * ny,)](
                volume, self._lines, self.windows[2][0], *self.z_blocks, voxels, image, weight, sigma, rank,
                x0 * ny, c, width, nz, self.n_volumes, self.extent[2], DOT=self.dot["apply"], BLOCK_Z=BLOCK_Z,
                BLOCK_T=kernels.block_volumes(self.n_volumes), num_warps=4)
            if on_final is not None:
                on_final(x1 * ny * nz)


def _then_all(arrivals, n_rows):
    """The row counts ``arrivals`` yields, then ``n_rows`` (all of them)."""
    yield from arrivals
    yield n_rows


def _range_sums(source, runs, out, n_outer, n_source_rows, n_out_rows, width):
    """out[p, r] = sum of source[p, start[r] + i] over i < count[r], for ``runs`` = (start, count);
    source (n_outer, n_source_rows, width), out (n_outer, n_out_rows, width)."""
    start, count = runs
    _range_sums_kernel[(n_out_rows * n_outer, triton.cdiv(width, BLOCK_Q))](
        source, start, count, out, n_source_rows, n_out_rows, width, BLOCK_Q=BLOCK_Q, num_warps=4)
