"""The Gram matrices of windows read straight from the series: the fused Triton kernel, and the gathered path.

The series on the device is a (V, T) float32 matrix with one row per voxel of the flattened (X, Y, Z) grid: a
window is its corner row ``window_base`` plus the precomputed ``voxel_offsets`` (one add per voxel, no div/mod
on the hot path; n and T are compile-time constants, so the row stride is a multiplication by a constant and
the voxel loop's trip count is known). No (B, n, T) batch of patches is ever stored.

``gram``: the T x T Gram matrix X_c^T X_c of each window's patch (time side, n >= T, T up to
``MAX_FUSED_VOLUMES``), centred as ``demean`` says, and the number of voxels that took part (finite ones).
``voxel``: each voxel's temporal mean is removed in registers, in the same pass. ``volume``: a first pass
sums the patch's finite voxels into its mean time course mu (returned, (B, T)); the second accumulates the
Gram of the centred rows (x - mu, left-out voxels zero). Centring before accumulating keeps float32 exact
enough on a baseline near 1000, where X^T X - n mu mu^T would cancel away the noise.

``gather_gram``: the other shapes (voxel side when n < T, long series): the patches gathered into a (B, n, T)
batch and multiplied by torch (cuBLAS, IEEE float32/float64).

``reconstruction`` reads patches with the same tiles (``patch_rows``, ``block_volumes``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..estimators import DEMEANING

#: Largest T the fused kernels take: the T x T tile lives in registers (float32; float64 tiles are half).
MAX_FUSED_VOLUMES = 128
MAX_FUSED_VOLUMES_FP64 = 64


def block_volumes(n_volumes: int) -> int:
    """The T tile: the next power of two, at least 16 (the smallest matrix-unit operand)."""
    return max(16, triton.next_power_of_2(n_volumes))


def block_voxels(n_volumes: int) -> int:
    """The voxel tile: keep a (BLOCK_N, BLOCK_T) chunk near 4096 elements."""
    return max(16, min(64, 4096 // block_volumes(n_volumes)))


def fused_fits(n_voxels: int, n_volumes: int, dtype: torch.dtype) -> bool:
    """Whether the fused kernels take this patch shape in this Gram precision."""
    limit = MAX_FUSED_VOLUMES_FP64 if dtype == torch.float64 else MAX_FUSED_VOLUMES
    return n_voxels >= n_volumes and n_volumes <= limit


def check_volume(volume, finite):
    if volume.dtype != torch.float32 or volume.ndim != 2 or not volume.is_contiguous():
        raise ValueError("volume must be a contiguous (V, T) float32 tensor")
    if finite.dtype != torch.float32 or finite.shape != volume.shape[:1]:
        raise ValueError("finite must be a (V,) float32 tensor of 0/1")


def check_demean(demean):
    if demean not in DEMEANING:
        raise ValueError(f"demean must be one of {DEMEANING}, not {demean!r}")


def check_volume_mean(volume_mean, demean, batch, n_volumes):
    if demean == "volume" and (volume_mean is None or volume_mean.shape != (batch, n_volumes)
                               or volume_mean.dtype != torch.float32 or not volume_mean.is_contiguous()):
        raise ValueError(f"demean 'volume' needs volume_mean, a contiguous ({batch}, {n_volumes}) float32 "
                         "tensor (from gram)")


def or_placeholder(volume_mean, like):
    """The mean time courses, or an empty tensor where the kernel reads none (demean other than volume)."""
    return volume_mean if volume_mean is not None else like.new_empty(0)


@triton.jit
def patch_rows(volume_ptr, voxel_offsets_ptr, base, start, t, volume_valid,
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
    """``patch_rows``' time courses in the Gram's precision, and which of the voxels take part (finite)."""
    row, voxel_valid, x = patch_rows(volume_ptr, voxel_offsets_ptr, base, start, t, volume_valid,
                                     n_voxels, n_volumes, BLOCK_N)
    took = tl.load(finite_ptr + row, mask=voxel_valid, other=0.0)
    if FP64:
        x = x.to(tl.float64)
    return x, took


@triton.jit
def _gram_kernel(volume_ptr, finite_ptr, window_base_ptr, voxel_offsets_ptr, gram_ptr, n_took_part_ptr,
                 volume_mean_ptr, count_ptr, n_voxels: tl.constexpr, n_volumes: tl.constexpr,
                 DEMEAN: tl.constexpr, FP64: tl.constexpr, COUNTED: tl.constexpr,
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
        # "ieee": the Gram sums many small chunks, where tf32x3 was slower and no more accurate
        gram = tl.dot(tl.trans(x), x, gram, input_precision="ieee", out_dtype=gram.dtype)
    out = gram_ptr + window.to(tl.int64) * n_volumes * n_volumes
    tl.store(out + t[:, None] * n_volumes + t[None, :], gram,
             mask=volume_valid[:, None] & volume_valid[None, :])
    tl.store(n_took_part_ptr + window, tl.sum(took_part, axis=0).to(tl.int32))


def gram(volume, finite, window_base, voxel_offsets, *, demean: str, dtype=torch.float32, count=None):
    """Gram matrices X_c^T X_c (B, T, T) of the windows at ``window_base``, their voxels taking part (B,)
    and, for ``demean="volume"``, each patch's mean time course (B, T) float32 (else None). ``count`` (a
    device integer tensor of one element): only the first ``count`` windows are computed, the rest left
    unwritten (a batch sized before the device knows how many windows it holds, with no synchronisation).

    ``window_base`` (B,) int64: corner row of each window; ``voxel_offsets`` (n,) int32: rows from the
    corner. ``demean``: "none", "voxel" (remove each voxel's temporal mean) or "volume" (remove the mean
    over the patch's finite voxels of each volume). ``dtype`` is the Gram's precision (float64 keeps the
    noise eigenvalues of an undemeaned series on a large baseline).
    """
    check_volume(volume, finite)
    check_demean(demean)
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
                               or_placeholder(volume_mean, volume), n_took_part if count is None else count,
                               n_voxels, n_volumes, DEMEAN=demean, FP64=dtype == torch.float64,
                               COUNTED=count is not None,
                               BLOCK_N=block_voxels(n_volumes),
                               BLOCK_T=block_volumes(n_volumes), num_warps=4)
    return out, n_took_part, volume_mean


def gather_gram(volume, finite, window_base, voxel_offsets, demean, dtype, time_side):
    """The Gram matrices of patches gathered into (B, n, T), centred, by a batched product.

    Returns (gram, patches, means, took_part, voxels): ``means`` is (B, n, 1) for voxel demeaning, (B, 1, T)
    for volume demeaning (over the finite voxels; left-out voxels stay rows of zeros), else None, so that
    X_hat = X_c P + means, as in ``cpu.fit_windows``; ``time_side``: the T x T Gram (n >= T), else n x n.
    """
    voxels = window_base[:, None] + voxel_offsets[None, :].to(torch.int64)
    patches = volume[voxels].to(dtype)
    took_part = finite[voxels]
    means = None
    if demean == "voxel":
        means = patches.mean(dim=2, keepdim=True)
        patches = patches - means
    elif demean == "volume":  # in place: the gathered patches are this function's own copy
        took = took_part.to(dtype)[:, :, None]
        patches.mul_(took)
        means = patches.sum(dim=1, keepdim=True) / took.sum(dim=1, keepdim=True).clamp(min=1)
        patches.addcmul_(took, means, value=-1)
    gram = patches.mT @ patches if time_side else patches @ patches.mT
    return gram.contiguous(), patches, means, took_part, voxels
