"""Gram matrices and reconstruction of a whole grid of windows by separable box sums (voxel demeaning).

With voxel demeaning, a window's Gram is a sum over its voxels of each voxel's own outer product,
G_W = sum_{v in W} x_v x_v^T (x_v: the voxel's centred time course), and its reconstruction adds, to each
voxel it holds, w_W x_v P_W + w_W m_v (m_v: the voxel's mean). When the windows are boxes on a grid (stride
> 1, every window active: ``applies``), both sums are separable along the three axes. The fused kernels
(``gram.gram``, ``reconstruction.reconstruct_accumulate``) instead compute each window's X^T X and X P from its
n voxels: 2 n T^2 multiply-adds per window each, ~49 windows over every voxel at the seed's 11^3 stride 3, and
every output element added with an atomic.

Here, for windows at corners (a, b, c) of extent (ex, ey, ez) on a (X, Y, Z) slab of rows:

* Gram: ``_slice_grams_kernel`` forms, for each x-plane, the Gram of each window's slice there (its ey x ez
  voxels, the voxel's mean removed in registers; ``tl.dot`` over the voxels): S2 (X, B, C, T, T); then
  ``_range_sums_kernel`` sums ex consecutive x-planes (G (A, B, C, T, T): the windows in the plan's order).
  Each voxel's outer product is formed once per (y, z)-window pair holding it (~(ez / stride) (ey / stride)
  times), not once per window (~(ez / stride)^3 times).
* Reconstruction: the adjoint. The projectors scaled by their window's weight, Q (A, B, C, T, T), are spread
  back over x (``_range_sums_kernel`` again: each plane sums the run of windows holding it) and over y, giving
  R (X, Y, C, T, T); ``_apply_kernel`` then adds to each voxel x_v (sum over its z-windows c of R[x, y, c])
  + m_v sum_W w_W, and the voxel's sums of w, w sigma, w rank to the maps. No atomics: every voxel is written
  by one program. The windows' (w, w sigma, w rank)
  go through the same spreads over x and y; ``_apply_kernel`` adds each voxel's z-windows' sums.

Float32 throughout: the sums are in a tree (ey ez, then ex terms) rather than one running sum, and
the centring happens per voxel before any product, as in the fused Gram kernel.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..patches import window_positions
from .gram import block_volumes
from .upload import to_device

#: Largest T the box sums take (their T x T tiles, and the per-window buffers of T^2 floats per line).
MAX_VOLUMES = 64
#: Elements of a row (T x T blocks side by side) each program of ``_range_sums_kernel`` adds up.
BLOCK_Q = 1024
#: Voxels along z per program of ``_apply_kernel``.
BLOCK_Z = 16
#: How ``tl.dot`` multiplies in the slices' Gram kernel ("ieee": float32 products, faster there than
#: "tf32x3") and in the apply kernel ("tf32x3": three TF32 tensor-core products, faster there); the Gram
#: stays within 1.8e-6 of float64 and the sums within 1.2e-7 of the fused kernels' either way.
GRAM_DOT = "ieee"
APPLY_DOT = "tf32x3"


@triton.jit
def _slice_grams_kernel(volume_ptr, y_corner_ptr, z_corner_ptr, out_ptr, first_plane, n_b, n_c,
                        n_y: tl.constexpr, n_z: tl.constexpr, n_volumes: tl.constexpr, extent_y: tl.constexpr,
                        extent_z: tl.constexpr, DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_A: tl.constexpr,
                        BLOCK_B: tl.constexpr):
    """S2[x, b, c]: the Gram of the ey x ez voxels of window (b, c)'s slice in x-plane x (each voxel's mean
    removed in registers), BLOCK_R voxels at a time. The T columns as two blocks, BLOCK_A and (T > BLOCK_A)
    BLOCK_B wide: the Gram's blocks AA, AB and BB, BA stored as AB's transpose (at T = 48, 32 + 16 columns:
    1792 products a voxel instead of 4096 for one block padded to 64)."""
    program = tl.program_id(0).to(tl.int64)  # the z-window varies fastest, then the y-window: neighbours share rows
    window_c = program % n_c
    window_b = (program // n_c) % n_b
    plane = first_plane + program // (n_c * n_b)
    y0 = tl.load(y_corner_ptr + window_b)
    z0 = tl.load(z_corner_ptr + window_c)
    ta = tl.arange(0, BLOCK_A)
    valid_a = ta < n_volumes
    gram_aa = tl.zeros((BLOCK_A, BLOCK_A), dtype=tl.float32)
    if BLOCK_B > 0:
        tb = BLOCK_A + tl.arange(0, BLOCK_B)
        valid_b = tb < n_volumes
        gram_ab = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        gram_bb = tl.zeros((BLOCK_B, BLOCK_B), dtype=tl.float32)
    n_rows: tl.constexpr = extent_y * extent_z
    for start in range(0, n_rows, BLOCK_R):
        e = start + tl.arange(0, BLOCK_R)
        voxel = e < n_rows
        rows = (plane * n_y + y0 + e // extent_z) * n_z + z0 + e % extent_z
        xa = tl.load(volume_ptr + rows[:, None] * n_volumes + ta[None, :], mask=voxel[:, None] & valid_a[None, :],
                     other=0.0)
        total = tl.sum(xa, axis=1)
        if BLOCK_B > 0:
            xb = tl.load(volume_ptr + rows[:, None] * n_volumes + tb[None, :],
                         mask=voxel[:, None] & valid_b[None, :], other=0.0)
            total += tl.sum(xb, axis=1)
        mean = total / n_volumes
        xa = tl.where(voxel[:, None] & valid_a[None, :], xa - mean[:, None], 0.0)
        gram_aa = tl.dot(tl.trans(xa), xa, gram_aa, input_precision=DOT)
        if BLOCK_B > 0:
            xb = tl.where(voxel[:, None] & valid_b[None, :], xb - mean[:, None], 0.0)
            gram_ab = tl.dot(tl.trans(xa), xb, gram_ab, input_precision=DOT)
            gram_bb = tl.dot(tl.trans(xb), xb, gram_bb, input_precision=DOT)
    out = out_ptr + ((plane * n_b + window_b) * n_c + window_c) * n_volumes * n_volumes
    tl.store(out + ta[:, None] * n_volumes + ta[None, :], gram_aa, mask=valid_a[:, None] & valid_a[None, :])
    if BLOCK_B > 0:
        tl.store(out + ta[:, None] * n_volumes + tb[None, :], gram_ab, mask=valid_a[:, None] & valid_b[None, :])
        tl.store(out + tb[None, :] * n_volumes + ta[:, None], gram_ab, mask=valid_a[:, None] & valid_b[None, :])
        tl.store(out + tb[:, None] * n_volumes + tb[None, :], gram_bb, mask=valid_b[:, None] & valid_b[None, :])


def _column_blocks(n_volumes):
    """(BLOCK_A, BLOCK_B) of ``_slice_grams_kernel``: T's columns as a power of two up to 32 and the rest
    (0: none)."""
    if n_volumes <= 32:
        return max(16, triton.next_power_of_2(n_volumes)), 0
    return 32, max(16, triton.next_power_of_2(n_volumes - 32))


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
    # and the voxel's sums of w, w sigma, w rank over its windows (``maps``: each z-window's sums over x and y)
    weight = tl.zeros((BLOCK_Z,), dtype=tl.float32)
    weighted_sigma = tl.zeros((BLOCK_Z,), dtype=tl.float32)
    weighted_rank = tl.zeros((BLOCK_Z,), dtype=tl.float32)
    for window in range(tl.load(lowest_ptr + block), tl.load(highest_ptr + block)):
        z0 = tl.load(corner_ptr + window)
        inside = (z >= z0) & (z < z0 + extent)
        spread = tl.load(spread_ptr + (line * n_windows + window) * width + offsets, mask=tile, other=0.0)
        restored = tl.dot(tl.where(inside[:, None], x, 0.0), spread, restored, input_precision=DOT)
        sums = maps_ptr + (line * n_windows + window) * 3
        weight += tl.where(inside, tl.load(sums), 0.0)
        weighted_sigma += tl.where(inside, tl.load(sums + 1), 0.0)
        weighted_rank += tl.where(inside, tl.load(sums + 2), 0.0)
    restored += mean[:, None] * weight[:, None]
    image = image_ptr + rows[:, None] * n_volumes + t[None, :]
    tl.store(image, tl.load(image, mask=valid, other=0.0) + restored, mask=valid)
    tl.store(weight_ptr + rows, tl.load(weight_ptr + rows, mask=z_valid, other=0.0) + weight, mask=z_valid)
    tl.store(sigma_ptr + rows, tl.load(sigma_ptr + rows, mask=z_valid, other=0.0) + weighted_sigma, mask=z_valid)
    tl.store(rank_ptr + rows, tl.load(rank_ptr + rows, mask=z_valid, other=0.0) + weighted_rank, mask=z_valid)


def applies(plan, options, finite, n_volumes, dtype, fused) -> bool:
    """Whether a run's first pass can take the box sums: cuboid patches, voxel demeaning, weighted or uniform
    aggregation, the fused kernels' shapes in float32 with T <= ``MAX_VOLUMES``, a stride > 1 grid with every
    window active, and every voxel finite (``finite``: the host's (X, Y, Z) flags). A sphere is not a
    separable box (its Gram is no product of sums along x, y and z), so it takes the fused kernels."""
    grid = [len(window_positions(s, e, plan.stride)) for s, e in zip(plan.spatial_shape, plan.extent)]
    return (not plan.sphere and options.demean == "voxel" and options.aggregation in ("weighted", "uniform") and fused
            and dtype == torch.float32 and n_volumes <= MAX_VOLUMES and plan.stride > 1
            and plan.n_windows == int(np.prod(grid)) and bool(np.all(finite)))


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
    reads (a window's extent of rows from its corner: the Gram), along x and y the run of windows holding each
    row (the reconstruction's spread); the z-windows each block of ``BLOCK_Z`` voxels meets (``_apply_kernel``); and
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
    cover = [on_device(*_cover(c, e, s)) for c, e, s in zip(corners[:2], plan.extent[:2], shape[:2])]  # x, y
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

    def __init__(self, plan, slab, n_volumes, device):
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
        self._lines = torch.empty((nx * ny * c, self.width), dtype=torch.float32, device=device)  # R
        self._planes = torch.empty((nx * b * c, self.width), dtype=torch.float32, device=device)  # S2, x-spread
        self._maps = torch.empty((nx * b * c, 3), dtype=torch.float32, device=device)  # scalars' x-spread
        self._line_maps = torch.empty((nx * ny * c, 3), dtype=torch.float32, device=device)  # and y-spread
        self.planes_spread = 0  # x-planes ``spread`` has queued

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
        the slices' Grams of the x-planes there are queued then, and the x-sums of the windows all of whose
        planes are there; the rest once it is exhausted."""
        (nx, ny, nz), (a, b, c), width, m = self.shape, self.grid, self.width, self.n_volumes
        self.grams = torch.empty((a * b * c, m, m), dtype=torch.float32, device=volume.device)
        grams = self.grams.view(a * b * c, width)
        x_starts, x_counts = self.windows[0]
        planes_done = corners_done = 0  # x-planes whose slices' Grams, corners along x whose windows' are queued
        for stop in _then_all(arrivals, nx * ny * nz):
            planes = min(stop // (ny * nz), nx)
            if planes > planes_done:
                _slice_grams_kernel[(c * b * (planes - planes_done),)](
                    volume, self.windows[1][0], self.windows[2][0], self._planes, planes_done, b, c, ny, nz, m,
                    self.extent[1], self.extent[2], GRAM_DOT, 32, *_column_blocks(m), num_warps=4)
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

    def final_planes(self, windows=None) -> int:
        """The x-planes before the first corner along x after the first ``windows`` windows in the plan's
        order (default: every window, every plane): no later window holds them."""
        corners = self.grid[0] if windows is None else min(windows // (self.grid[1] * self.grid[2]), self.grid[0])
        return self.shape[0] if corners == self.grid[0] else int(self.x_corner_ends[corners]) - self.extent[0]

    def spread(self, windows=None):
        """The first half of ``accumulate``: the windows' weighted projectors and scalars spread back over x
        and y (the last spread, over z, is ``_apply_kernel``'s), for the x-planes not spread yet all of whose
        windows are among the first ``windows`` in the plan's order (``final_planes``). ``add_windows``
        must not change a window of a plane once spread (until ``accumulate`` has run)."""
        (_, ny, _), (a, b, c), width = self.shape, self.grid, self.width
        first, stop = self.planes_spread, self.final_planes(windows)
        if stop <= first:
            return
        x_runs = tuple(table[first:stop] for table in self.cover[0])
        _range_sums(self.projectors, x_runs, self._planes[first * b * c:stop * b * c], 1, a, stop - first,
                    b * c * width)
        _range_sums(self._planes[first * b * c:stop * b * c], self.cover[1], self._lines[first * ny * c:stop * ny * c],
                    stop - first, b, ny, c * width)
        _range_sums(self.scalars, x_runs, self._maps[first * b * c:stop * b * c], 1, a, stop - first, b * c * 3)
        _range_sums(self._maps[first * b * c:stop * b * c], self.cover[1],
                    self._line_maps[first * ny * c:stop * ny * c], stop - first, b, ny, c * 3)
        self.planes_spread = stop

    def accumulate(self, volume, image, weight, sigma, rank):
        """Add every window's w (X_c P + mean) of the slab's ``volume`` into ``image`` (V, T) and w, w sigma,
        w rank into the maps (V,) (spreading first what ``spread`` has not): ``apply`` over every plane."""
        self.spread()
        self.planes_spread = 0  # (for another run of the box)
        self.apply(volume, image, weight, sigma, rank, 0, self.shape[0])

    def apply(self, volume, image, weight, sigma, rank, first_plane, stop_plane, planes_per_piece=None,
              on_final=None):
        """The last step of ``accumulate`` for the x-planes ``first_plane`` to ``stop_plane`` (spread already):
        each voxel's row gets its windows' sums, in pieces of ``planes_per_piece`` x-planes (default all),
        each followed by ``on_final(stop)``: the rows before ``stop`` hold their sums (a caller's download of
        them can run beside the next piece)."""
        (_, ny, nz), c, width = self.shape, self.grid[2], self.width
        step = planes_per_piece or max(stop_plane - first_plane, 1)
        for x0 in range(first_plane, stop_plane, step):
            x1 = min(x0 + step, stop_plane)
            _apply_kernel[(triton.cdiv(nz, BLOCK_Z) * (x1 - x0) * ny,)](
                volume, self._lines, self.windows[2][0], *self.z_blocks, self._line_maps, image, weight, sigma, rank,
                x0 * ny, c, width, nz, self.n_volumes, self.extent[2], DOT=APPLY_DOT, BLOCK_Z=BLOCK_Z,
                BLOCK_T=block_volumes(self.n_volumes), num_warps=4)
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
