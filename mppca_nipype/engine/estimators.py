"""Marchenko-Pastur rank and noise estimators, aggregation weights and the signal projector.

Written once against the array API, so that the NumPy (CPU) and torch (GPU) backends run the same code:
``array_namespace`` hands each function the namespace of its input.

References
----------
Veraart J, Novikov DS, Christiaens D, Ades-aron B, Sijbers J, Fieremans E. Denoising of diffusion MRI
using random matrix theory. NeuroImage 142:394-406 (2016). doi:10.1016/j.neuroimage.2016.08.016
Cordero-Grande L, Christiaens D, Hutter J, Price AN, Hajnal JV. Complex diffusion-weighted image
estimation via matrix recovery under general noise models. NeuroImage 200:391-404 (2019).
doi:10.1016/j.neuroimage.2019.06.039
Gavish M, Donoho DL. The optimal hard threshold for singular values is 4/sqrt(3). IEEE Transactions on
Information Theory 60(8):5040-5053 (2014). doi:10.1109/TIT.2014.2323359
Olesen JL, Ianus A, Ostergaard L, Shemesh N, Jespersen SN. Tensor denoising of multidimensional MRI data.
Magnetic Resonance in Medicine 89(3):1160-1172 (2023). doi:10.1002/mrm.29478
Gavish M, Donoho DL. Optimal shrinkage of singular values. IEEE Transactions on Information Theory
63(4):2137-2152 (2017). doi:10.1109/TIT.2017.2653801
"""

from __future__ import annotations

import math
import numbers

from array_api_compat import array_namespace as compat_namespace
import numpy as np

ESTIMATORS = ("exp2", "exp1", "med", "olesen2023")
#: The estimators whose answer reads only the leading eigenvalues (down to the first noise-compatible P) and the
#: trace: sigma^2(P) is the sum of the r - P smallest, the trace less the P largest. The GPU finds only the
#: leading eigenpairs for them on the longest series (``gpu.cusolver.ProjectorFromVectors.leading``).
LEADING_ESTIMATORS = ("olesen2023",)
#: The estimators that test the spread of the noise eigenvalues (lambda_{P+1} - lambda_r, MRtrix3's dwidenoise);
#: the others test the largest noise eigenvalue against the Marchenko-Pastur upper edge of their noise level.
SPREAD_ESTIMATORS = ("exp2", "exp1")
AGGREGATIONS = ("center", "weighted", "uniform", "gaussian")
DEMEANING = ("none", "voxel", "volume")
FILTERS = ("hard", "optshrink", "optthresh")

#: Newton steps of ``marchenko_pastur_median`` from its first guess: three already reached float64's rounding
#: on a fine grid of beta in (0, 1]; the result is checked against quadrature in tests/test_estimators.py.
MEDIAN_NEWTON_STEPS = 5
#: theta of the beta = 1 law's median in ``marchenko_pastur_median``'s angle: the root of theta + sin(theta) =
#: pi / 2. Newton's first guess runs from pi / 2 (beta -> 0) to it, linearly in sqrt(beta).
MEDIAN_ANGLE_SQUARE = 0.8317111935797360

#: NumPy's main namespace implements the array API from 2.1 on (``cumulative_sum`` came last).
NUMPY_IS_ARRAY_API = np.lib.NumpyVersion(np.__version__) >= "2.1.0"


def array_namespace(array):
    """The array API namespace of ``array``: NumPy itself for a NumPy array (2.1 or newer), else
    array_api_compat's. array_api_compat's wrapper of NumPy is made by importing every NumPy submodule (f2py
    and testing among them): 50 ms of each new process's first call on a quiet machine, 150-190 ms under
    load, more than a small CPU run takes."""
    if NUMPY_IS_ARRAY_API and isinstance(array, np.ndarray):
        return np
    return compat_namespace(array)


def marchenko_pastur_threshold(eigenvalues, n_voxels, n_volumes, estimator: str = "exp2", uncertainty=None):
    """Number of signal components and noise variance of each patch, by one of the ``ESTIMATORS``.

    Parameters
    ----------
    eigenvalues : (B, m) array, ascending along the last axis (as symmetric eigensolvers return them)
        Eigenvalues of each patch's Gram matrix (T x T or n x n, whichever is smaller). Only the top
        ``r = min(n_voxels, n_volumes)`` are used; the rest are the null directions of voxels that were
        left out (NaN) or of the removed mean.
    n_voxels : (B,) integer array
        Voxels that took part in each patch.
    n_volumes : int or (B,) integer array
        Degrees of freedom along time: T, or T - 1 after removing each voxel's mean.
    estimator : {"exp2", "exp1", "med", "olesen2023"}
        ``exp1``: gamma = (r - P) / q (Veraart 2016); ``exp2``: gamma = (r - P) / (q - P)
        (Cordero-Grande 2019, dwidenoise's default); ``med``: the median noise eigenvalue (Gavish & Donoho
        2014's estimate of sigma); ``olesen2023``: their sum over (r - P)(q - P) (Olesen et al. 2023).
    uncertainty : (B,) array, optional
        How far each patch's eigenvalues may be from the true ones (a lower precision's error). With it,
        a third result says which patches' rank such an error could change (the spread estimators only).

    Returns
    -------
    rank : (B,) integer array
        P, the number of signal components kept (r when no P is noise-compatible).
    sigma2 : (B,) array
        Noise variance sigma^2(P) (0 when no P is noise-compatible).
    unsettled : (B,) bool array, only with ``uncertainty``
        Patches whose rank could differ were every eigenvalue moved by up to ``uncertainty``: each lambda
        and sigma^2(P) then move by at most delta / q and the spread by delta / (2 q sqrt(gamma)), so a test
        whose two sides are closer than delta / q (1 + 1 / (2 sqrt(gamma))) could go either way; the rank is
        settled when the last surely compatible P is the last possibly compatible one. For ``med`` and
        ``olesen2023`` see ``_edge_threshold``.

    Notes
    -----
    With lambda_i = s_i / q (s clamped at 0, descending), r = min(n, T), q = max(n, T) and P signal
    components, the r - P smallest lambda are the noise's. ``exp1``/``exp2``: sigma^2(P) is their mean; P is
    noise-compatible when ``(lambda_{P+1} - lambda_r) / (4 sqrt(gamma(P))) < sigma^2(P)``; the estimate is the
    smallest such P (dwidenoise's rule). ``med`` and ``olesen2023``: see ``_edge_threshold``. Computed in the
    precision of ``eigenvalues`` (use float64: dwidenoise accumulates in double).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, not {estimator!r}")
    xp = array_namespace(eigenvalues)
    dtype = eigenvalues.dtype
    m = eigenvalues.shape[-1]
    n_voxels, n_volumes = (_counts_beside(xp, value, eigenvalues) for value in (n_voxels, n_volumes))
    r = xp.astype(xp.minimum(n_voxels, n_volumes), dtype)[:, None]
    q = xp.astype(xp.maximum(n_voxels, n_volumes), dtype)[:, None]

    index = xp.astype(xp.arange(m, device=eigenvalues.device), dtype)[None, :]
    first_usable = m - r
    usable = index >= first_usable
    lam = xp.where(usable, xp.clip(exact_zeros(eigenvalues), min=0) / q, xp.zeros_like(eigenvalues))
    # k: the number of noise components if this eigenvalue is the largest of them
    k = xp.where(usable, index - first_usable + 1, xp.ones_like(eigenvalues))
    if estimator not in SPREAD_ESTIMATORS:
        return _edge_threshold(xp, lam, usable, k, r, q, index, first_usable, estimator, uncertainty)
    lam_r = xp.min(xp.where(usable, lam, xp.full_like(lam, float("inf"))), axis=1, keepdims=True)
    gamma = k / q if estimator == "exp1" else k / (q - (r - k))
    sigma2_k = xp.cumulative_sum(lam, axis=1) / k
    spread = (lam - lam_r) / (4.0 * xp.sqrt(gamma))
    noise_compatible = usable & (spread < sigma2_k)

    # the largest k that is noise-compatible (the smallest P)
    any_compatible = xp.any(noise_compatible, axis=1)
    last = _last_true(xp, noise_compatible)
    n_noise = xp.where(any_compatible, xp.astype(last, dtype) - first_usable[:, 0] + 1, xp.zeros_like(r[:, 0]))
    chosen = index == xp.astype(last, dtype)[:, None]
    sigma2 = xp.where(any_compatible, xp.sum(xp.where(chosen, sigma2_k, xp.zeros_like(lam)), axis=1),
                      xp.zeros_like(r[:, 0]))
    rank = xp.astype(r[:, 0] - n_noise, xp.int64)
    if uncertainty is None:
        return rank, sigma2
    bound = xp.astype(uncertainty, dtype)[:, None] / q * (1.0 + 0.5 / xp.sqrt(gamma))
    margin = sigma2_k - spread
    unsettled = _last_true(xp, usable & (margin > bound)) != _last_true(xp, usable & (margin > -bound))
    return rank, sigma2, unsettled


def exact_zeros(eigenvalues):
    """The (B, m) ``eigenvalues`` with those within float64's round-off of 0 (at most m eps times the patch's
    largest) set to 0, before any estimator reads them (``marchenko_pastur_threshold``; the GPU's threshold
    kernel does the same, ``gpu.threshold``). They are the exact zeros of a rank-deficient patch (voxels of
    exact zeros beside data, a constant series), which round-off alone sets, differently on each machine's
    BLAS; taken as 0, they give every machine the same noise level and rank. A real noise eigenvalue lies
    ~10^12 times higher; a float32 eigensolver's round-off (~10^-7 of the largest) is left to the settling
    test."""
    xp = array_namespace(eigenvalues)
    m = eigenvalues.shape[-1]
    top = xp.clip(xp.max(eigenvalues, axis=1, keepdims=True), min=0)
    return xp.where(eigenvalues <= m * float(np.finfo(np.float64).eps) * top, xp.zeros_like(eigenvalues),
                    eigenvalues)


def _last_true(xp, flags):
    """(B,) the index of the last true value of each row of ``flags`` (B, m), -1 in a row without one."""
    m = flags.shape[1]
    last = (m - 1) - xp.argmax(xp.astype(xp.flip(flags, axis=1), xp.int32), axis=1)
    return xp.where(xp.any(flags, axis=1), last, xp.full_like(last, -1))


def _edge_threshold(xp, lam, usable, k, r, q, index, first_usable, estimator, uncertainty=None):
    """(rank, sigma2) by ``med`` or ``olesen2023``, and with ``uncertainty`` whether the rank is unsettled; the
    arrays as ``marchenko_pastur_threshold`` builds them.

    For P = 0 .. r - 1 signal components, the r - P smallest lambda are taken as the eigenvalues of an
    (r - P) x (q - P) noise matrix (the degrees of freedom left once P components are fitted: Cordero-Grande
    2019, Olesen et al. 2023), whose lambda = s / q have mean sigma^2 (q - P) / q and median
    sigma^2 (q - P) / q * mu(beta_P), beta_P = (r - P) / (q - P) (``marchenko_pastur_median``):

    - ``olesen2023``: sigma^2(P) = q / (q - P) * mean(lambda_{P+1..r}) = sum(s_{P+1..r}) / ((r - P)(q - P));
    - ``med``: sigma^2(P) = q / (q - P) * median(lambda_{P+1..r}) / mu(beta_P) (the median of an even count
      the mean of the middle two); at P = 0, Gavish & Donoho's median estimate of sigma.

    P is noise-compatible when the largest of those, lambda_{P+1}, lies below the Marchenko-Pastur upper edge
    of the whole patch, sigma^2(P) (1 + sqrt(r / q))^2; P_hat is the smallest such P, sigma^2 = sigma^2(P_hat),
    and the rank is the number of lambda_i above that edge at sigma^2 (``given_noise_threshold``'s rule), at
    most P_hat. No noise-compatible P: rank r, sigma^2 = 0.

    Unsettled, when every eigenvalue may move by up to delta (``uncertainty``): lambda_i and the mean or the
    median of any of them then move by at most delta / q (an order statistic moves no more than the values
    do), so a test lambda_i < sigma^2(P) e (e the edge factor, sigma^2(P) = scale(P) times that mean or
    median) can flip only within delta / q (1 + scale(P) e). P_hat is settled when the last surely compatible
    P is the last possibly compatible one, and the count when no lambda_i lies that close to the chosen edge
    (the same test as the GPU's ``threshold._edge_rank_of``).
    """
    dtype = lam.dtype
    m = lam.shape[-1]
    n_signal = r - k  # P, if this eigenvalue is the largest noise one
    if estimator == "olesen2023":
        bulk = xp.cumulative_sum(lam, axis=1) / k
        scale = q / (q - n_signal)
    else:  # the median of the k smallest usable lambda: at first + floor((k - 1) / 2) and first + floor(k / 2)
        low, high = (xp.astype(xp.clip(first_usable + xp.floor(half), min=0, max=m - 1), xp.int64)
                     for half in ((k - 1) / 2, k / 2))
        bulk = 0.5 * (xp.take_along_axis(lam, low, axis=1) + xp.take_along_axis(lam, high, axis=1))
        scale = q / ((q - n_signal) * marchenko_pastur_median(k / (q - n_signal)))
    sigma2_k = bulk * scale
    edge_factor = (1.0 + xp.sqrt(r / q)) ** 2
    noise_compatible = usable & (lam < sigma2_k * edge_factor)

    any_compatible = xp.any(noise_compatible, axis=1)
    last = (m - 1) - xp.argmax(xp.astype(xp.flip(noise_compatible, axis=1), xp.int32), axis=1)
    chosen = index == xp.astype(last, dtype)[:, None]
    sigma2 = xp.where(any_compatible, xp.sum(xp.where(chosen, sigma2_k, xp.zeros_like(lam)), axis=1),
                      xp.zeros_like(r[:, 0]))
    above = usable & (lam > sigma2[:, None] * edge_factor)
    rank = xp.where(any_compatible, xp.sum(xp.astype(above, xp.int64), axis=1), xp.astype(r[:, 0], xp.int64))
    if uncertainty is None:
        return rank, sigma2
    reach = xp.astype(uncertainty, dtype)[:, None] / q  # how far lambda, the mean and the median may move
    bound = reach * (1.0 + scale * edge_factor)
    margin = sigma2_k * edge_factor - lam
    unsettled = _last_true(xp, usable & (margin > bound)) != _last_true(xp, usable & (margin > -bound))
    chosen_bound = xp.sum(xp.where(chosen, bound, xp.zeros_like(lam)), axis=1, keepdims=True)
    near_edge = usable & (xp.abs(lam - sigma2[:, None] * edge_factor) <= chosen_bound)
    unsettled = unsettled | (any_compatible & xp.any(near_edge, axis=1))
    return rank, sigma2, unsettled


def marchenko_pastur_median(beta):
    """mu(beta): the median of the Marchenko-Pastur law of ratio beta in (0, 1] and unit variance.

    The law's density is sqrt((b - x)(x - a)) / (2 pi beta x) on [a, b] = [(1 - sqrt(beta))^2,
    (1 + sqrt(beta))^2]; Gavish & Donoho (2014) tabulate its median mu_beta (0.6528 for beta = 1, -> 1 as
    beta -> 0). With x = 1 + beta - 2 sqrt(beta) cos(theta), theta in [0, pi], its distribution function is

        F(theta) = (theta + sin(theta) / sqrt(beta) - (1 - beta) / beta * chi(theta)) / pi,
        chi(theta) = atan2(sqrt(beta) sin(theta), 1 - sqrt(beta) cos(theta)),

    with F'(theta) = 2 sin(theta)^2 / (pi x); ``MEDIAN_NEWTON_STEPS`` Newton steps solve F = 1/2. Any shape
    (the array API: NumPy, torch)."""
    xp = array_namespace(beta)
    s = xp.sqrt(beta)
    theta = math.pi / 2 - (math.pi / 2 - MEDIAN_ANGLE_SQUARE) * s
    for _ in range(MEDIAN_NEWTON_STEPS):
        cos, sin = xp.cos(theta), xp.sin(theta)
        x = 1.0 + beta - 2.0 * s * cos
        chi = xp.atan2(s * sin, 1.0 - s * cos)
        below = (theta + sin / s - (1.0 - beta) / beta * chi) / math.pi
        theta = theta - (below - 0.5) * math.pi * x / (2.0 * sin * sin)
    return 1.0 + beta - 2.0 * s * xp.cos(theta)


def given_noise_threshold(eigenvalues, n_voxels, n_volumes, sigma2):
    """Number of signal components of each patch when its noise variance is known.

    Parameters
    ----------
    eigenvalues : (B, m) array, ascending along the last axis
        As for ``marchenko_pastur_threshold``: only the top ``r = min(n_voxels, n_volumes)`` are used.
    n_voxels : (B,) integer array
        Voxels that took part in each patch (less one after removing the patch's mean time course).
    n_volumes : int or (B,) integer array
        Degrees of freedom along time: T, or T - 1 after removing each voxel's mean.
    sigma2 : float or (B,) array
        The given noise variance sigma^2 of each patch.

    Returns
    -------
    rank : (B,) integer array
        P, the number of usable lambda_i above the Marchenko-Pastur upper edge sigma^2 (1 + sqrt(gamma))^2
        (at most r).

    Notes
    -----
    With lambda_i = s_i / q (s clamped at 0), q = max(n, T), r = min(n, T) and gamma = r / q, pure noise of
    variance sigma^2 puts every lambda_i below sigma^2 (1 + sqrt(gamma))^2 as n and T grow (the
    Marchenko-Pastur law's upper edge); what lies above it is signal (Gavish & Donoho 2014 threshold
    singular values at the same bulk edge when sigma is known).
    """
    xp = array_namespace(eigenvalues)
    dtype = eigenvalues.dtype
    r, q, usable = _usable_components(xp, eigenvalues, n_voxels, n_volumes)
    if isinstance(sigma2, numbers.Real):
        sigma2 = xp.full(r.shape, float(sigma2), dtype=dtype, device=eigenvalues.device)
    else:
        sigma2 = xp.astype(xp.asarray(sigma2, device=eigenvalues.device), dtype)
    edge = sigma2 * (1.0 + xp.sqrt(r / q)) ** 2
    lam = xp.clip(eigenvalues, min=0) / q[:, None]
    signal = usable & (lam > edge[:, None])
    return xp.astype(xp.sum(xp.astype(signal, xp.int64), axis=1), xp.int64)


def marchenko_pastur_edge(sigma2, rank, n_voxels, n_volumes, estimator: str | None = None):
    """lambda_+, the upper edge of each patch's Marchenko-Pastur noise bulk, as its threshold placed it.

    Parameters
    ----------
    sigma2 : (B,) array
        Each patch's noise variance (estimated or given; 0 where no rank was noise-compatible).
    rank : (B,) integer array
        P, the number of signal components the threshold chose (before any filter).
    n_voxels, n_volumes
        The degrees of freedom on each side, as ``marchenko_pastur_threshold`` takes them.
    estimator : one of ESTIMATORS, or None
        The estimator that chose P, or None for a given noise level.

    Returns
    -------
    (B,) array
        lambda_+ = sigma^2 (1 + sqrt(gamma))^2 (the Marchenko-Pastur law's upper edge; Veraart 2016), in
        the units of lambda_i = s_i / q: the data's variance. gamma is the threshold's own: (r - P) / q for ``exp1``
        (Veraart 2016), (r - P) / (q - P) for ``exp2`` (Cordero-Grande 2019), r / q for ``med`` and
        ``olesen2023`` (their test is the whole patch's edge) and for a given level (``given_noise_threshold``);
        q = max(n, T), r = min(n, T).
    """
    xp = array_namespace(sigma2)
    dtype = sigma2.dtype
    n_voxels, n_volumes = (_counts_beside(xp, value, sigma2) for value in (n_voxels, n_volumes))
    r = xp.astype(xp.minimum(n_voxels, n_volumes), dtype)
    q = xp.astype(xp.maximum(n_voxels, n_volumes), dtype)
    p = xp.astype(rank, dtype)
    if estimator is None or estimator not in SPREAD_ESTIMATORS:
        gamma = r / q
    elif estimator == "exp1":
        gamma = (r - p) / q
    else:  # (q - P is 0 only where P = r = q: no noise component, gamma 0)
        gamma = (r - p) / xp.clip(q - p, min=1)
    return sigma2 * (1.0 + xp.sqrt(gamma)) ** 2


def _usable_components(xp, eigenvalues, n_voxels, n_volumes):
    """(r, q, usable) of each patch: r = min(n, T) and q = max(n, T) in the eigenvalues' dtype (B,), and
    (B, m) whether each eigenvalue is one of the top r (the rest are null directions)."""
    m = eigenvalues.shape[-1]
    n_voxels, n_volumes = (_counts_beside(xp, value, eigenvalues) for value in (n_voxels, n_volumes))
    r = xp.astype(xp.minimum(n_voxels, n_volumes), eigenvalues.dtype)
    q = xp.astype(xp.maximum(n_voxels, n_volumes), eigenvalues.dtype)
    index = xp.astype(xp.arange(m, device=eigenvalues.device), eigenvalues.dtype)[None, :]
    return r, q, index >= (m - r)[:, None]


def _counts_beside(xp, counts, eigenvalues):
    """``counts`` (an int or an integer array) as an array on the eigenvalues' device. A Python number is
    filled in on the device: ``asarray`` would copy it from the host, and on a GPU a copy from pageable
    memory makes the host wait for all the queued work (measured: 5 such waits per batch left the device
    idle for half of a 372,416-window run)."""
    if isinstance(counts, numbers.Integral):
        return xp.full((), int(counts), dtype=xp.int64, device=eigenvalues.device)
    return xp.asarray(counts, device=eigenvalues.device)


def aggregation_weights(rank, mean_parameters: int, aggregation: str):
    """Weight of each patch's reconstruction when overlapping patches are averaged.

    ``weighted``: 1 / (1 + P + d), d the means removed per voxel (``DenoiseOptions.mean_parameters``: 1 with
    voxel or volume demeaning, G with G groups of volumes), i.e. one over the number of parameters the
    patch spent on each voxel (DIPY's 1/(1+P); the seed's 1/(2+P) with demeaning). ``uniform``: 1.
    ``center`` takes each voxel from its own patch and needs no weight (1 is returned).
    """
    xp = array_namespace(rank)
    ones = xp.ones(rank.shape, dtype=xp.float64, device=rank.device)
    if aggregation in ("weighted", "gaussian"):
        return ones / (1.0 + xp.astype(rank, xp.float64) + float(mean_parameters))
    return ones


#: A float32 run's window whose kept and dropped eigenvalues are closer than float32 can separate, eps ||A||
#: / gap above this, is redone in float64 (``unresolved_projectors``; the GPU's tridiagonal kernels' projector
#: errs by up to ~0.6 times that ratio; a mixing of kept and dropped noise-level vectors by 1e-2 moves a voxel
#: by ~1e-2 of the noise). dwidenoise's mode on 96x96x48x48 on the GPU: 4.8e-7 from float64 at 1e-2 and with
#: no limit, 1.7e-7 at 1e-5 but with 88% of the windows redone.
PROJECTOR_GAP_LIMIT = 1e-2


def unresolved_projectors(values, rank, scale, limit=PROJECTOR_GAP_LIMIT):
    """(B,) bool: windows whose projector float32 cannot resolve: eps ``scale`` over the gap between the
    smallest kept and the largest dropped of the eigenvalues ``values`` (B, m, ascending) above ``limit``;
    never where ``rank`` (B,) keeps none or all."""
    xp = array_namespace(values)
    m = values.shape[1]
    rows = xp.arange(values.shape[0], device=values.device)
    cut = xp.clip(m - xp.astype(rank, xp.int64), 1, m - 1)
    gap = values[rows, cut] - values[rows, cut - 1]
    unresolved = float(np.finfo(np.float32).eps) * xp.reshape(scale, (-1,)) > limit * gap
    return unresolved & (rank > 0) & (rank < m)


def signal_projector(eigenvectors, rank, weights=None):
    """V_P V_P^T: the projector onto the ``rank`` leading eigenvectors of each patch; with ``weights``,
    V diag(w) V^T.

    ``eigenvectors`` is (B, m, k) with eigenvectors as columns in ascending eigenvalue order: all of them
    (k = m), or the k leading ones (a refined block, which holds every kept one); ``weights`` (B, m) in the
    same order (``component_weights``; 0 beyond each patch's ``rank`` leading ones), of which the k leading
    ones are used.
    """
    xp = array_namespace(eigenvectors)
    kept, vectors = signal_factors(eigenvectors, rank, weights)
    return kept @ xp.matrix_transpose(vectors)


def signal_factors(eigenvectors, rank, weights=None):
    """(V diag(w), V), whose product V diag(w) V^T is ``signal_projector``'s (same arguments): applied to a
    patch as two products with k columns, for k far below m, it costs ~2k/m of the m x m projector's."""
    xp = array_namespace(eigenvectors)
    m = eigenvectors.shape[-1]
    if weights is not None:
        keep = xp.astype(weights[:, weights.shape[-1] - m:], eigenvectors.dtype)
    else:
        index = xp.arange(m, device=eigenvectors.device)[None, :]
        keep = xp.astype(index >= (m - rank)[:, None], eigenvectors.dtype)
    return eigenvectors * keep[:, None, :], eigenvectors


def optimal_hard_threshold(beta):
    """lambda*(beta) of Gavish & Donoho 2014: the optimal hard threshold of singular values for a
    known noise level, in units of sigma sqrt(q); 4 / sqrt(3) for a square matrix (beta = 1)."""
    xp = array_namespace(beta)
    return xp.sqrt(2.0 * (beta + 1.0) + 8.0 * beta / ((beta + 1.0) + xp.sqrt(beta * beta + 14.0 * beta + 1.0)))


def component_weights(eigenvalues, n_voxels, n_volumes, sigma2, filter_name: str, uncertainty=None):
    """Weight w_i of each component in a patch's reconstruction X V diag(w) V^T, for a filter of the
    singular values that takes the noise level as known.

    Parameters
    ----------
    eigenvalues : (B, m) array, ascending along the last axis
        As for ``marchenko_pastur_threshold``: only the top ``r = min(n_voxels, n_volumes)`` are used.
    n_voxels : (B,) integer array
    n_volumes : int or (B,) integer array
        The degrees of freedom on each side, as ``marchenko_pastur_threshold`` takes them.
    sigma2 : (B,) array
        Each patch's noise variance (estimated or given); 0 keeps every usable component whole.
    filter_name : {"optshrink", "optthresh"}
        ``optshrink``: Gavish & Donoho's 2017 optimal shrinker for the Frobenius loss; ``optthresh``: their
        2014 optimal hard threshold for a known noise level.
    uncertainty : (B, 1) or (B,) array, optional
        As for ``marchenko_pastur_threshold``: how far each eigenvalue may be from the exact one (a float32
        eigensolver's error). Then ``unsettled`` is returned too.

    Returns
    -------
    weights : (B, m) array
        eta(y_i) / y_i for the usable components with eta(y_i) > 0, else 0; in [0, 1], 0 or 1 for
        ``optthresh``. The kept components are the leading ones (eta grows with y).
    unsettled : (B,) bool array, only with ``uncertainty``
        Windows with an eigenvalue within reach of the filter's cut (the bulk edge, or the optimal threshold),
        counting the error the noise level takes from the eigenvalues (up to the cut's multiple of it): which
        components are kept may differ from the exact eigenvalues' choice.

    Notes
    -----
    The singular values of the patch matrix are sqrt(s_i); in units of sigma sqrt(q) (Gavish & Donoho scale
    the noise by 1 / sqrt(q), q the larger dimension) they are y_i = sqrt(lambda_i / sigma^2), lambda_i = s_i / q,
    with beta = r / q. ``optshrink``: eta(y) = sqrt((y^2 - beta - 1)^2 - 4 beta) / y for y >= 1 + sqrt(beta),
    else 0 (GD 2017, the Frobenius loss's shrinker), so w = sqrt((t - beta - 1)^2 - 4 beta) / t with t = y^2.
    ``optthresh``: w = 1 for y > lambda*(beta) (``optimal_hard_threshold``), else 0.
    """
    if filter_name not in FILTERS[1:]:
        raise ValueError(f"filter must be one of {FILTERS[1:]}, not {filter_name!r}")
    xp = array_namespace(eigenvalues)
    dtype = eigenvalues.dtype
    r, q, usable = _usable_components(xp, eigenvalues, n_voxels, n_volumes)
    beta = (r / q)[:, None]
    sigma2 = xp.astype(xp.asarray(sigma2, device=eigenvalues.device), dtype)[:, None]
    noiseless = sigma2 <= 0
    # t = y^2 = lambda / sigma^2 (infinite where no noise was found: every usable component kept whole)
    t = xp.where(noiseless, xp.full_like(eigenvalues, float("inf")),
                 xp.clip(eigenvalues, min=0) / q[:, None] / xp.where(noiseless, xp.ones_like(sigma2), sigma2))
    zeros, ones = xp.zeros_like(eigenvalues), xp.ones_like(eigenvalues)
    cut = optimal_hard_threshold(beta) ** 2 if filter_name == "optthresh" else (1.0 + xp.sqrt(beta)) ** 2
    kept = usable & ((t > cut) if filter_name == "optthresh" else (t >= cut))
    if filter_name == "optthresh":
        weights = xp.where(kept, ones, zeros)
    else:
        finite_t = xp.where(xp.isinf(t) | ~kept, ones, t)
        shrunk = xp.sqrt(xp.clip((finite_t - beta - 1.0) ** 2 - 4.0 * beta, min=0)) / finite_t
        weights = xp.where(kept, xp.where(xp.isinf(t), ones, shrunk), zeros)
    if uncertainty is None:
        return weights
    # the cut in eigenvalue units is q sigma^2 cut; sigma^2 moves by about the eigenvalues' error over q
    reach = (1.0 + cut) * xp.reshape(xp.astype(xp.asarray(uncertainty, device=eigenvalues.device), dtype), (-1, 1))
    near = usable & ~noiseless & (xp.abs(t - cut) * q[:, None] * sigma2 <= reach)
    return weights, xp.any(near, axis=1)
