"""Triton kernels of the GPU engine, each next to the small launcher that checks its inputs and picks the grid.

The kernels read patches straight from the volume, a (V, T) float32 matrix with one row per voxel of the
flattened (X, Y, Z) grid: a window is its corner row ``window_base`` plus the precomputed ``voxel_offsets``
(one add per voxel, no div/mod on the hot path; n and T are compile-time constants, so the row stride is a
multiplication by a constant and the voxel loop's trip count is known). No (B, n, T) batch of patches is
ever stored.

* ``gram``: the T x T Gram matrix of each window's patch, centred as ``demean`` says, and the number of
  voxels that took part (finite ones). ``voxel``: each voxel's temporal mean is removed in registers, in
  the same pass. ``volume``: a first pass sums the patch's finite voxels into its mean time course mu
  (stored, (B, T)); the second accumulates the Gram of the centred rows (x - mu, left-out voxels zero).
  Centring before accumulating keeps float32 exact enough on a baseline near 1000, where
  X^T X - n mu mu^T would cancel away the noise.
* ``reconstruct_accumulate``: X_hat = X_c P + mean for every voxel of each window, added with the window's
  weight into the image and weight/sigma/rank sums (``weighted`` and ``uniform`` aggregation).
* ``reconstruct_centres``: the centre row only, written (not added) to its voxel (``center`` aggregation).

These kernels serve the time side (n >= T) with T up to ``MAX_FUSED_VOLUMES``; the pipeline takes other
shapes through batched torch products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..estimators import DEMEANING

#: Largest T the fused kernels take: the T x T tile lives in registers (float32; float64 tiles are half).
MAX_FUSED_VOLUMES = 128
MAX_FUSED_VOLUMES_FP64 = 64
#: How ``tl.dot`` multiplies the float32 tiles of the Gram and reconstruction kernels: "ieee" (float32 FMAs
#: on the CUDA cores) or "tf32x3" (three TF32 tensor-core products per tile, each operand split in a high and
#: a low part: float32-like accuracy at tensor-core rates). Float64 tiles are always "ieee".
DOT_PRECISIONS = ("ieee", "tf32x3")
#: Each kernel's default, as measured on the H200 (part g of the suite, the seed's 12,600 windows of 1331 x 48):
#: the Gram 3.74 ms in "ieee" vs 5.11 in "tf32x3" (its X^T X tile is accumulated over many small chunks),
#: the reconstruction 4.60 vs 3.68 (one X P product per chunk); Gram error 1.9e-6 either way.
DOT_PRECISION = dict(gram="ieee", reconstruct="tf32x3")


def _dot_precision(kernel, dot_precision, dtype=torch.float32):
    """The ``DOT`` a launcher of ``kernel`` ("gram", "reconstruct") passes: the one asked for (default
    ``DOT_PRECISION[kernel]``), "ieee" in float64."""
    dot_precision = dot_precision or DOT_PRECISION[kernel]
    if dot_precision not in DOT_PRECISIONS:
        raise ValueError(f"dot_precision must be one of {DOT_PRECISIONS}, not {dot_precision!r}")
    return "ieee" if dtype == torch.float64 else dot_precision


def block_volumes(n_volumes: int) -> int:
    """The T tile: the next power of two, at least 16 (the smallest matrix-unit operand)."""
    return max(16, triton.next_power_of_2(n_volumes))


def fused_fits(n_voxels: int, n_volumes: int, dtype: torch.dtype) -> bool:
    """Whether the fused kernels take this patch shape in this Gram precision."""
    limit = MAX_FUSED_VOLUMES_FP64 if dtype == torch.float64 else MAX_FUSED_VOLUMES
    return n_voxels >= n_volumes and n_volumes <= limit


def _check_volume(volume, finite):
    if volume.dtype != torch.float32 or volume.ndim != 2 or not volume.is_contiguous():
        raise ValueError("volume must be a contiguous (V, T) float32 tensor")
    if finite.dtype != torch.float32 or finite.shape != volume.shape[:1]:
        raise ValueError("finite must be a (V,) float32 tensor of 0/1")


def _or_placeholder(volume_mean, like):
    """The mean time courses, or an empty tensor where the kernel reads none (demean other than volume)."""
    return volume_mean if volume_mean is not None else like.new_empty(0)


def _check_volume_mean(volume_mean, demean, batch, n_volumes):
    if demean == "volume" and (volume_mean is None or volume_mean.shape != (batch, n_volumes)
                               or volume_mean.dtype != torch.float32 or not volume_mean.is_contiguous()):
        raise ValueError(f"demean 'volume' needs volume_mean, a contiguous ({batch}, {n_volumes}) float32 "
                         "tensor (from gram)")


def _block_voxels(n_volumes: int) -> int:
    """The voxel tile: keep a (BLOCK_N, BLOCK_T) chunk near 4096 elements."""
    return max(16, min(64, 4096 // block_volumes(n_volumes)))


# -- Gram ---------------------------------------------------------------------------------------------------

@triton.jit
def _patch_rows(volume_ptr, voxel_offsets_ptr, base, start, t, volume_valid,
                n_voxels: tl.constexpr, n_volumes: tl.constexpr, BLOCK_N: tl.constexpr):
    """Voxels ``start .. start + BLOCK_N`` of the window at corner row ``base``, read straight from the
    volume: their rows (BLOCK_N,), which of them exist (BLOCK_N,) and their time courses (BLOCK_N, BLOCK_T),
    0 past the patch or past T."""
    i = start + tl.arange(0, BLOCK_N)
    voxel_valid = i < n_voxels
    row = base + tl.load(voxel_offsets_ptr + i, mask=voxel_valid, other=0)
    x = tl.load(volume_ptr + row[:, None] * n_volumes + t[None, :],
                mask=voxel_valid[:, None] & volume_valid[None, :], other=0.0)
    return row, voxel_valid, x

@triton.jit
def _gram_chunk(volume_ptr, finite_ptr, voxel_offsets_ptr, base, start, t, volume_valid,
                n_voxels: tl.constexpr, n_volumes: tl.constexpr, FP64: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_patch_rows``' time courses in the Gram's precision, and which of the voxels take part (finite)."""
    row, voxel_valid, x = _patch_rows(volume_ptr, voxel_offsets_ptr, base, start, t, volume_valid,
                                      n_voxels, n_volumes, BLOCK_N)
    took = tl.load(finite_ptr + row, mask=voxel_valid, other=0.0)
    if FP64:
        x = x.to(tl.float64)
    return x, took


@triton.jit
def _gram_kernel(volume_ptr, finite_ptr, window_base_ptr, voxel_offsets_ptr, gram_ptr, n_took_part_ptr,
                 volume_mean_ptr, count_ptr, n_voxels: tl.constexpr, n_volumes: tl.constexpr,
                 DEMEAN: tl.constexpr, FP64: tl.constexpr, DOT: tl.constexpr, COUNTED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    window = tl.program_id(0)
    if COUNTED:  # only the first *count_ptr windows are asked for
        if window >= tl.load(count_ptr):
            return
    base = tl.load(window_base_ptr + window)  # int64: corner row of this window
    t = tl.arange(0, BLOCK_T)
    volume_valid = t < n_volumes
    if FP64:
        gram = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float64)
    else:
        gram = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    took_part = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if DEMEAN == "volume":
        # first pass: the patch's mean time course over the voxels that take part
        if FP64:
            total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float64)
        else:
            total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        for start in range(0, n_voxels, BLOCK_N):
            x, took = _gram_chunk(volume_ptr, finite_ptr, voxel_offsets_ptr, base, start, t, volume_valid,
                                  n_voxels, n_volumes, FP64, BLOCK_N)
            total += x * took[:, None]
            took_part += took
        n_took_part = tl.sum(took_part, axis=0)
        volume_mean = tl.sum(total, axis=0) / tl.maximum(n_took_part, 1.0)  # (BLOCK_T,), 0 past T
        tl.store(volume_mean_ptr + window.to(tl.int64) * n_volumes + t, volume_mean.to(tl.float32),
                 mask=volume_valid)
    for start in range(0, n_voxels, BLOCK_N):
        # one chunk of the patch: BLOCK_N voxels x all volumes (non-finite voxels hold zeros)
        x, took = _gram_chunk(volume_ptr, finite_ptr, voxel_offsets_ptr, base, start, t, volume_valid,
                              n_voxels, n_volumes, FP64, BLOCK_N)
        if DEMEAN == "voxel":
            mean = tl.sum(x, axis=1) / n_volumes
            x = tl.where(volume_valid[None, :], x - mean[:, None], 0.0)
        if DEMEAN == "volume":
            x = (x - volume_mean[None, :]) * took[:, None]  # left-out voxels stay rows of zeros
        else:
            took_part += took
        gram = tl.dot(tl.trans(x), x, gram, input_precision=DOT, out_dtype=gram.dtype)
    out = gram_ptr + window.to(tl.int64) * n_volumes * n_volumes
    tl.store(out + t[:, None] * n_volumes + t[None, :], gram,
             mask=volume_valid[:, None] & volume_valid[None, :])
    tl.store(n_took_part_ptr + window, tl.sum(took_part, axis=0).to(tl.int32))


def _check_demean(demean):
    if demean not in DEMEANING:
        raise ValueError(f"demean must be one of {DEMEANING}, not {demean!r}")


def gram(volume, finite, window_base, voxel_offsets, *, demean: str, dtype=torch.float32, dot_precision=None,
         count=None):
    """Gram matrices X_c^T X_c (B, T, T) of the windows at ``window_base``, their voxels taking part (B,)
    and, for ``demean="volume"``, each patch's mean time course (B, T) float32 (else None).
    ``dot_precision``: one of ``DOT_PRECISIONS`` (default ``DOT_PRECISION["gram"]``). ``count`` (a device
    integer tensor of one element): only the first ``count`` windows are computed, the rest left unwritten
    (a batch sized before the device knows how many windows it holds, with no synchronisation).

    ``window_base`` (B,) int64: corner row of each window; ``voxel_offsets`` (n,) int32: rows from the
    corner. ``demean``: "none", "voxel" (remove each voxel's temporal mean) or "volume" (remove the mean
    over the patch's finite voxels of each volume). ``dtype`` is the Gram's precision (float64 keeps the
    noise eigenvalues of an undemeaned series on a large baseline).
    """
    _check_volume(volume, finite)
    _check_demean(demean)
    n_voxels, n_volumes = voxel_offsets.numel(), volume.shape[1]
    if not fused_fits(n_voxels, n_volumes, dtype):
        raise ValueError(f"the fused Gram takes n >= T and T <= {MAX_FUSED_VOLUMES}, not n={n_voxels}, "
                         f"T={n_volumes} in {dtype}")
    batch = window_base.numel()
    out = torch.empty((batch, n_volumes, n_volumes), dtype=dtype, device=volume.device)
    n_took_part = torch.empty(batch, dtype=torch.int32, device=volume.device)
    volume_mean = (torch.empty((batch, n_volumes), dtype=torch.float32, device=volume.device)
                   if demean == "volume" else None)
    if batch:
        _gram_kernel[(batch,)](volume, finite, window_base, voxel_offsets, out, n_took_part,
                               _or_placeholder(volume_mean, volume), n_took_part if count is None else count,
                               n_voxels, n_volumes, DEMEAN=demean, FP64=dtype == torch.float64,
                               DOT=_dot_precision("gram", dot_precision, dtype), COUNTED=count is not None,
                               BLOCK_N=_block_voxels(n_volumes),
                               BLOCK_T=block_volumes(n_volumes), num_warps=4)
    return out, n_took_part, volume_mean


# -- reconstruct and accumulate (weighted / uniform) --------------------------------------------------------

@triton.jit
def _reconstruct_accumulate_kernel(volume_ptr, finite_ptr, window_base_ptr, voxel_offsets_ptr, projector_ptr,
                                   volume_mean_ptr, patch_weight_ptr, patch_sigma_ptr, patch_rank_ptr,
                                   image_ptr, weight_ptr, sigma_ptr, rank_ptr,
                                   n_voxels: tl.constexpr, n_volumes: tl.constexpr,
                                   DEMEAN: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_T: tl.constexpr):
    window = tl.program_id(0)
    patch_weight = tl.load(patch_weight_ptr + window)
    if patch_weight != 0:
        base = tl.load(window_base_ptr + window)
        patch_sigma = tl.load(patch_sigma_ptr + window)
        patch_rank = tl.load(patch_rank_ptr + window)
        t = tl.arange(0, BLOCK_T)
        volume_valid = t < n_volumes
        projector = tl.load(projector_ptr + window.to(tl.int64) * n_volumes * n_volumes
                            + t[:, None] * n_volumes + t[None, :],
                            mask=volume_valid[:, None] & volume_valid[None, :], other=0.0).to(tl.float32)
        if DEMEAN == "volume":
            volume_mean = tl.load(volume_mean_ptr + window.to(tl.int64) * n_volumes + t, mask=volume_valid,
                                  other=0.0)
        for start in range(0, n_voxels, BLOCK_N):
            row, voxel_valid, x = _patch_rows(volume_ptr, voxel_offsets_ptr, base, start, t, volume_valid,
                                              n_voxels, n_volumes, BLOCK_N)
            element_valid = voxel_valid[:, None] & volume_valid[None, :]
            # the patch's rows projected on its signal components, the means put back
            if DEMEAN == "voxel":
                mean = tl.sum(x, axis=1) / n_volumes
                x = tl.where(volume_valid[None, :], x - mean[:, None], 0.0)
            if DEMEAN == "volume":
                x -= volume_mean[None, :]
            restored = tl.dot(x, projector, input_precision=DOT)
            if DEMEAN == "voxel":
                restored += mean[:, None]
            if DEMEAN == "volume":
                restored += volume_mean[None, :]
            # voxels that took no part (non-finite) receive nothing
            voxel_weight = patch_weight * tl.load(finite_ptr + row, mask=voxel_valid, other=0.0)
            tl.atomic_add(image_ptr + row[:, None] * n_volumes + t[None, :], restored * voxel_weight[:, None],
                          mask=element_valid, sem="relaxed")
            tl.atomic_add(weight_ptr + row, voxel_weight, mask=voxel_valid, sem="relaxed")
            tl.atomic_add(sigma_ptr + row, voxel_weight * patch_sigma, mask=voxel_valid, sem="relaxed")
            tl.atomic_add(rank_ptr + row, voxel_weight * patch_rank, mask=voxel_valid, sem="relaxed")


def reconstruct_accumulate(volume, finite, window_base, voxel_offsets, projector, patch_weight, patch_sigma,
                           patch_rank, image, weight, sigma, rank, *, demean: str, volume_mean=None,
                           dot_precision=None):
    """Add w * (X_c P + mean) of every window to ``image`` (V, T) and w, w*sigma, w*rank to the maps (V,).

    ``projector`` (B, T, T) float32, or float64 (rounded to float32 as it is read: a settling pass's, whose
    launch is sized for more windows than it holds); ``patch_weight``, ``patch_sigma``, ``patch_rank`` (B,)
    float32 (a window with weight 0 is skipped: a failed eigensolve is redone on the CPU). ``demean`` as for
    ``gram``; with "volume", ``volume_mean`` (B, T) is what ``gram`` returned: X_hat = (X - mu) P + mu.
    ``dot_precision`` as for ``gram`` (default ``DOT_PRECISION["reconstruct"]``).
    """
    _check_volume(volume, finite)
    _check_demean(demean)
    batch, n_volumes = window_base.numel(), volume.shape[1]
    _check_volume_mean(volume_mean, demean, batch, n_volumes)
    if projector.shape != (batch, n_volumes, n_volumes) or projector.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"projector must be ({batch}, {n_volumes}, {n_volumes}) float32 or float64")
    for name, vector in (("patch_weight", patch_weight), ("patch_sigma", patch_sigma),
                         ("patch_rank", patch_rank)):
        if vector.shape != (batch,) or vector.dtype != torch.float32:
            raise ValueError(f"{name} must be ({batch},) float32")
    if batch:
        _reconstruct_accumulate_kernel[(batch,)](
            volume, finite, window_base, voxel_offsets, projector.contiguous(), _or_placeholder(volume_mean, volume),
            patch_weight, patch_sigma, patch_rank, image, weight, sigma, rank, voxel_offsets.numel(), n_volumes,
            DEMEAN=demean, DOT=_dot_precision("reconstruct", dot_precision),
            BLOCK_N=_block_voxels(n_volumes), BLOCK_T=block_volumes(n_volumes), num_warps=4)


# -- the sums divided by their weights --------------------------------------------------------------------

#: Rows per program of ``_divide_rows_kernel``.
DIVIDE_ROWS = 32


@triton.jit
def _divide_rows_kernel(image_ptr, weight_ptr, sigma_ptr, rank_ptr, first, stop, n_volumes,
                        BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = first + tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < stop
    weight = tl.load(weight_ptr + rows, mask=valid, other=1.0)
    divisor = tl.where(weight > 0, weight, 1.0)  # a voxel no window served keeps its sums, 0
    tl.store(sigma_ptr + rows, tl.load(sigma_ptr + rows, mask=valid, other=0.0) / divisor, mask=valid)
    tl.store(rank_ptr + rows, tl.load(rank_ptr + rows, mask=valid, other=0.0) / divisor, mask=valid)
    for t0 in range(0, n_volumes, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        element_valid = valid[:, None] & (t < n_volumes)[None, :]
        image = image_ptr + rows[:, None] * n_volumes + t[None, :]
        tl.store(image, tl.load(image, mask=element_valid, other=0.0) / divisor[:, None], mask=element_valid)


def divide_rows(image, weight, sigma, rank, rows: slice):
    """``image`` (V, T) and the ``sigma`` and ``rank`` maps (V,) divided by ``weight`` in ``rows``, in place
    (rows of weight 0 keep their sums, 0): one launch for what took five torch operations."""
    first, stop = rows.start, rows.stop
    if stop > first:
        n_volumes = image.shape[1]
        _divide_rows_kernel[(triton.cdiv(stop - first, DIVIDE_ROWS),)](
            image, weight, sigma, rank, first, stop, n_volumes, BLOCK_R=DIVIDE_ROWS,
            BLOCK_T=min(64, triton.next_power_of_2(n_volumes)), num_warps=4)


# -- the windows a settling pass redoes, chosen on the device -----------------------------------------------

#: Windows ``_choose_kernel`` looks at per step of its loop.
CHOOSE_BLOCK = 1024


@triton.jit
def _choose_kernel(info_ptr, unsettled_ptr, base_ptr, multiplicity_ptr, n_windows, first, chosen_base_ptr,
                   chosen_multiplicity_ptr, asked_ptr, count_ptr, BLOCK: tl.constexpr):
    """One program: the windows ``first + i`` (i < n_windows) whose ``info`` is not 0 or that are
    ``unsettled``, in order: their base rows and multiplicities compacted to the front, their number, and
    ``asked[j] = j < number``."""
    count = tl.sum(tl.zeros((BLOCK,), dtype=tl.int64), axis=0)
    for start in range(0, n_windows, BLOCK):
        i = start + tl.arange(0, BLOCK)
        valid = i < n_windows
        redo = ((tl.load(info_ptr + i, mask=valid, other=0) != 0)
                | (tl.load(unsettled_ptr + i, mask=valid, other=0) != 0)) & valid
        taken = redo.to(tl.int64)
        place = count + tl.cumsum(taken, axis=0) - 1
        window = first + i
        tl.store(chosen_base_ptr + place, tl.load(base_ptr + window, mask=redo, other=0), mask=redo)
        tl.store(chosen_multiplicity_ptr + place, tl.load(multiplicity_ptr + window, mask=redo, other=0.0), mask=redo)
        count += tl.sum(taken, axis=0)
    tl.store(count_ptr, count)
    for start in range(0, n_windows, BLOCK):
        j = start + tl.arange(0, BLOCK)
        tl.store(asked_ptr + j, j < count, mask=j < n_windows)


def choose_windows(info, unsettled, base, multiplicity, first=0):
    """The windows a settling pass redoes, chosen without the host: of windows ``first`` to ``first + n``
    (``info`` (n,) int32 not 0: a failed eigensolve; ``unsettled`` (n,) bool), their ``base`` rows and
    ``multiplicity`` (the slab's, by window) compacted to the front in order, their ``count`` (a 0-d int64
    tensor) and ``asked`` (n,) bool: the places before the count. The places past the count are left
    unwritten. One launch for what took ~20 torch operations (a sort among them)."""
    n_windows = info.numel()
    device = info.device
    chosen_base = torch.empty(n_windows, dtype=base.dtype, device=device)
    chosen_multiplicity = torch.empty(n_windows, dtype=multiplicity.dtype, device=device)
    asked = torch.empty(n_windows, dtype=torch.bool, device=device)
    count = torch.empty((), dtype=torch.int64, device=device)
    _choose_kernel[(1,)](info, unsettled, base, multiplicity, n_windows, first, chosen_base, chosen_multiplicity,
                         asked, count, BLOCK=CHOOSE_BLOCK, num_warps=4)
    return chosen_base, chosen_multiplicity, asked, count


# -- centre rows (center aggregation) -----------------------------------------------------------------------

@triton.jit
def _reconstruct_centres_kernel(volume_ptr, centre_voxel_ptr, centre_window_ptr, projector_ptr,
                                volume_mean_ptr, patch_weight_ptr, patch_sigma_ptr, patch_rank_ptr,
                                image_ptr, weight_ptr, sigma_ptr, rank_ptr, n_volumes: tl.constexpr,
                                DEMEAN: tl.constexpr, BLOCK_T: tl.constexpr):
    centre = tl.program_id(0)
    voxel = tl.load(centre_voxel_ptr + centre)  # int64 row of the centre voxel
    window = tl.load(centre_window_ptr + centre)  # its window within the batch
    t = tl.arange(0, BLOCK_T)
    volume_valid = t < n_volumes
    x = tl.load(volume_ptr + voxel * n_volumes + t, mask=volume_valid, other=0.0)
    if DEMEAN == "voxel":
        mean = tl.sum(x, axis=0) / n_volumes
        x = tl.where(volume_valid, x - mean, 0.0)
    if DEMEAN == "volume":
        mean = tl.load(volume_mean_ptr + window.to(tl.int64) * n_volumes + t, mask=volume_valid, other=0.0)
        x -= mean
    projector = tl.load(projector_ptr + window.to(tl.int64) * n_volumes * n_volumes
                        + t[:, None] * n_volumes + t[None, :],
                        mask=volume_valid[:, None] & volume_valid[None, :], other=0.0)
    # the centre's own row projected on its window's signal components
    restored = tl.sum(x[:, None] * projector, axis=0)
    if DEMEAN != "none":
        restored += mean
    patch_weight = tl.load(patch_weight_ptr + window)
    tl.store(image_ptr + voxel * n_volumes + t, restored * patch_weight, mask=volume_valid)
    tl.store(weight_ptr + voxel, patch_weight)
    tl.store(sigma_ptr + voxel, patch_weight * tl.load(patch_sigma_ptr + window))
    tl.store(rank_ptr + voxel, patch_weight * tl.load(patch_rank_ptr + window))


def reconstruct_centres(volume, centre_voxel, centre_window, projector, patch_weight, patch_sigma, patch_rank,
                        image, weight, sigma, rank, *, demean: str, volume_mean=None):
    """Write each centre voxel's own denoised row and its window's sigma and rank (``center`` aggregation).

    ``centre_voxel`` (C,) int64 rows; ``centre_window`` (C,) int32 index of each centre's window in the
    batch; ``patch_weight`` (B,) float32 is 1, or 0 for a window left to the CPU. ``demean`` and
    ``volume_mean`` as for ``reconstruct_accumulate``.
    """
    _check_demean(demean)
    n_volumes = volume.shape[1]
    _check_volume_mean(volume_mean, demean, projector.shape[0], n_volumes)
    if centre_voxel.shape != centre_window.shape:
        raise ValueError("centre_voxel and centre_window must have the same length")
    if projector.dtype != torch.float32 or projector.shape[1:] != (n_volumes, n_volumes):
        raise ValueError(f"projector must be (B, {n_volumes}, {n_volumes}) float32")
    if centre_voxel.numel():
        _reconstruct_centres_kernel[(centre_voxel.numel(),)](
            volume, centre_voxel, centre_window, projector.contiguous(), _or_placeholder(volume_mean, volume),
            patch_weight, patch_sigma, patch_rank,
            image, weight, sigma, rank, n_volumes, DEMEAN=demean, BLOCK_T=block_volumes(n_volumes),
            num_warps=4 if n_volumes > 64 else 2)
