"""The Marchenko-Pastur threshold on the device, and how sure a float32 run can be of the rank it gives.

``threshold_on_device``: one Triton program per window holds its m eigenvalues in registers and decides the
rank and the noise variance (estimated, or given: ``estimators.given_noise_threshold``) and, given the
eigenvalues' uncertainty ``delta``, whether the rank is settled. For the spread estimators (exp2, exp1): the
rank under the eigenvalues moved by ``delta`` (all up, all down, spread apart, drawn together) stays the
same. For the edge estimators (med, olesen2023), whose every decision compares one eigenvalue with an edge
proportional to a mean or a median of others, each of which moves by at most ``delta`` when every
eigenvalue does: no comparison that decides the rank lies within what such a move can change it
(``_edge_rank_of``). One launch instead of ~125 torch launches over the batch for the estimator and its
moved copies. Same arithmetic as ``estimators.marchenko_pastur_threshold`` (the CPU's code and the tests'
reference), in float64; the cumulative sum is a scan here and a sequential sum there, and the Marchenko-Pastur
median's arctangent a series here, so a window whose test is a tie to the last rounding may land on the other
side (the settling test flags such windows anyway when ``delta`` > 0).

The settling criteria. The rank test is a comparison, and a window whose margin is below float32's error on
its Gram (~eps lambda_max) can land on either side of it; one such flip in a small phantom is 1e-4 of rms
difference from the float64 CPU path. A float32 first pass therefore flags the windows whose rank would
change if the eigenvalues moved by a few float32 roundings of the largest (``rounding_uncertainty``: the slack
depends on the eigensolver), and, with the patch's mean taken apart, those whose projector float32 cannot
resolve (``estimators.unresolved_projectors``); ``settling`` redoes them in float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from ..estimators import ESTIMATORS, MEDIAN_ANGLE_SQUARE, MEDIAN_NEWTON_STEPS

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
#: The estimators whose answer the refined ends of the spectrum decide (the largest eigenvalues, the smallest,
#: and sums of the smallest that the trace fixes): they settle with ``REFINED_SETTLE_SLACK``. ``med`` reads the
#: median of the bulk, whose refined eigenvalues keep the float32 eigensolver's error: it takes the solver's
#: slack.
REFINED_ESTIMATORS = ("exp2", "exp1", "olesen2023")
#: A refined window whose rank reaches its refined block less this many is decided outside that block:
#: unsettled.
REFINE_GUARD = 8
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


# Constants of the float64 arithmetic below, made float64 where used (``tl.full``): Triton takes a Python
# float in an expression as a float32 constant.
_MEDIAN_NEWTON_STEPS = tl.constexpr(MEDIAN_NEWTON_STEPS)
_MEDIAN_ANGLE_SQUARE = tl.constexpr(MEDIAN_ANGLE_SQUARE)
_PI = tl.constexpr(math.pi)
_TAN_PI_8 = tl.constexpr(math.sqrt(2.0) - 1.0)
#: Terms of the arctangent's series on |z| <= tan(pi / 8): the first left out is below 1.2e-17.
_ATAN_TERMS = tl.constexpr(21)
_EPS64 = tl.constexpr(float(np.finfo(np.float64).eps))


@triton.jit
def _atan2_of_positive(y, x):
    """atan2(y, x) for y > 0, x >= 0 (float64): the series of atan on |z| <= tan(pi / 8), after taking the
    ratio below 1 (atan(t) = pi / 2 - atan(1 / t)) and, above tan(pi / 8), round pi / 4 (atan(t) = pi / 4 +
    atan((t - 1) / (t + 1)))."""
    t = tl.minimum(x, y) / tl.maximum(x, y)
    reduced = t > tl.full((), _TAN_PI_8, tl.float64)
    z = tl.where(reduced, (t - 1.0) / (t + 1.0), t)
    u = z * z
    series = tl.zeros_like(z) + tl.full((), 1.0 / (2 * _ATAN_TERMS - 1), tl.float64)
    for n in tl.static_range(_ATAN_TERMS - 2, -1, -1):
        series = series * (0.0 - u) + tl.full((), 1.0 / (2 * n + 1), tl.float64)
    quarter = tl.full((), _PI / 4, tl.float64)
    angle = tl.where(reduced, quarter, 0.0) + z * series
    return tl.where(y > x, 2.0 * quarter - angle, angle)


@triton.jit
def _marchenko_pastur_median(beta):
    """``estimators.marchenko_pastur_median`` of float64 ``beta``: the same Newton steps on the law's
    distribution function."""
    pi = tl.full((), _PI, tl.float64)
    s = tl.sqrt(beta)
    theta = 0.5 * pi - (0.5 * pi - tl.full((), _MEDIAN_ANGLE_SQUARE, tl.float64)) * s
    for _ in tl.static_range(_MEDIAN_NEWTON_STEPS):
        cos = tl.cos(theta)
        sin = tl.sin(theta)
        x = 1.0 + beta - 2.0 * s * cos
        chi = _atan2_of_positive(s * sin, 1.0 - s * cos)
        below = (theta + sin / s - (1.0 - beta) / beta * chi) / pi
        theta = theta - (below - 0.5) * pi * x / (2.0 * sin * sin)
    return 1.0 + beta - 2.0 * s * tl.cos(theta)


@triton.jit
def _edge_rank_of(values, index, n_voxels, n_volumes, delta, m: tl.constexpr, MEDIAN: tl.constexpr,
                  SETTLE: tl.constexpr):
    """(rank, noise variance, unsettled) that ``marchenko_pastur_threshold`` gives by ``med`` (``MEDIAN``) or
    ``olesen2023`` for one window's ascending eigenvalues (``estimators._edge_threshold``), and with
    ``SETTLE`` whether moving every eigenvalue by up to ``delta`` could change the rank: lambda_i and the mean
    or median of any of them move by at most delta / q, so the test lambda_{P+1} < sigma^2(P) e (e = (1 +
    sqrt(r / q))^2, sigma^2(P) = scale(P) times that mean or median) can flip only within
    delta / q (1 + scale(P) e). P_hat is settled when the last surely compatible lane is the last possibly
    compatible one, the count when no lambda_i lies that close to the chosen edge."""
    # (at least 0: a counted launch's places past its count hold any number, and their answer is dropped)
    r = tl.maximum(tl.minimum(n_voxels, n_volumes), 0).to(tl.float64)
    q = tl.maximum(n_voxels, n_volumes).to(tl.float64)
    first_usable = m - r
    position = index.to(tl.float64)
    usable = (position >= first_usable) & (index < m)
    lam = tl.where(usable, tl.maximum(values, 0.0) / q, 0.0)
    k = tl.where(usable, position - first_usable + 1.0, 1.0)
    n_signal = r - k
    if MEDIAN:  # the median of the k smallest usable lambda (positions first + (k - 1) // 2 and first + k // 2)
        first = m - r.to(tl.int32)
        low = tl.where(usable, first + (index - first) // 2, index)
        high = tl.where(usable, first + (index - first + 1) // 2, index)
        bulk = 0.5 * (tl.gather(lam, low, 0) + tl.gather(lam, high, 0))
        scale = q / ((q - n_signal) * _marchenko_pastur_median(k / (q - n_signal)))
    else:
        bulk = tl.cumsum(lam, axis=0) / k
        scale = q / (q - n_signal)
    sigma2_k = bulk * scale
    edge_factor = (1.0 + tl.sqrt(r / q)) * (1.0 + tl.sqrt(r / q))
    edge_k = sigma2_k * edge_factor
    last = tl.max(tl.where(usable & (lam < edge_k), index, -1), axis=0)
    found = last >= 0
    sigma2 = tl.where(found, tl.sum(tl.where(index == last, sigma2_k, 0.0), axis=0), 0.0)
    edge = sigma2 * edge_factor
    above = usable & (lam > edge)
    rank = tl.where(found, tl.sum(above.to(tl.int64), axis=0), r.to(tl.int64))
    unsettled = last < -1  # (without SETTLE: false, unused)
    if SETTLE:
        slack_k = delta / q * (1.0 + scale * edge_factor)
        surely = tl.max(tl.where(usable & (lam < edge_k - slack_k), index, -1), axis=0)
        possibly = tl.max(tl.where(usable & (lam < edge_k + slack_k), index, -1), axis=0)
        slack = tl.sum(tl.where(index == last, slack_k, 0.0), axis=0)
        near = tl.sum((usable & (tl.abs(lam - edge) <= slack)).to(tl.int32), axis=0) > 0
        unsettled = (surely != possibly) | (found & near)
    return rank, sigma2, unsettled


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
                      n_volumes, m: tl.constexpr, BLOCK: tl.constexpr, ESTIMATOR: tl.constexpr,
                      GIVEN: tl.constexpr, SETTLE: tl.constexpr):
    window = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, BLOCK)
    values = tl.load(values_ptr + window * m + index, mask=index < m, other=0.0).to(tl.float64)
    # ``estimators.exact_zeros``: eigenvalues within float64's round-off of 0 (m eps times the largest) are the
    # exact zeros of a rank-deficient patch, whatever this machine's solver rounded them to
    top = tl.maximum(tl.max(tl.where(index < m, values, 0.0), axis=0), 0.0)
    values = tl.where(values <= tl.full((), _EPS64, tl.float64) * m * top, 0.0, values)
    n_voxels = tl.load(n_voxels_ptr + window).to(tl.int64)
    given = tl.load(given_ptr + window).to(tl.float64)  # (with GIVEN false: any number, unused)
    if (ESTIMATOR == "med" or ESTIMATOR == "olesen2023") and not GIVEN:
        delta = 0.0
        if SETTLE:
            delta = tl.load(delta_ptr + window).to(tl.float64)
        rank, sigma2, unsettled = _edge_rank_of(values, index, n_voxels, n_volumes, delta, m, ESTIMATOR == "med",
                                                SETTLE)
        tl.store(rank_ptr + window, rank)
        tl.store(sigma2_ptr + window, sigma2)
        if SETTLE:
            tl.store(unsettled_ptr + window, unsettled.to(tl.int8))
    else:
        rank, sigma2 = _window_rank(values, index, n_voxels, n_volumes, given, m, ESTIMATOR == "exp1", GIVEN)
        tl.store(rank_ptr + window, rank)
        tl.store(sigma2_ptr + window, sigma2)
        if SETTLE:
            # the rank under the eigenvalues moved by delta: all up, all down, spread apart, drawn together
            delta = tl.load(delta_ptr + window).to(tl.float64)
            if m > 1:
                ramp = index.to(tl.float64) * (2.0 / (m - 1)) - 1.0
            else:
                ramp = index.to(tl.float64) * 0.0 - 1.0
            up, _ = _window_rank(values + delta, index, n_voxels, n_volumes, given, m, ESTIMATOR == "exp1", GIVEN)
            down, _ = _window_rank(values - delta, index, n_voxels, n_volumes, given, m, ESTIMATOR == "exp1",
                                   GIVEN)
            apart, _ = _window_rank(values + delta * ramp, index, n_voxels, n_volumes, given, m,
                                    ESTIMATOR == "exp1", GIVEN)
            together, _ = _window_rank(values - delta * ramp, index, n_voxels, n_volumes, given, m,
                                       ESTIMATOR == "exp1", GIVEN)
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
                                    BLOCK=max(16, triton.next_power_of_2(m)), ESTIMATOR=estimator,
                                    GIVEN=given is not None, SETTLE=unsettled is not None, num_warps=1)
    return rank, sigma2, None if unsettled is None else unsettled.bool()


def rounding_uncertainty(values, slack=None, scale=None):
    """(B, 1): ``slack`` (default ``SETTLE_SLACK``) float32 roundings of each window's ``scale`` (default:
    its largest eigenvalue), the size of a float32 eigensolver's error on every eigenvalue (~eps ||A||)."""
    slack = SETTLE_SLACK if slack is None else slack
    scale = values[:, -1:].clamp(min=0) if scale is None else scale.reshape(-1, 1)
    return slack * torch.finfo(torch.float32).eps * scale

