"""The magnitude noise floor: a variance-stabilising transform before MP-PCA and its unbiased inverse after.

A magnitude image m built from N receive channels (root sum of squares; N = 1: one complex image) of a signal
A with Gaussian noise of standard deviation sigma per real channel follows a non-central chi distribution
with 2N degrees of freedom (Rician for N = 1). Its noise is not additive: at low SNR the mean of m lies
above A (the floor) and its spread below sigma. MP-PCA assumes signal plus white noise of one variance, and
leaves that floor in place.

``MagnitudeStabilizer`` maps y = m / sigma to x = f(y), whose variance is close to 1 whatever theta = A / sigma
(Foi 2011), and maps a denoised x back to theta by the exact inverse of E[f(y) | theta]: a denoiser that
estimates E[x] well then gives an unbiased theta. ``denoise_magnitude`` runs the whole pipeline around
``denoise``, on either engine.

References: Koay CG, Basser PJ. Analytically exact correction scheme for signal extraction from noisy magnitude
MR signals. J Magn Reson 179(2):317-322 (2006). doi:10.1016/j.jmr.2006.01.016. Foi A. Noise estimation and
removal in MR imaging: the variance-stabilization approach. IEEE ISBI 2011:1809-1814.
doi:10.1109/ISBI.2011.5872758
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
import math
import time

import numpy as np

from .backend import available_cpus
from .errors import MPPCAInputError
from .layout import in_parts

#: The noise-floor models: ``none`` (data taken as signal plus Gaussian noise: dwidenoise's model), ``rician``
#: (a magnitude image of one complex channel), ``ncchi`` (a root-sum-of-squares magnitude of ``coils`` channels).
NOISE_FLOORS = ("none", "rician", "ncchi")

#: Where the tables end, in units of sigma: above it the floor's bias is below 0.01 sigma for N <= 8
#: (E[m] - A ~ (2N - 1) sigma^2 / (2A)), and the transform continues as a straight line of its end slope.
THETA_MAX = 40.0
#: Table resolution in theta (the transform's knots) and in y (the quadrature of E[f(y) | theta]).
THETA_STEP = 0.02
Y_STEP = 0.005
#: Refinements of the first-order transform (below); each brings the variance of f(y) closer to 1.
REFINEMENTS = 40
#: Values transformed at a time by one thread (bounds the float64 temporaries of a large series).
CHUNK = 1 << 20


def check_noise_floor(noise_floor, coils) -> int:
    """The number of channels the model takes (1 for ``none`` and ``rician``); MPPCAInputError with one
    sentence for a model that is not one of NOISE_FLOORS or a ``coils`` that does not fit it."""
    if noise_floor not in NOISE_FLOORS:
        raise MPPCAInputError(f"noise_floor must be one of {', '.join(NOISE_FLOORS)}, not {noise_floor!r}")
    if isinstance(coils, bool) or not isinstance(coils, (int, np.integer)) or coils < 1:
        raise MPPCAInputError(f"coils must be a positive integer, not {coils!r}")
    if noise_floor != "ncchi" and coils != 1:
        raise MPPCAInputError(f"coils = {coils} describes a non-central chi floor and needs noise_floor "
                              f"'ncchi' (not {noise_floor!r})")
    return int(coils)


def magnitude_mean(theta, coils: int):
    """E[m / sigma] for true signal theta = A / sigma and ``coils`` channels (Koay & Basser 2006, eq. 5):
    beta_N 1F1(-1/2, N, -theta^2 / 2), beta_N = sqrt(pi/2) (2N - 1)!! / (2^(N-1) (N - 1)!)."""
    from scipy import special  # (imported where used: ``import mppca_nipype`` does not load SciPy)

    beta = math.sqrt(math.pi / 2) * special.factorial2(2 * coils - 1) / (2 ** (coils - 1) * math.factorial(coils - 1))
    return beta * special.hyp1f1(-0.5, coils, -np.square(np.asarray(theta, np.float64)) / 2)


def magnitude_second_moment(theta, coils: int):
    """E[(m / sigma)^2] = theta^2 + 2N: each of the 2N real channels adds its unit variance."""
    return np.square(np.asarray(theta, np.float64)) + 2 * coils


def magnitude_sd(theta, coils: int):
    """The standard deviation of m / sigma: sqrt(E[y^2] - E[y]^2)."""
    variance = magnitude_second_moment(theta, coils) - np.square(magnitude_mean(theta, coils))
    return np.sqrt(np.maximum(variance, 0))


def magnitude_density(y, theta: float, coils: int):
    """The non-central chi density of y = m / sigma (2N degrees of freedom, non-centrality theta):
    y^N theta^(1-N) exp(-(y^2 + theta^2) / 2) I_{N-1}(theta y), written with the exponentially scaled Bessel
    function so that it neither overflows nor underflows for large theta y; at theta = 0 the central chi
    density y^(2N-1) exp(-y^2 / 2) / (2^(N-1) (N-1)!)."""
    from scipy import special

    y = np.asarray(y, np.float64)
    with np.errstate(divide="ignore"):
        if theta == 0:
            log_density = ((2 * coils - 1) * np.log(y) - y**2 / 2 - (coils - 1) * math.log(2)
                           - special.gammaln(coils))
        else:
            log_density = (coils * np.log(y) + (1 - coils) * math.log(theta) - (y - theta) ** 2 / 2
                           + np.log(special.ive(coils - 1, theta * y)))
    return np.where(y > 0, np.exp(log_density), 0.0)


@dataclass(frozen=True)
class MagnitudeStabilizer:
    """The variance-stabilising transform of y = m / sigma for ``coils`` channels and its unbiased inverse.

    ``forward`` is piecewise linear through (``knots``, ``values``) and straight beyond them with the end
    slopes; ``inverse`` interpolates theta from the table (``expected``: E[f(y) | ``thetas``]).
    """

    coils: int
    knots: np.ndarray
    values: np.ndarray
    thetas: np.ndarray
    expected: np.ndarray

    def forward(self, y):
        """x = f(y), float64, same shape."""
        y = np.asarray(y, np.float64)
        x = np.interp(y, self.knots, self.values)
        low_slope = (self.values[1] - self.values[0]) / (self.knots[1] - self.knots[0])
        high_slope = (self.values[-1] - self.values[-2]) / (self.knots[-1] - self.knots[-2])
        x = np.where(y < self.knots[0], self.values[0] + (y - self.knots[0]) * low_slope, x)
        return np.where(y > self.knots[-1], self.values[-1] + (y - self.knots[-1]) * high_slope, x)

    def inverse(self, x):
        """theta whose E[f(y) | theta] is x (0 below E[f(y) | 0]; straight beyond the table)."""
        x = np.asarray(x, np.float64)
        theta = np.interp(x, self.expected, self.thetas)
        high_slope = (self.thetas[-1] - self.thetas[-2]) / (self.expected[-1] - self.expected[-2])
        return np.where(x > self.expected[-1], self.thetas[-1] + (x - self.expected[-1]) * high_slope, theta)

    def mean_and_variance(self, theta: float):
        """E[f(y) | theta] and Var[f(y) | theta] by quadrature of the density (to check the transform)."""
        y = _quadrature_grid(theta)
        weights = _quadrature_weights(y, theta, self.coils)
        x = self.forward(y)
        mean = float(np.sum(weights * x))
        return mean, float(np.sum(weights * (x - mean) ** 2))


def _quadrature_grid(theta_max: float):
    """The y grid that holds the non-central chi mass of every theta up to ``theta_max`` (to 1e-12 for
    N <= 16): midpoints from 0 to theta_max + 14."""
    return np.arange(0.5 * Y_STEP, theta_max + 14, Y_STEP)


#: Half-width of the y window a density is computed on (the mass beyond it is below 1e-30); outside it the
#: weights are 0, not subnormal numbers that slow every product down.
WINDOW = 12.0


def _quadrature_weights(y, theta: float, coils: int):
    """Weights w with E[g(y) | theta] = w @ g(y) on the grid ``y`` (midpoint rule)."""
    weights = np.zeros_like(y)
    near = slice(np.searchsorted(y, theta - WINDOW), np.searchsorted(y, theta + WINDOW + 2 * math.sqrt(coils)))
    weights[near] = magnitude_density(y[near], theta, coils) * Y_STEP
    return weights


@lru_cache(maxsize=None)
def stabilizer(coils: int) -> MagnitudeStabilizer:
    """The transform for ``coils`` channels, built once per process (about 1 s).

    First order: f(mu) = integral of 1 / s along mu (the delta method: s(theta) and mu(theta) from
    ``magnitude_sd`` and ``magnitude_mean``). The variance of f(y) it leaves is 0.79-1.13 for Rician data; so,
    as Foi 2011 optimises the transform, the slope at mu(theta) is divided by the standard deviation of f(y)
    at theta, REFINEMENTS times: the variance then lies within 5% of 1 over theta in [0, 20]
    (``tests/test_noise_floor.py``). The inverse's table is E[f(y) | theta] by quadrature of the density.
    """
    thetas = np.arange(0, THETA_MAX + THETA_STEP / 2, THETA_STEP)
    means = magnitude_mean(thetas, coils)
    slopes = 1 / magnitude_sd(thetas, coils)
    # the quadrature: density weights of a coarser theta grid over y (rows sum to 1 within 1e-12)
    checked = thetas[(thetas <= THETA_MAX - 10) & (np.arange(thetas.size) % 10 == 0)]
    y = _quadrature_grid(THETA_MAX)
    weights = np.stack([_quadrature_weights(y, t, coils) for t in checked])
    for _ in range(REFINEMENTS):
        stable = _piecewise(means, slopes, coils, thetas)
        x = stable.forward(y)
        mean = weights @ x
        sd = np.sqrt(np.maximum(weights @ x**2 - mean**2, 1e-12))
        slopes = slopes / np.interp(thetas, checked, sd)  # beyond the checked range sd is 1 already
    stable = _piecewise(means, slopes, coils, thetas)
    x = stable.forward(y)
    expected = np.array([np.sum(_quadrature_weights(y, t, coils) * x) for t in thetas[::5]])
    expected = np.maximum.accumulate(expected)  # E[f | theta] rises with theta; rounding must not undo it
    return MagnitudeStabilizer(coils, stable.knots, stable.values, thetas[::5], expected)


def _piecewise(means, slopes, coils, thetas) -> MagnitudeStabilizer:
    """f through (mu(theta), integral of ``slopes`` d mu), 0 at mu(0); no inverse table yet."""
    values = np.concatenate([[0.0], np.cumsum(np.diff(means) * (slopes[1:] + slopes[:-1]) / 2)])
    return MagnitudeStabilizer(coils, means, values, thetas, thetas)


def _in_chunks(function, values, out, threads: int | None = 1):
    """``out[...] = function(values)`` a CHUNK of values at a time, in the arrays' own memory order (both
    contiguous, in the same order), the chunks spread over ``threads`` threads (``layout.in_parts``)."""
    order = "F" if values.flags.f_contiguous and not values.flags.c_contiguous else "C"
    flat_in, flat_out = values.reshape(-1, order=order), out.reshape(-1, order=order)
    if not np.shares_memory(flat_out, out):
        raise ValueError("the output of a chunked transform must be contiguous")

    def chunks(numbers):
        for start in range(numbers.start * CHUNK, min(numbers.stop * CHUNK, flat_in.size), CHUNK):
            flat_out[start:start + CHUNK] = function(flat_in[start:start + CHUNK])

    in_parts(chunks, -(-flat_in.size // CHUNK), flat_in.size, threads)
    return out


#: Bisection steps of ``noise_level_from_magnitude``: the bracket [sigma_mp, sigma_mp / s(0)] (a ratio under
#: 1.6) narrowed 2^14 times, to 3e-5 of sigma.
SIGMA_BISECTIONS = 14


def noise_level_from_magnitude(sigma_magnitude, mean_magnitude, coils: int, threads: int = 1, device=None,
                               block_values=None):
    """The channels' sigma from MP-PCA's noise level of magnitude data, voxel by voxel.

    MP-PCA measures the spread of m itself, sigma * s(theta), which at low SNR lies below sigma (Rayleigh
    background: 0.655 sigma). With the denoised magnitude d_t ~ sigma mu(theta_t) of each volume, sigma solves
    sigma^2 * mean over t of s^2(theta_t) = sigma_mp^2, theta_t where mu(theta_t) = d_t / sigma. Since s lies
    between s(0) and 1, sigma lies between sigma_mp and sigma_mp / s(0): found by SIGMA_BISECTIONS bisections
    (``sigma_magnitude`` (X, Y, Z), ``mean_magnitude`` (X, Y, Z, T); 0 stays 0), slabs of x-planes on
    ``threads`` threads (each voxel's arithmetic is the same whatever the slabs); or, with a torch ``device``,
    there in blocks of ``block_values`` (``gpu.series_steps.noise_level``).
    """
    thetas = np.arange(0, THETA_MAX + THETA_STEP / 2, THETA_STEP)
    means, variances = magnitude_mean(thetas, coils), np.square(magnitude_sd(thetas, coils))
    if device is not None:
        from .gpu.series_steps import noise_level

        return noise_level(sigma_magnitude, mean_magnitude, means, variances, SIGMA_BISECTIONS, device,
                           block_values)
    sigma_mp = np.asarray(sigma_magnitude, np.float64)
    sigma = np.zeros(sigma_mp.shape)
    planes = max(1, CHUNK // max(1, math.prod(mean_magnitude.shape[1:])))

    def slabs(numbers):
        for start in range(numbers.start * planes, min(numbers.stop * planes, sigma_mp.shape[0]), planes):
            x = slice(start, start + planes)
            sigma[x] = _bisected_noise_level(sigma_mp[x], mean_magnitude[x], means, variances)

    in_parts(slabs, -(-sigma_mp.shape[0] // planes), mean_magnitude.size, threads)
    return sigma


def _bisected_noise_level(sigma_mp, mean_magnitude, means, variances):
    """``noise_level_from_magnitude`` of some voxels: ``sigma_mp`` (V...) and ``mean_magnitude`` (V..., T)."""
    positive = sigma_mp > 0
    low = np.where(positive, sigma_mp, 1.0)
    high = low / math.sqrt(variances[0])
    target = low**2
    spread = np.empty(mean_magnitude.shape, np.float32)
    for _ in range(SIGMA_BISECTIONS):
        sigma = np.sqrt(low * high)
        np.divide(mean_magnitude, sigma.astype(np.float32)[..., None], out=spread)
        # s^2 as a function of the mean: that of theta = 0 below mu(0), 1 above the table
        _in_chunks(lambda mu: np.interp(mu, means, variances, right=1.0), spread, spread)
        too_large = sigma**2 * spread.mean(axis=-1, dtype=np.float64) > target
        high, low = np.where(too_large, sigma, high), np.where(too_large, low, sigma)
    return np.where(positive, np.sqrt(low * high), 0.0)


def denoise_magnitude(data, mask=None, *, noise_floor, coils=1, noise=None, denoise_options, run_options):
    """MP-PCA of magnitude data with its noise floor removed: the pipeline behind ``denoise(noise_floor=...)``.

    1. sigma: the given ``noise`` (a number or a map), or estimated: a first ``denoise`` of the magnitude
       data, its noise map corrected for the floor's narrower spread (``noise_level_from_magnitude``).
    2. x = f(m / sigma) voxel by voxel (``stabilizer(coils).forward``): noise of unit variance at any SNR.
    3. ``denoise`` of x, its noise level estimated by MP-PCA: the transform makes it about 1, and the estimate
       absorbs what sigma's error leaves (on the Rician and 4-channel phantoms its RMSE was 0-10% lower than
       with the level given as 1, the bias the same: docs/benchmarks.md, "The magnitude noise floor").
    4. A = sigma * theta, theta = ``inverse``(denoised x): unbiased where the denoised x is.

    ``denoise_options`` (extent, stride, estimator, aggregation, demean, filter, shape) and ``run_options``
    (device, nprocs, gpu_memory, progress) go to every ``denoise``. Returns a ``DenoiseResult``: the signal
    estimate A, the sigma used (0 outside the mask), the second pass's rank map, and ``info``: the second
    pass's, with ``noise_floor``, ``coils``, ``noise`` (where sigma came from: "given" or "estimated"),
    ``steps_device`` (where the transforms and the noise level ran: "cuda", with torch where the GPU engine
    runs, or "cpu", with NumPy) and ``seconds`` by step.
    """
    from . import _finite_voxels, check_data, count_negative, denoise, resolve_noise, steps_device

    data, mask = check_data(data, mask)
    check_noise_floor(noise_floor, coils)
    if noise_floor == "none":
        raise MPPCAInputError("denoise_magnitude needs a noise floor model, 'rician' or 'ncchi'")
    resolve_noise(noise, data.shape[:3], mask)  # checked before any work
    negative = count_negative(data, mask, run_options.get("nprocs"))
    if negative:
        raise MPPCAInputError(f"the input has {negative} negative values, but a noise floor models magnitude "
                              "images, which are never negative")
    seconds, last = {}, time.perf_counter()

    def lap(phase):
        nonlocal last
        now = time.perf_counter()
        seconds[phase], last = round(now - last, 4), now

    finite = _finite_voxels(data)
    threads = run_options.get("nprocs") or available_cpus()  # the steps on the host, for the CPU engine
    # the transforms and the noise level run where the engine does: with torch on the GPU, else with NumPy here
    on_gpu = steps_device(run_options.get("device", "auto"), data.shape, denoise_options,
                          run_options.get("nprocs")) == "cuda"
    device = blocks = None
    series = data  # the series both passes read: on the device between the steps where it may stay there
    if on_gpu:
        from . import resolve_gpu_memory
        from .gpu.series_steps import block_values_within, series_on_device, stays_on_device

        device = "cuda"
        budget = resolve_gpu_memory(run_options.get("gpu_memory"))
        blocks = block_values_within(budget, device)
        # kept there (the GPU engine takes a series on the device and leaves its result there), the series
        # goes up once and the result comes down once, where no budget was asked for (the engine plans
        # around what it holds) and the series is small beside the device's memory
        if budget is None and run_options.get("device") != "cpu" and stays_on_device(data.nbytes, device):
            series = series_on_device(data, device, blocks)
    if noise is None:
        first = denoise(series, mask, **denoise_options, **run_options)
        sigma = noise_level_from_magnitude(first.sigma, first.denoised, coils, threads, device=device,
                                           block_values=blocks)
        del first
        lap("first pass")
    else:
        sigma = np.asarray(noise, np.float64)
        sigma = np.broadcast_to(sigma.reshape(sigma.shape[:3]) if sigma.ndim else sigma, data.shape[:3])
    known = np.isfinite(sigma) & (sigma > 0)
    unknown = int(np.count_nonzero(mask & finite & ~known))
    if unknown:
        raise MPPCAInputError(f"the noise level is 0 at {unknown} voxels inside the mask (a constant series?): "
                              "give the noise level")
    # voxels outside the mask that patches still read: the median sigma where none is known
    scale = np.where(known, sigma, np.median(sigma[known]) if known.any() else 1.0).astype(np.float32)

    transform = stabilizer(coils)
    if on_gpu:
        from .gpu.series_steps import stabilize_series

        stabilized = stabilize_series(series, scale, transform, device, blocks)
        del series
    else:
        stabilized = np.empty_like(data)
        np.divide(data, scale[..., None], out=stabilized)
        _in_chunks(transform.forward, stabilized, stabilized, threads)
    lap("transform")
    second = denoise(stabilized, mask, **denoise_options, **run_options)
    del stabilized
    lap("second pass")
    signal = second.denoised
    if on_gpu:
        from .gpu.series_steps import unstabilize_series

        signal = unstabilize_series(signal, np.where(mask, scale, 0).astype(np.float32), transform, device,
                                    blocks)  # 0 outside the mask; on the host
    else:
        _in_chunks(transform.inverse, signal, signal, threads)
        signal *= scale[..., None]
    kept = mask & ~finite  # voxels the engine left as they were (NaN/Inf) keep the input's values
    if kept.any():
        signal[kept] = data[kept]
    if not on_gpu:
        signal[~mask] = 0
    lap("inverse")
    info = dict(second.info, noise_floor=noise_floor, coils=int(coils), steps_device="cuda" if on_gpu else "cpu",
                noise="estimated" if noise is None else "given", seconds=seconds)
    return type(second)(signal, np.where(mask & known, sigma, 0).astype(np.float32), second.rank, info)
