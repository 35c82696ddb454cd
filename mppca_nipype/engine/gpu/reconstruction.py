"""Reconstruction of windows into the per-voxel sums, read straight from the series (the fused kernels).

* ``reconstruct_accumulate``: X_hat = X_c P + mean for every voxel of each window, added with the window's
  weight into the image and weight/sigma/rank sums (``weighted``, ``uniform`` and ``gaussian`` aggregation,
  the last with a weight per patch voxel; atomics).
* ``reconstruct_centres``: the centre row only, written (not added) to its voxel (``center`` aggregation).

Patches are read as ``gram`` reads them (``gram.patch_rows``). With voxel demeaning on a full grid of
windows, ``boxsums`` reconstructs instead, without atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gram import (block_volumes, block_voxels, check_demean, check_volume, check_volume_mean, or_placeholder,
                   patch_rows)

#: How ``tl.dot`` multiplies the reconstruction's X_c P tiles: three TF32 tensor-core products a tile, each
#: operand split in a high and a low part, for float32's accuracy at tensor-core rates (faster than "ieee"
#: here, where each chunk is one product; docs/gpu.md, "Tuning constants").
RECONSTRUCTION_DOT = "tf32x3"


@triton.jit
def _reconstruct_accumulate_kernel(volume_ptr, finite_ptr, window_base_ptr, voxel_offsets_ptr, projector_ptr,
                                   volume_mean_ptr, patch_weight_ptr, patch_sigma_ptr, patch_rank_ptr,
                                   voxel_scale_ptr, image_ptr, weight_ptr, sigma_ptr, rank_ptr,
                                   n_voxels: tl.constexpr, n_volumes: tl.constexpr,
                                   DEMEAN: tl.constexpr, SCALED: tl.constexpr, DOT: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
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
            row, voxel_valid, x = patch_rows(volume_ptr, voxel_offsets_ptr, base, start, t, volume_valid,
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
            if SCALED:  # each patch voxel's own weight (``gaussian`` aggregation)
                position = start + tl.arange(0, BLOCK_N)
                voxel_weight *= tl.load(voxel_scale_ptr + position, mask=position < n_voxels, other=0.0)
            tl.atomic_add(image_ptr + row[:, None] * n_volumes + t[None, :], restored * voxel_weight[:, None],
                          mask=element_valid, sem="relaxed")
            tl.atomic_add(weight_ptr + row, voxel_weight, mask=voxel_valid, sem="relaxed")
            tl.atomic_add(sigma_ptr + row, voxel_weight * patch_sigma, mask=voxel_valid, sem="relaxed")
            tl.atomic_add(rank_ptr + row, voxel_weight * patch_rank, mask=voxel_valid, sem="relaxed")


def reconstruct_accumulate(volume, finite, window_base, voxel_offsets, projector, patch_weight, patch_sigma,
                           patch_rank, image, weight, sigma, rank, *, demean: str, volume_mean=None,
                           voxel_scale=None):
    """Add w * (X_c P + mean) of every window to ``image`` (V, T) and w, w*sigma, w*rank to the maps (V,).

    ``projector`` (B, T, T) float32, or float64 (rounded to float32 as it is read: a settling pass's, whose
    launch is sized for more windows than it holds); ``patch_weight``, ``patch_sigma``, ``patch_rank`` (B,)
    float32 (a window with weight 0 is skipped: a failed eigensolve is redone on the CPU). ``demean`` as for
    ``gram``; with "volume", ``volume_mean`` (B, T) is what ``gram`` returned: X_hat = (X - mu) P + mu.
    ``voxel_scale`` (n,) float32, or None for ones: a factor on w for each voxel of a patch, by its position
    (``PatchPlan.voxel_weights``).
    """
    check_volume(volume, finite)
    check_demean(demean)
    batch, n_volumes = window_base.numel(), volume.shape[1]
    check_volume_mean(volume_mean, demean, batch, n_volumes)
    if projector.shape != (batch, n_volumes, n_volumes) or projector.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"projector must be ({batch}, {n_volumes}, {n_volumes}) float32 or float64")
    for name, vector in (("patch_weight", patch_weight), ("patch_sigma", patch_sigma),
                         ("patch_rank", patch_rank)):
        if vector.shape != (batch,) or vector.dtype != torch.float32:
            raise ValueError(f"{name} must be ({batch},) float32")
    if voxel_scale is not None and (voxel_scale.shape != voxel_offsets.shape or voxel_scale.dtype != torch.float32):
        raise ValueError(f"voxel_scale must be ({voxel_offsets.numel()},) float32")
    if batch:
        _reconstruct_accumulate_kernel[(batch,)](
            volume, finite, window_base, voxel_offsets, projector.contiguous(), or_placeholder(volume_mean, volume),
            patch_weight, patch_sigma, patch_rank, or_placeholder(voxel_scale, patch_weight), image, weight, sigma,
            rank, voxel_offsets.numel(), n_volumes, DEMEAN=demean, SCALED=voxel_scale is not None,
            DOT=RECONSTRUCTION_DOT,
            BLOCK_N=block_voxels(n_volumes), BLOCK_T=block_volumes(n_volumes), num_warps=4)


# The per-centre tables and per-window values are read one scalar per program, and the maps written one
# scalar: their pointers' alignment buys nothing, and specialising on it compiled a variant per alignment of
# a batch's slices of them (a run after ``mppca-denoise --warm-up`` compiled one more).
@triton.jit(do_not_specialize_on_alignment=["centre_voxel_ptr", "centre_window_ptr", "patch_weight_ptr",
                                            "patch_sigma_ptr", "patch_rank_ptr", "weight_ptr", "sigma_ptr",
                                            "rank_ptr"])
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
    check_demean(demean)
    n_volumes = volume.shape[1]
    check_volume_mean(volume_mean, demean, projector.shape[0], n_volumes)
    if centre_voxel.shape != centre_window.shape:
        raise ValueError("centre_voxel and centre_window must have the same length")
    if projector.dtype != torch.float32 or projector.shape[1:] != (n_volumes, n_volumes):
        raise ValueError(f"projector must be (B, {n_volumes}, {n_volumes}) float32")
    if centre_voxel.numel():
        _reconstruct_centres_kernel[(centre_voxel.numel(),)](
            volume, centre_voxel, centre_window, projector.contiguous(), or_placeholder(volume_mean, volume),
            patch_weight, patch_sigma, patch_rank,
            image, weight, sigma, rank, n_volumes, DEMEAN=demean, BLOCK_T=block_volumes(n_volumes),
            num_warps=4 if n_volumes > 64 else 2)
