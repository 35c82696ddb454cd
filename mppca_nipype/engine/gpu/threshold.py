"""The Marchenko-Pastur threshold on the device, and how sure a float32 run can be of the rank it gives.

``threshold_on_device``: one Triton program per window holds its m eigenvalues in registers and decides the
rank and the noise variance (estimated, or given: ``estimators.given_noise_threshold``) and, given the eigenvalues' uncertainty ``delta``, whether the rank is settled: the
rank under the eigenvalues moved by ``delta`` (all up, all down, spread apart, drawn together) stays the
same. One launch instead of ~125 torch launches over the batch for the estimator and its four moved copies.
Same arithmetic as ``estimators.marchenko_pastur_threshold`` (the CPU's code and the tests' reference), in
float64; the cumulative sum is a scan here and a sequential sum there, so a window whose test is a tie to
the last rounding may land on the other side (the settling test flags such windows anyway when ``delta`` > 0).

The settling criteria. The rank test is a comparison, and a window whose margin is below float32's error on
its Gram (~eps lambda_max) can land on either side of it; one such flip in a small phantom is 1e-4 of rms
difference from the float64 CPU path. A float32 first pass therefore flags the windows whose rank would
change if the eigenvalues moved by a few float32 roundings of the largest (``rounding_uncertainty``: the slack
depends on the eigensolver), and, with the patch's mean taken apart, those whose projector float32 cannot
resolve (``unresolved_projectors``); ``settling`` redoes them in float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..estimators import ESTIMATORS

#: How far (in float32 roundings of the largest eigenvalue) the eigenvalues may move before a window's rank
#: counts as unsettled in float32 and is redone in float64: cuSOLVER's XsyevBatched (its float32 eigenvalues
#: err by up to ~12 roundings of the largest on the seed's windows).
SETTLE_SLACK = 10.0
#: ``SETTLE_SLACK`` for the tridiagonal kernels' eigenvalues (their errors on the seed's windows: a median 1.2
#: and at most 7.7 roundings on any eigenvalue, 0.6 on the smallest; at 0.5 no window whose rank differs from
#: float64's goes unflagged, at 3 they flag 3.4% / 0.6% of the windows with voxel / volume demeaning).
TRIDIAGONAL_SETTLE_SLACK = 3.0
#: ``SETTLE_SLACK`` for eigenvalues refined in float64 (``cusolver.ProjectorFromVectors.refine``: their error
#: is far below a float32 rounding of the largest).
REFINED_SETTLE_SLACK = 0.1
#: A refined window whose rank reaches its refined block less this many is decided outside that block:
#: unsettled.
REFINE_GUARD = 8
#: Undemeaned float32 runs (the mean taken apart): a window whose kept and dropped eigenvalues are closer
#: than float32 can separate, eps ||A|| / gap above this, is redone in float64 (the tridiagonal kernels'
#: projector errs by up to ~0.6 times that ratio; a mixing of kept and dropped noise-level vectors by 1e-2
#: moves a voxel by ~1e-2 of the noise). dwidenoise's mode on 96x96x48x48: 4.8e-7 from float64 at 1e-2 and
#: with no limit, 1.7e-7 at 1e-5 but with 88% of the windows redone.
PROJECTOR_GAP_LIMIT = 1e-2


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
def _given_rank_of(values, index, n_voxels, n_volumes, given, m: tl.constexpr):
    """The rank ``estimators.given_noise_threshold`` gives for one window's ascending eigenvalues and its
    given noise variance ``given``: the usable lambda_i above the edge sigma^2 (1 + sqrt(r / q))^2."""
    r = tl.minimum(n_voxels, n_volumes).to(tl.float64)
    q = tl.maximum(n_voxels, n_volumes).to(tl.float64)
    usable = (index.to(tl.float64) >= m - r) & (index < m)
    edge = given * (1.0 + tl.sqrt(r / q)) * (1.0 + tl.sqrt(r / q))
    signal = usable & (tl.maximum(values, 0.0) / q > edge)
    return tl.sum(signal.to(tl.int64), axis=0)


@triton.jit
def _window_rank(values, index, n_voxels, n_volumes, given, m: tl.constexpr, EXP1: tl.constexpr,
                 GIVEN: tl.constexpr):
    """(rank, noise variance) of one window: the estimator's, or with ``GIVEN`` the given variance's."""
    if GIVEN:
        rank = _given_rank_of(values, index, n_voxels, n_volumes, given, m)
        sigma2 = given
    else:
        rank, sigma2 = _rank_of(values, index, n_voxels, n_volumes, m, EXP1)
    return rank, sigma2


@triton.jit
def _threshold_kernel(values_ptr, n_voxels_ptr, given_ptr, delta_ptr, rank_ptr, sigma2_ptr, unsettled_ptr,
                      n_volumes, m: tl.constexpr, BLOCK: tl.constexpr, EXP1: tl.constexpr, GIVEN: tl.constexpr,
                      SETTLE: tl.constexpr):
    window = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, BLOCK)
    values = tl.load(values_ptr + window * m + index, mask=index < m, other=0.0).to(tl.float64)
    n_voxels = tl.load(n_voxels_ptr + window).to(tl.int64)
    given = tl.load(given_ptr + window).to(tl.float64)  # (with GIVEN false: any number, unused)
    rank, sigma2 = _window_rank(values, index, n_voxels, n_volumes, given, m, EXP1, GIVEN)
    tl.store(rank_ptr + window, rank)
    tl.store(sigma2_ptr + window, sigma2)
    if SETTLE:
        # the rank under the eigenvalues moved by delta: all up, all down, spread apart, drawn together
        delta = tl.load(delta_ptr + window).to(tl.float64)
        if m > 1:
            ramp = index.to(tl.float64) * (2.0 / (m - 1)) - 1.0
        else:
            ramp = index.to(tl.float64) * 0.0 - 1.0
        up, _ = _window_rank(values + delta, index, n_voxels, n_volumes, given, m, EXP1, GIVEN)
        down, _ = _window_rank(values - delta, index, n_voxels, n_volumes, given, m, EXP1, GIVEN)
        apart, _ = _window_rank(values + delta * ramp, index, n_voxels, n_volumes, given, m, EXP1, GIVEN)
        together, _ = _window_rank(values - delta * ramp, index, n_voxels, n_volumes, given, m, EXP1, GIVEN)
        moved = (up != rank) | (down != rank) | (apart != rank) | (together != rank)
        tl.store(unsettled_ptr + window, moved.to(tl.int8))


def threshold_on_device(values, n_voxels, n_volumes: int, estimator: str, delta=None, given=None):
    """``marchenko_pastur_threshold(values, n_voxels, n_volumes, estimator)``, or with ``given`` ((B,) noise
    variances) ``given_noise_threshold(values, n_voxels, n_volumes, given)`` and ``given`` as the variance,
    and, with ``delta`` ((B, 1) or (B,)), whether each rank is unsettled (it changes when the eigenvalues
    move by ``delta``), in one launch: (rank int64, sigma2 float64, unsettled bool or None), all (B,).
    ``values`` (B, m) ascending; ``n_voxels`` (B,) integers; ``n_volumes`` a number."""
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
    given_values = given.reshape(-1).to(torch.float64).contiguous() if given is not None else sigma2
    if batch:
        _threshold_kernel[(batch,)](values, n_voxels, given_values, delta, rank, sigma2,
                                    rank if unsettled is None else unsettled, int(n_volumes), m,
                                    BLOCK=max(16, triton.next_power_of_2(m)), EXP1=estimator == "exp1",
                                    GIVEN=given is not None, SETTLE=unsettled is not None, num_warps=1)
    return rank, sigma2, None if unsettled is None else unsettled.bool()


def rounding_uncertainty(values, slack=None, scale=None):
    """(B, 1): ``slack`` (default ``SETTLE_SLACK``) float32 roundings of each window's ``scale`` (default:
    its largest eigenvalue), the size of a float32 eigensolver's error on every eigenvalue (~eps ||A||)."""
    slack = SETTLE_SLACK if slack is None else slack
    scale = values[:, -1:].clamp(min=0) if scale is None else scale.reshape(-1, 1)
    return slack * torch.finfo(torch.float32).eps * scale


def unresolved_projectors(values, rank, scale, limit=None):
    """(B,) bool: windows whose projector float32 cannot resolve, eps ``scale`` over the gap between the
    smallest kept and the largest dropped eigenvalue above ``limit`` (default ``PROJECTOR_GAP_LIMIT``)."""
    limit = PROJECTOR_GAP_LIMIT if limit is None else limit
    m = values.shape[1]
    cut = (m - rank.to(torch.int64)).clamp(1, m - 1)[:, None]
    gap = (values.gather(1, cut) - values.gather(1, cut - 1))[:, 0]
    unresolved = torch.finfo(torch.float32).eps * scale.reshape(-1) > limit * gap
    return unresolved & (rank > 0) & (rank < m)
