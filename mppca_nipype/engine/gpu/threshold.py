"""The Marchenko-Pastur threshold and the settling test in one Triton kernel, one program per window.

``estimators.marchenko_pastur_threshold`` on torch tensors is ~25 elementwise and scan launches over the
batch, and ``pipeline.unsettled_ranks`` runs it four more times on moved eigenvalues: ~125 launches per
batch, 20.6 ms of device time in dwidenoise's mode (372,416 windows in 24 batches; fifth session's
profile). Here each program holds its window's m eigenvalues in registers and decides the rank, the noise
variance and, given the eigenvalues' uncertainty ``delta``, whether the rank is settled, in one launch.

Same arithmetic as ``marchenko_pastur_threshold`` (which stays the reference and the CPU's code), in float64;
the cumulative sum is a scan here and a sequential sum there, so a window whose test is a tie to the last
rounding may land on the other side (the settling test flags such windows anyway when ``delta`` > 0).
The default (``pipeline.FUSED_THRESHOLD``): dwidenoise's mode 181 -> 160 ms on the H200 (sixth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..estimators import ESTIMATORS


@triton.jit
def _rank_of(values, index, n_voxels, n_volumes, m: tl.constexpr, EXP1: tl.constexpr):
    """The rank and noise variance ``marchenko_pastur_threshold`` gives for one window's ascending
    eigenvalues (lanes beyond m hold anything; they are masked)."""
    r = tl.minimum(n_voxels, n_volumes).to(tl.float64)
    q = tl.maximum(n_voxels, n_volumes).to(tl.float64)
    first_usable = m - r
    position = index.to(tl.float64)
    usable = (position >= first_usable) & (index < m)
    lam = tl.where(usable, tl.maximum(values, 0.0) / q, 0.0)
    k = tl.where(usable, position - first_usable + 1.0, 1.0)
    lam_r = tl.min(tl.where(usable, lam, float("inf")), axis=0)
    if EXP1:
        gamma = k / q
    else:
        gamma = k / (q - (r - k))
    sigma2_k = tl.cumsum(lam, axis=0) / k
    spread = (lam - lam_r) / (4.0 * tl.sqrt(gamma))
    compatible = usable & (spread < sigma2_k)
    last = tl.max(tl.where(compatible, index, -1), axis=0)
    found = last >= 0
    n_noise = tl.where(found, last.to(tl.float64) - first_usable + 1.0, 0.0)
    sigma2 = tl.where(found, tl.sum(tl.where(index == last, sigma2_k, 0.0), axis=0), 0.0)
    return (r - n_noise).to(tl.int64), sigma2


@triton.jit
def _threshold_kernel(values_ptr, n_voxels_ptr, delta_ptr, rank_ptr, sigma2_ptr, unsettled_ptr, n_volumes,
                      m: tl.constexpr, BLOCK: tl.constexpr, EXP1: tl.constexpr, SETTLE: tl.constexpr):
    window = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, BLOCK)
    values = tl.load(values_ptr + window * m + index, mask=index < m, other=0.0).to(tl.float64)
    n_voxels = tl.load(n_voxels_ptr + window).to(tl.int64)
    rank, sigma2 = _rank_of(values, index, n_voxels, n_volumes, m, EXP1)
    tl.store(rank_ptr + window, rank)
    tl.store(sigma2_ptr + window, sigma2)
    if SETTLE:
        # the rank under the eigenvalues moved by delta: all up, all down, spread apart, drawn together
        delta = tl.load(delta_ptr + window).to(tl.float64)
        if m > 1:
            ramp = index.to(tl.float64) * (2.0 / (m - 1)) - 1.0
        else:
            ramp = index.to(tl.float64) * 0.0 - 1.0
        up, _ = _rank_of(values + delta, index, n_voxels, n_volumes, m, EXP1)
        down, _ = _rank_of(values - delta, index, n_voxels, n_volumes, m, EXP1)
        apart, _ = _rank_of(values + delta * ramp, index, n_voxels, n_volumes, m, EXP1)
        together, _ = _rank_of(values - delta * ramp, index, n_voxels, n_volumes, m, EXP1)
        moved = (up != rank) | (down != rank) | (apart != rank) | (together != rank)
        tl.store(unsettled_ptr + window, moved.to(tl.int8))


def threshold_on_device(values, n_voxels, n_volumes: int, estimator: str, delta=None):
    """``marchenko_pastur_threshold(values, n_voxels, n_volumes, estimator)`` and, with ``delta`` ((B, 1) or
    (B,)), ``pipeline.unsettled_ranks`` for it, in one launch: (rank int64, sigma2 float64, unsettled bool
    or None), all (B,). ``values`` (B, m) ascending; ``n_voxels`` (B,) integers; ``n_volumes`` a number."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, not {estimator!r}")
    if values.ndim != 2:
        raise ValueError("values must be a (B, m) tensor")
    batch, m = values.shape
    values = values.to(torch.float64).contiguous()
    n_voxels = n_voxels.to(torch.int32).contiguous()
    rank = torch.empty(batch, dtype=torch.int64, device=values.device)
    sigma2 = torch.empty(batch, dtype=torch.float64, device=values.device)
    unsettled = torch.empty(batch, dtype=torch.int8, device=values.device) if delta is not None else None
    delta = delta.reshape(-1).to(torch.float64).contiguous() if delta is not None else sigma2
    if batch:
        _threshold_kernel[(batch,)](values, n_voxels, delta, rank, sigma2, rank if unsettled is None else unsettled,
                                    int(n_volumes), m, BLOCK=max(16, triton.next_power_of_2(m)),
                                    EXP1=estimator == "exp1", SETTLE=unsettled is not None, num_warps=1)
    return rank, sigma2, None if unsettled is None else unsettled.bool()
