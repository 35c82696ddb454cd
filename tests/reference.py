"""A slow, obviously-correct float64 reference for MP-PCA denoising, written from DESIGN.md ("The method,
exactly") and sharing no code with ``mppca_nipype.engine``.

Everything is a plain Python loop: over the patches of the layout, over the voxels of a patch, over the
candidate signal ranks P of a spectrum. One patch at a time: gather its finite voxels' time courses (n_eff x
T), remove each voxel's mean if asked (then T - 1 degrees of freedom along time), eigen-decompose the smaller
Gram matrix with ``np.linalg.eigh``, choose P by the Marchenko-Pastur rule, project onto the top P
components, and add the result to the voxels the aggregation says.

Conventions the engine shares (DenoiseResult): outside the mask every output is 0; a voxel in the mask whose
time course holds NaN/Inf takes part in no patch, keeps its input values, and has noise and rank 0.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics

import numpy as np
from threadpoolctl import threadpool_limits

from mppca_nipype.engine import DEFAULTS


def reference_extent(extent, spatial_shape, n_volumes):
    """Three odd window sizes: "auto" is the smallest odd e with e**3 >= T; every axis is capped at the
    largest odd number not above the image size."""
    if isinstance(extent, str):
        assert extent == "auto"
        e = 1
        while e**3 < n_volumes:
            e += 2
        wanted = (e, e, e)
    else:
        wanted = (extent,) * 3 if np.ndim(extent) == 0 else tuple(extent)
    return tuple(min(int(e), size if size % 2 == 1 else size - 1) for e, size in zip(wanted, spatial_shape))


def grid_corners(size, extent, stride):
    """Window starts along one axis for stride > 1: 0, s, 2s, ... and one flush against the far edge.

    The step never exceeds the extent on that axis, so that no voxel falls between two windows."""
    stride = min(stride, extent)
    last = size - extent
    corners = list(range(0, last + 1, stride))
    if corners[-1] != last:
        corners.append(last)
    return corners


def centred_corner(voxel, size, extent):
    """Stride 1: the start of the window centred on ``voxel``, shifted to lie inside the image."""
    return min(max(voxel - extent // 2, 0), size - extent)


def window_voxels(corner, extent):
    """The (x, y, z) indices of a window's voxels."""
    return list(itertools.product(*(range(c, c + e) for c, e in zip(corner, extent))))


def gaussian_weight(voxel, corner, extent):
    """The ``gaussian`` aggregation's factor for ``voxel`` of the window at ``corner``: exp(-d^2 / 2), d its
    distance from the window's centre with each axis in units of GAUSSIAN_WIDTH times the half-extent
    (e - 1) / 2 (1/2 for an axis of extent 1)."""
    from mppca_nipype.engine.patches import GAUSSIAN_WIDTH

    d2 = sum(((v - c - (e - 1) / 2) / (GAUSSIAN_WIDTH * max((e - 1) / 2, 0.5))) ** 2
             for v, c, e in zip(voxel, corner, extent))
    return math.exp(-d2 / 2)


def reference_patches(spatial_shape, extent, stride, mask, finite):
    """The patches that run, as (corner, centre) pairs; centre is None for stride > 1.

    Stride 1: one patch per finite mask voxel, centred on it. Stride > 1: every window of the grid that
    holds at least one finite mask voxel.
    """
    wanted = mask & finite
    if stride == 1:
        return [(tuple(centred_corner(v, s, e) for v, s, e in zip(centre, spatial_shape, extent)), centre)
                for centre in itertools.product(*(range(s) for s in spatial_shape)) if wanted[centre]]
    patches = []
    for corner in itertools.product(*(grid_corners(s, e, stride) for s, e in zip(spatial_shape, extent))):
        if any(wanted[v] for v in window_voxels(corner, extent)):
            patches.append((corner, None))
    return patches


def noise_variance_curve(lam, r):
    """sigma^2(P) = (1 / (r - P)) * sum_{i=P+1..r} lambda_i for P = 0 .. r-1 (lam sorted descending)."""
    return [math.fsum(lam[P:r]) / (r - P) for P in range(r)]


def exact_zeros(eigenvalues):
    """The eigenvalues as floats, those within float64's round-off of 0 (at most m eps times the largest, m
    of them) set to 0: the zeros of a rank-deficient patch, which the solver's round-off alone would set."""
    values = [float(v) for v in eigenvalues]
    floor = len(values) * float(np.finfo(np.float64).eps) * max(max(values), 0.0)
    return [0.0 if v <= floor else v for v in values]


def mp_threshold(eigenvalues, n_voxels, n_volumes, estimator):
    """P_hat and sigma^2(P_hat) of one patch, exactly as DESIGN.md states the rule (exp1, exp2), or by the edge
    estimators of docs/options.md ("Estimators": med, olesen2023; ``edge_threshold``).

    ``eigenvalues``: the Gram matrix's eigenvalues in any order; only the r = min(n, T) largest are used.
    Returns (r, 0.0) when no P in 0 .. r-1 is noise-compatible.
    """
    if estimator in ("med", "olesen2023"):
        return edge_threshold(eigenvalues, n_voxels, n_volumes, estimator)
    r, q = min(n_voxels, n_volumes), max(n_voxels, n_volumes)
    s = sorted(exact_zeros(eigenvalues), reverse=True)[:r]
    lam = [max(v, 0.0) / q for v in s]  # lambda_1 >= ... >= lambda_r
    sigma2 = noise_variance_curve(lam, r)
    for P in range(r):
        gamma = (r - P) / q if estimator == "exp1" else (r - P) / (q - P)
        if lam[P] - lam[r - 1] < 4.0 * math.sqrt(gamma) * sigma2[P]:
            return P, sigma2[P]
    return r, 0.0


@functools.lru_cache(maxsize=None)
def mp_median(beta):
    """The median of the Marchenko-Pastur law of ratio ``beta`` (0 < beta <= 1) and unit variance: the x with
    integral_a^x sqrt((b - t)(t - a)) / (2 pi beta t) dt = 1/2, a, b = (1 -+ sqrt(beta))^2, by Brent's root
    finder on the integral computed by quadrature. Substituting t = 1 + beta - 2 sqrt(beta) cos(u) makes the
    integrand smooth: (2 / pi) sin(u)^2 / (1 + beta - 2 sqrt(beta) cos(u)) on [0, theta]."""
    from scipy.integrate import quad
    from scipy.optimize import brentq

    s = math.sqrt(beta)
    # near beta = 1 the integrand peaks within about 1 - sqrt(beta) of u = 0: quadrature is told where
    knees = [(1 - s) * 4.0**i for i in range(8) if 0 < (1 - s) * 4.0**i < math.pi]

    def below(theta):
        # (1 + beta - 2 s cos(u), written to keep its precision near u = 0 when beta is near 1)
        integral, _ = quad(lambda u: math.sin(u) ** 2 / ((1 - s) ** 2 + 4 * s * math.sin(u / 2) ** 2), 0.0, theta,
                           points=[u for u in knees if u < theta] or None, epsabs=1e-16, epsrel=1e-13, limit=400)
        return 2.0 / math.pi * integral - 0.5

    theta = brentq(below, 0.0, math.pi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=200)
    return 1 + beta - 2 * s * math.cos(theta)


def edge_threshold(eigenvalues, n_voxels, n_volumes, estimator):
    """P_hat's rank and sigma^2 of one patch by ``med`` or ``olesen2023`` (docs/options.md, "Estimators").

    For P = 0 .. r-1 the r - P smallest lambda_i = s_i / q are noise of an (r - P) x (q - P) matrix:
    olesen2023: sigma^2(P) = sum(s_{P+1..r}) / ((r - P)(q - P)); med: sigma^2(P) = median(lambda_{P+1..r})
    q / ((q - P) mu((r - P) / (q - P))). P is noise-compatible when lambda_{P+1} < sigma^2(P) (1 + sqrt(r / q))^2;
    for the smallest such P the rank is the number of lambda_i above that edge. (r, 0.0) when there is none.
    """
    r, q = min(n_voxels, n_volumes), max(n_voxels, n_volumes)
    s = sorted(exact_zeros(eigenvalues), reverse=True)[:r]
    lam = [max(v, 0.0) / q for v in s]  # lambda_1 >= ... >= lambda_r
    spread = (1 + math.sqrt(r / q)) ** 2
    for P in range(r):
        noise = lam[P:r]
        if estimator == "olesen2023":
            sigma2 = math.fsum(max(v, 0.0) for v in s[P:r]) / ((r - P) * (q - P))
        else:
            sigma2 = statistics.median(noise) * q / ((q - P) * mp_median((r - P) / (q - P)))
        edge = sigma2 * spread
        if lam[P] < edge:
            return sum(1 for v in lam if v > edge), sigma2
    return r, 0.0


def given_noise_rank(eigenvalues, n_voxels, n_volumes, sigma2):
    """P of one patch whose noise variance sigma^2 is given: the number of lambda_i = s_i / q (the r largest,
    clamped at 0) above the Marchenko-Pastur edge sigma^2 (1 + sqrt(r / q))^2."""
    r, q = min(n_voxels, n_volumes), max(n_voxels, n_volumes)
    s = sorted((float(v) for v in eigenvalues), reverse=True)[:r]
    edge = sigma2 * (1.0 + math.sqrt(r / q)) ** 2
    return sum(1 for v in s if max(v, 0.0) / q > edge)


def filter_weights(eigenvalues, n_voxels, n_volumes, sigma2, filter):
    """The weight w_i = eta(y_i) / y_i of each of the r = min(n, T) largest components of one patch (in
    descending order), the noise variance sigma^2 taken as known (Gavish & Donoho 2014, 2017).

    y_i = sqrt(s_i) / (sigma sqrt(q)): the patch's singular values in units of the noise's, q = max(n, T);
    beta = r / q. ``hard``: None (the MP rank decides). ``optthresh``: 1 where y_i > lambda*(beta) =
    sqrt(2 (beta + 1) + 8 beta / (beta + 1 + sqrt(beta^2 + 14 beta + 1))), else 0. ``optshrink``:
    eta(y) = sqrt((y^2 - beta - 1)^2 - 4 beta) / y where y >= 1 + sqrt(beta), else 0. sigma^2 = 0 (no noise
    found) keeps every component whole."""
    r, q = min(n_voxels, n_volumes), max(n_voxels, n_volumes)
    beta = r / q
    s = sorted((float(v) for v in eigenvalues), reverse=True)[:r]
    weights = []
    for value in s:
        if sigma2 == 0:
            weights.append(1.0)
            continue
        y = math.sqrt(max(value, 0.0)) / math.sqrt(sigma2 * q)
        if filter == "optthresh":
            threshold = math.sqrt(2 * (beta + 1) + 8 * beta / (beta + 1 + math.sqrt(beta**2 + 14 * beta + 1)))
            weights.append(1.0 if y > threshold else 0.0)
        elif y >= 1 + math.sqrt(beta):
            eta = math.sqrt(max((y * y - beta - 1) ** 2 - 4 * beta, 0.0)) / y
            weights.append(eta / y)
        else:
            weights.append(0.0)
    return weights


def patch_matrix(data, voxels, finite):
    """The n_eff x T matrix of the patch's finite voxels (one row per voxel), and those voxels."""
    kept = [v for v in voxels if finite[v]]
    x, y, z = np.array(kept).reshape(len(kept), 3).T
    return data[x, y, z].astype(np.float64), kept


def patch_spectrum(X):
    """Eigen-decomposition of the smaller Gram matrix of X (n x T).

    Returns (eigenvalues, eigenvectors, time_side): ascending eigenvalues, eigenvectors as columns;
    ``time_side`` when the Gram is T x T (n >= T).
    """
    n, T = X.shape
    time_side = n >= T
    gram = X.T @ X if time_side else X @ X.T
    eigenvalues, eigenvectors = np.linalg.eigh(gram)
    return eigenvalues, eigenvectors, time_side


def denoise_patch(X, demean, estimator, given_sigma2=None, filter="hard", groups=None):
    """MP-PCA of one patch: (X_hat, P, sigma^2); with ``given_sigma2``, P by ``given_noise_rank`` and that
    sigma^2. With a ``filter`` other than ``hard``, X_hat = X V diag(w) V^T (``filter_weights``) and P the
    number of weights above 0.

    ``demean``: "none"; "voxel" removes each row's mean (one degree of freedom less along time);
    "volume" removes each column's mean, the patch's mean time course (one less along the voxels).
    ``groups`` (a label per volume): first each row's mean over each group's volumes is removed (G degrees of
    freedom less along time, G the number of groups), then ``demean`` ("none" or "volume") on the rest.
    """
    n, T = X.shape
    group_means, t_removed = np.zeros((1, 1)), 0
    if groups is not None:
        labels = np.asarray(groups)
        group_means = np.zeros_like(X)
        for label in np.unique(labels):
            columns = labels == label
            group_means[:, columns] = X[:, columns].mean(axis=1, keepdims=True)
        X, t_removed = X - group_means, len(np.unique(labels))
    if demean == "voxel":
        means, n_eff, t_eff = X.mean(axis=1, keepdims=True), n, T - 1
    elif demean == "volume":
        means, n_eff, t_eff = X.mean(axis=0, keepdims=True), n - 1, T
    else:
        means, n_eff, t_eff = np.zeros((1, 1)), n, T
    t_eff -= t_removed
    centred = X - means
    eigenvalues, eigenvectors, time_side = patch_spectrum(centred)
    if given_sigma2 is None:
        P, sigma2 = mp_threshold(eigenvalues, n_eff, t_eff, estimator)
    else:
        P, sigma2 = given_noise_rank(eigenvalues, n_eff, t_eff, given_sigma2), given_sigma2
    if filter == "hard":
        w = np.ones(P)
    else:
        w = np.array(filter_weights(eigenvalues, n_eff, t_eff, sigma2, filter))
        P = int(np.count_nonzero(w))
        w = w[:P]
    top = eigenvectors[:, ::-1][:, :P]  # the P leading eigenvectors
    if time_side:
        restored = centred @ top @ np.diag(w) @ top.T  # X V_P diag(w) V_P^T
    else:
        restored = top @ np.diag(w) @ top.T @ centred  # U_P diag(w) U_P^T X
    return restored + means + group_means, P, sigma2


@threadpool_limits.wrap(limits=1)  # tiny matrices: BLAS threads would only fight over the cores
def denoise_reference(data, mask=None, *, extent, stride, aggregation, demean, estimator, noise=None,
                      filter=DEFAULTS["filter"], groups=None):
    """Denoise ``data`` (X, Y, Z, T) one patch at a time; return (denoised, sigma, rank), float64.

    ``groups``: a label per volume; each voxel's mean over each group's volumes is removed first
    (``denoise_patch``), and the ``weighted`` aggregation counts the G means among the patch's parameters.

    ``noise``: a given sigma, one number or an (X, Y, Z) map; a patch's sigma^2 is then the mean of the map's
    sigma^2 over its finite voxels where the map is positive and finite."""
    data = np.asarray(data)
    shape3, T = data.shape[:3], data.shape[3]
    mask = np.ones(shape3, dtype=bool) if mask is None else np.asarray(mask) != 0
    finite = np.isfinite(data).all(axis=3)
    extent = reference_extent(extent, shape3, T)
    mean_parameters = (demean != "none") + (0 if groups is None else len(np.unique(groups)))
    assert aggregation != "center" or stride == 1

    image = np.zeros(data.shape)
    weight = np.zeros(shape3)
    sigma_sum = np.zeros(shape3)
    rank_sum = np.zeros(shape3)
    for corner, centre in reference_patches(shape3, extent, stride, mask, finite):
        X, kept = patch_matrix(data, window_voxels(corner, extent), finite)
        given_sigma2 = None
        if noise is not None and np.ndim(noise) == 0:
            given_sigma2 = float(noise) ** 2
        elif noise is not None:
            values = [float(noise[v]) ** 2 for v in kept if np.isfinite(noise[v]) and noise[v] > 0]
            given_sigma2 = math.fsum(values) / len(values)
        restored, P, sigma2 = denoise_patch(X, demean, estimator, given_sigma2, filter, groups)
        if aggregation == "center":
            row = kept.index(centre)
            image[centre] = restored[row]
            weight[centre] = 1.0
            sigma_sum[centre] = math.sqrt(sigma2)
            rank_sum[centre] = P
            continue
        w = 1.0 / (1 + P + mean_parameters) if aggregation in ("weighted", "gaussian") else 1.0
        for row, voxel in enumerate(kept):
            v = w * (gaussian_weight(voxel, corner, extent) if aggregation == "gaussian" else 1.0)
            image[voxel] += v * restored[row]
            weight[voxel] += v
            sigma_sum[voxel] += v * math.sqrt(sigma2)
            rank_sum[voxel] += v * P

    denoised = np.zeros(data.shape)
    sigma = np.zeros(shape3)
    rank = np.zeros(shape3)
    for voxel in itertools.product(*(range(s) for s in shape3)):
        if not mask[voxel]:
            continue
        if not finite[voxel]:
            denoised[voxel] = data[voxel]
            continue
        assert weight[voxel] > 0, f"voxel {voxel} in the mask is covered by no patch"
        denoised[voxel] = image[voxel] / weight[voxel]
        sigma[voxel] = sigma_sum[voxel] / weight[voxel]
        rank[voxel] = rank_sum[voxel] / weight[voxel]
    return denoised, sigma, rank


@threadpool_limits.wrap(limits=1)
def centred_patch_spectra(data, extent):
    """For dwidenoise's layout (stride 1, no mask, no demeaning): each voxel's patch eigenvalues.

    Returns a dict voxel -> (eigenvalues ascending, n_voxels, n_volumes).
    """
    data = np.asarray(data)
    shape3, T = data.shape[:3], data.shape[3]
    extent = reference_extent(extent, shape3, T)
    finite = np.isfinite(data).all(axis=3)
    spectra = {}
    for corner, centre in reference_patches(shape3, extent, 1, np.ones(shape3, bool), finite):
        X, _ = patch_matrix(data, window_voxels(corner, extent), finite)
        n, T = X.shape
        eigenvalues = np.linalg.eigvalsh(X.T @ X if n >= T else X @ X.T)
        spectra[centre] = (eigenvalues, n, T)
    return spectra
