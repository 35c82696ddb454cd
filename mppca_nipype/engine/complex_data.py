"""Complex data: MP-PCA of the phase-demodulated real part, with no magnitude noise floor.

A complex image S = A e^{i (phi + theta)} + n, n complex Gaussian noise of standard deviation sigma per real
channel, carries its signal A on a background phase phi that varies smoothly in space and from volume to volume
(coil sensitivities, B0, motion during diffusion encoding). Its magnitude |S| has a Rician floor; but once the
background phase is known, the demodulated image S e^{-i phi} has its signal in the real part,
R = Re(S e^{-i phi}) = A + n_R, with Gaussian noise of sigma and no floor, and only noise in the imaginary part,
I = Im(S e^{-i phi}) = n_I. MP-PCA of R then removes the noise without the floor's bias (the idea of
DESIGNER-v2's ``-phase``).

``background_phase`` estimates phi per slice and volume from the complex image itself: a 2D Hann low-pass in
k-space over the central ``width`` of each in-plane axis, phi = angle of the filtered image (the method of
Eichner et al. 2015 for real-valued diffusion MRI). ``denoise_complex`` runs the whole pipeline around
``denoise``, on either engine (R is real: nothing else is engine-specific), from a magnitude and its phase or
from the complex series itself.

References: Eichner C, Cauley SF, Cohen-Adad J, et al. Real diffusion-weighted MRI enabling true signal averaging
and increased diffusion contrast. NeuroImage 122:373-384 (2015). doi:10.1016/j.neuroimage.2015.07.074.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
import time

import numpy as np

from .errors import MPPCAInputError
from .layout import in_parts, is_volume_major

#: The methods that estimate the background phase (``denoise_complex``): ``hann``, the Hann filter of the noisy
#: complex image (``background_phase``); ``mppca``, the Hann filter of the complex image first denoised by
#: MP-PCA (its real and imaginary parts as one series of 2T volumes).
PHASE_METHODS = ("hann", "mppca")

#: The default width of the Hann window: the central fraction of k-space it keeps along each in-plane axis
#: (chosen by measurement: docs/benchmarks.md, "Complex data").
PHASE_WIDTH = 0.375

#: Passes of the Hann filter (``background_phase``): the second and later filter the residual phase (chosen by
#: measurement: docs/benchmarks.md, "Complex data").
PHASE_PASSES = 3

#: The value ranges of phase images in the scanners' integer units and how each maps to radians: Siemens
#: stores [-4096, 4095] (a 12-bit value with slope 2 and intercept -4096) or [0, 4095] unscaled. Tried in this
#: order: a phase without negative values is [0, 4095] (one in [-4096, 4095] has half its values below 0).
SCANNER_UNITS = {"[0, 4095]": (0.0, 4095.0, 2 * math.pi / 4096, -math.pi),
                 "[-4096, 4095]": (-4096.0, 4095.0, math.pi / 4096, 0.0)}

#: How far beyond [-pi, 2 pi] a phase in radians may reach (rounding of a float32 file).
RADIANS_SLACK = 1e-3

#: How much coarser than the run's own the grid of ``phase_method="mppca"``'s first pass is: that pass feeds only
#: the smooth background phase, and on the complex phantoms at SNR 2-20 twice the step left the head's RMSE
#: within 0.5%, the whole image's 0.7-2% lower and the bias within 1.3 of the run's own grid, for a fraction of
#: the windows (docs/benchmarks.md, "Complex data").
FIRST_PASS_COARSENING = 2

#: How the denoised magnitude is taken from the denoised real part R_hat: its absolute value or R_hat clipped
#: at 0 (docs/benchmarks.md, "Complex data").
MAGNITUDES = ("clip", "abs")


@dataclass
class ComplexDenoiseResult:
    """What ``denoise_complex`` returns.

    Attributes
    ----------
    denoised : (X, Y, Z, T) float32 array
        The denoised magnitude (``magnitude_out``: max(R_hat, 0) or |R_hat|).
    phase : (X, Y, Z, T) float32 array
        The phase of the denoised complex image R_hat e^{i phi}, in radians in [-pi, pi): phi where R_hat >= 0,
        phi + pi where it is negative.
    sigma : (X, Y, Z) float32 array
        The noise level of the real channel (MP-PCA's estimate on R, or the given one).
    rank : (X, Y, Z) float32 array
        The number of signal components kept in R.
    info : dict
        ``denoise``'s info, with ``phase_method``, ``phase_width``, ``phase_passes``, ``phase_units`` (how
        the phase was read: ``phase_in_radians``'s units, or "complex" for a complex series),
        ``magnitude`` (``magnitude_out``), ``steps_device`` (where the steps around ``denoise`` ran: "cuda",
        with torch where the GPU engine runs, or "cpu", with NumPy),
        ``imaginary_sd_ratio`` (the median over the denoised voxels of the rms of I over time, divided by
        sigma: about 1 where phi is right) and ``seconds`` by step.
    """

    denoised: np.ndarray
    phase: np.ndarray
    sigma: np.ndarray
    rank: np.ndarray
    info: dict

    @property
    def denoised_complex(self) -> np.ndarray:
        """The denoised complex series, ``denoised`` e^{i ``phase``}, complex64."""
        return (self.denoised * np.exp(1j * self.phase)).astype(np.complex64)


def phase_in_radians(phase, shape=None):
    """(phase in radians as float32, the units found): "radians", or a scanner's integer range of
    ``SCANNER_UNITS`` rescaled to [-pi, pi).

    A phase whose values all lie in [-pi, 2 pi] is taken as radians; otherwise whole numbers within one of the
    scanner ranges are. MPPCAInputError, one sentence, for a shape other than ``shape``, a non-finite value, or
    values in neither.
    """
    phase = np.asarray(phase)
    if shape is not None and phase.shape != tuple(shape):
        raise MPPCAInputError(f"the phase's shape {phase.shape} does not match the magnitude's {tuple(shape)}")
    if not (np.issubdtype(phase.dtype, np.floating) or np.issubdtype(phase.dtype, np.integer)):
        raise MPPCAInputError(f"the phase must hold real numbers, not {phase.dtype}")
    from . import value_range

    low, high = value_range(phase)
    if not (math.isfinite(low) and math.isfinite(high)):  # (a NaN makes both NaN)
        finite = np.isfinite(phase)
        first = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise MPPCAInputError(f"the phase is NaN or Inf at {int((~finite).sum())} of its values, the first at {first}")
    if low >= -math.pi - RADIANS_SLACK and high <= 2 * math.pi + RADIANS_SLACK:
        return phase.astype(np.float32, copy=False), "radians"
    whole = np.array_equal(phase, np.round(phase))
    for units, (first, last, scale, offset) in SCANNER_UNITS.items():
        if whole and low >= first and high <= last:
            return (phase * np.float32(scale) + np.float32(offset)).astype(np.float32), units
    raise MPPCAInputError(f"the phase's values lie in [{low:.6g}, {high:.6g}]: neither radians ([-pi, pi] or "
                          f"[0, 2 pi]) nor a scanner's whole-number units ({' or '.join(reversed(SCANNER_UNITS))})")


def hann_window(size: int, width: float):
    """The 1D Hann window over the central ``width`` of ``size`` k-space samples, in FFT order (1 at k = 0)."""
    k = np.fft.fftfreq(size)  # cycles per sample, in [-0.5, 0.5)
    half = max(width / 2, 1.0 / size)  # at least the neighbours of k = 0
    return np.where(np.abs(k) < half, 0.5 + 0.5 * np.cos(np.pi * k / half), 0.0)


def check_phase_width(width) -> None:
    """MPPCAInputError, one sentence, unless ``width`` (the Hann window's) is a number in (0, 1]."""
    if isinstance(width, bool) or not (isinstance(width, (float, int, np.floating)) and 0 < width <= 1):
        raise MPPCAInputError(f"phase_width must be a number in (0, 1], not {width!r}")


def background_phase(image, *, width=PHASE_WIDTH, passes=PHASE_PASSES, threads=None):
    """The smooth background phase of a complex series (X, Y, Z, T), per slice (z) and volume, in radians.

    Each in-plane image multiplied in k-space by a separable 2D Hann window that keeps the central
    ``width`` of each axis (its response falls to 0 at |k| = width / 2 cycles per voxel), phi = angle of the
    filtered image. Each further pass filters the image demodulated by the phase so far and adds the angle of
    what is left: the residual phase is small and nearly flat, so the filter's averaging over a region where
    the magnitude changes (an edge of the head) no longer pulls it towards the bright side. Returns float32 of
    the same shape, wrapped to [-pi, pi). The volumes are spread over ``threads`` threads (None: the CPUs this
    process may use; ``layout.in_parts``), each volume's arithmetic the same on any number.
    """
    check_phase_width(width)
    from scipy import fft

    window = (hann_window(image.shape[0], width)[:, None] * hann_window(image.shape[1], width)[None, :])
    phase = np.zeros(image.shape, np.float32)

    def volumes(ts):  # a volume at a time bounds the complex temporaries
        for t in range(ts.start, ts.stop):
            volume, phi = image[..., t], phase[..., t]
            for _ in range(passes):
                spectrum = fft.fft2(volume * np.exp(-1j * phi), axes=(0, 1), workers=1)
                spectrum *= window[:, :, None]
                phi += np.angle(fft.ifft2(spectrum, axes=(0, 1), workers=1)).astype(np.float32)
            phi[...] = np.mod(phi + np.pi, 2 * np.pi) - np.pi

    in_parts(volumes, image.shape[3], image.size, threads)
    return phase


def _by_slabs(work, series, threads):
    """``work(index)`` over slabs of the (X, Y, Z, T) ``series`` along its slowest axis in memory (x, or t for a
    volume-major series), on ``threads`` threads: elementwise steps over the whole series."""
    if is_volume_major(series):
        in_parts(lambda ts: work((Ellipsis, ts)), series.shape[3], series.size, threads)
    else:
        in_parts(lambda xs: work((xs,)), series.shape[0], series.size, threads)


def denoise_complex(magnitude, phase=None, mask=None, *, phase_method="hann", phase_width=PHASE_WIDTH,
                    phase_passes=PHASE_PASSES, magnitude_out="clip", extent=None, stride=None, estimator=None,
                    aggregation=None, demean=None, filter=None, shape=None,  # noqa: A002
                    noise=None, device="auto", nprocs=None, gpu_memory=None, progress=None):
    """MP-PCA of complex data: the background phase removed, the real part denoised, the phase put back.

    1. S = magnitude e^{i phase} (``phase`` in radians or a scanner's units: ``phase_in_radians``), or the
       complex series given as ``magnitude`` (``phase`` None).
    2. phi = ``background_phase``(S) per slice and volume (``phase_method="hann"``), or of S first denoised
       by ``denoise`` of its real and imaginary parts stacked as 2T volumes, on a grid FIRST_PASS_COARSENING
       times as coarse (``"mppca"``: less noise in phi, at the cost of a second pass over twice the volumes).
    3. R = Re(S e^{-i phi}), I = Im(S e^{-i phi}); R has Gaussian noise and no floor, I is noise alone.
    4. R_hat = ``denoise``(R) with the denoising options, ``noise`` (the real channel's sigma, when known),
       ``device``, ``nprocs``, ``gpu_memory`` and ``progress`` as ``denoise`` takes them (None: its defaults).
    5. The magnitude max(R_hat, 0) (``magnitude_out="clip"``) or |R_hat| (``"abs"``); the phase of
       R_hat e^{i phi}.

    Parameters
    ----------
    magnitude : (X, Y, Z, T) array
        The modulus of the complex series (not negative); or the complex series itself (a complex dtype),
        then without ``phase``.
    phase : (X, Y, Z, T) array
        The magnitude's phase: radians, or a scanner's whole-number units (``phase_in_radians``).
    mask : (X, Y, Z) array, optional
        As for ``denoise``.
    phase_method : {"hann", "mppca"}
        How phi is estimated (step 2; docs/options.md, "Complex data").
    phase_width, phase_passes : float, int
        The Hann window's width (the central fraction of k-space along each in-plane axis) and its passes.
    magnitude_out : {"clip", "abs"}
        How the denoised magnitude is taken from R_hat (step 5).
    extent, stride, estimator, aggregation, demean, filter, shape, noise, device, nprocs, gpu_memory, progress
        As for ``denoise`` (None: its defaults, but for ``filter``: ``COMPLEX_FILTER``, optthresh, which
        leaves the least bias); ``noise`` is the sigma of each real channel.

    Returns
    -------
    ComplexDenoiseResult
    """
    from . import (DEFAULTS, _finite_voxels, check_data, coarse_stride, count_negative, default_filter, denoise,
                   resolve_gpu_memory, steps_device)

    options = {name: DEFAULTS[name] if value is None else value
               for name, value in dict(extent=extent, stride=stride, estimator=estimator, aggregation=aggregation,
                                       demean=demean, filter=filter or default_filter(True), shape=shape).items()}

    seconds, last = {}, time.perf_counter()

    def lap(step):
        nonlocal last
        now = time.perf_counter()
        seconds[step], last = round(now - last, 4), now

    if phase_method not in PHASE_METHODS:
        raise MPPCAInputError(f"phase_method must be one of {', '.join(PHASE_METHODS)}, not {phase_method!r}")
    if magnitude_out not in MAGNITUDES:
        raise MPPCAInputError(f"magnitude_out must be one of {', '.join(MAGNITUDES)}, not {magnitude_out!r}")
    check_phase_width(phase_width)
    threads = nprocs  # the host's elementwise steps and FFTs (None: the CPUs this process may use)
    if np.iscomplexobj(magnitude):
        if phase is not None:
            raise MPPCAInputError("a complex series carries its own phase; give it without a phase")
        image = np.array(magnitude, dtype=np.complex64)  # a copy: it is demodulated in place below
        magnitude, mask = check_data(np.abs(image), mask)  # NaN/Inf in either part: not finite here
        finite = np.isfinite(magnitude)
        image[~finite] = 0
        radians, units = None, "complex"
    else:
        if phase is None:
            raise MPPCAInputError("the magnitude needs its phase (or give the complex series itself)")
        magnitude, mask = check_data(magnitude, mask)
        radians, units = phase_in_radians(phase, magnitude.shape)
        negative = count_negative(magnitude, mask, threads)
        if negative:
            raise MPPCAInputError(f"the magnitude has {negative} negative values; with a phase it must be the "
                                  "modulus of the complex image")
        image = None  # built where the steps run (below)
    run_options = dict(device=device, nprocs=nprocs, gpu_memory=gpu_memory, progress=progress)

    # phase_method "mppca": the complex series denoised as 2T real volumes, on a coarser grid (centre
    # aggregation takes every voxel's own window: stride 1)
    first = dict(options)
    if options["aggregation"] != "center":
        first["stride"] = coarse_stride((*magnitude.shape[:3], 2 * magnitude.shape[3]),
                                        options["stride"] * FIRST_PASS_COARSENING, extent=options["extent"],
                                        shape=options["shape"])

    def first_pass(parts):
        return denoise(parts, mask, **first, **run_options).denoised

    # the steps over the whole series run where the engine does: with torch on the GPU, else with NumPy here
    on_gpu = steps_device(device, magnitude.shape, options, nprocs) == "cuda"
    if on_gpu:
        from .gpu.series_steps import block_values_within

        budget = resolve_gpu_memory(gpu_memory)
        blocks = block_values_within(budget, "cuda")  # (the engine's budget holds only while it runs)
        real, background, imaginary_power = _demodulated_on_gpu(magnitude, radians, image, phase_method=phase_method,
                                                                width=phase_width, passes=phase_passes,
                                                                first_pass=first_pass, lap=lap, budget=budget,
                                                                blocks=blocks, engine_on_gpu=device != "cpu")
    else:
        real, background, imaginary = _demodulated(magnitude, radians, image, phase_method=phase_method,
                                                   width=phase_width, passes=phase_passes, threads=threads,
                                                   first_pass=first_pass, lap=lap)
    del image
    lap("demodulation")
    result = denoise(real, mask, **options, noise=noise, **run_options)  # (R on the device: R_hat there too)
    del real
    lap("denoise")
    denoised = result.denoised
    on_device = not isinstance(denoised, np.ndarray)
    if on_device:
        from .gpu.series_steps import denoised_magnitude, finite_voxels
    served = mask & (finite_voxels(denoised) if on_device else _finite_voxels(denoised)) & (result.sigma > 0)
    ratio = None
    if served.any():
        rms = (np.sqrt(imaginary_power[served]) if on_gpu
               else np.sqrt(np.mean(np.square(imaginary[served], dtype=np.float64), axis=1)))
        ratio = float(np.median(rms / result.sigma[served]))
    if on_gpu:
        from .gpu.series_steps import remodulated_phase

        out_phase = remodulated_phase(denoised, background, mask, "cuda", blocks)
    else:
        del imaginary
        out_phase = _remodulated_phase(denoised, background, mask, threads)
    del background
    magnitude_denoised = (denoised_magnitude(denoised, magnitude_out, "cuda", blocks) if on_device
                          else _denoised_magnitude(denoised, magnitude_out, threads))  # (R_hat is not needed after)
    lap("remodulation")
    info = dict(result.info, phase_method=phase_method, phase_width=float(phase_width),
                phase_passes=int(phase_passes), phase_units=units, steps_device="cuda" if on_gpu else "cpu",
                **(dict(phase_first_pass_stride=int(first["stride"])) if phase_method == "mppca" else {}),
                magnitude=magnitude_out, imaginary_sd_ratio=ratio, seconds=dict(result.info["seconds"], **seconds))
    return ComplexDenoiseResult(magnitude_denoised.astype(np.float32, copy=False), out_phase, result.sigma,
                                result.rank, info)


def _demodulated(magnitude, radians, image, *, phase_method, width, passes, threads, first_pass, lap):
    """``denoise_complex``'s steps 1-3 with NumPy on ``threads`` threads: (R, phi, I), float32 in
    ``magnitude``'s order. ``image``: the complex series (its non-finite values 0), or None to build it from
    ``magnitude`` and ``radians``; ``first_pass``: ``denoise`` of a series, for ``phase_method="mppca"``."""
    finite = np.isfinite(magnitude)
    if image is None:
        image = np.empty(magnitude.shape, np.complex64, order="F" if is_volume_major(magnitude) else "C")

        def modulate(s):
            image[s] = np.where(finite[s], magnitude[s], 0).astype(np.complex64) * np.exp(
                1j * radians[s]).astype(np.complex64)

        _by_slabs(modulate, image, threads)
    if phase_method == "mppca":
        first = first_pass(np.concatenate([image.real, image.imag], axis=3))
        n_volumes = magnitude.shape[3]
        background = background_phase(first[..., :n_volumes] + 1j * first[..., n_volumes:], width=width,
                                      passes=passes, threads=threads)
        del first
        lap("first pass")
    else:
        background = background_phase(image, width=width, passes=passes, threads=threads)
    real, imaginary = (np.empty(image.shape, np.float32, order="F" if is_volume_major(image) else "C")
                       for _ in range(2))

    def demodulate(s):
        demodulated = image[s] * np.exp(-1j * background[s]).astype(np.complex64)
        real[s] = np.where(finite[s], demodulated.real, magnitude[s])  # NaN/Inf stay where the engine expects them
        imaginary[s] = demodulated.imag

    _by_slabs(demodulate, image, threads)
    return real, background, imaginary


def _demodulated_on_gpu(magnitude, radians, image, *, phase_method, width, passes, first_pass, lap, budget, blocks,
                        engine_on_gpu):
    """``_demodulated`` with torch on the GPU (``gpu.series_steps``), the complex series never built on the
    host: (R, phi, the mean over volumes of I^2 per voxel). phi stays on the device for the remodulation,
    and R for the GPU engine (``engine_on_gpu``; ``denoise`` takes a series on the device and leaves R_hat
    there for the remodulation), where no GPU memory budget was asked for (``budget`` None: the engine plans
    around what it holds) and each is small beside the device's memory (``series_steps.stays_on_device``);
    blocks of ``blocks`` values. Kept there, R skips its copy down, the engine's staging and copy up, and
    R_hat its copy down and back up for the remodulation; so do the first pass's parts and their denoised
    copy, for ``phase_method="mppca"``."""
    from .gpu.series_steps import complex_parts, demodulate_series, stays_on_device

    smoothed = None
    if phase_method == "mppca":  # (real and imaginary parts: twice the series' bytes)
        keep_parts = budget is None and engine_on_gpu and stays_on_device(magnitude.size * 8, "cuda")
        smoothed = first_pass(complex_parts(magnitude, radians, image, device="cuda", keep=keep_parts,
                                            block_values=blocks))
        lap("first pass")
    keep_phase = budget is None and stays_on_device(magnitude.size * 4, "cuda")
    return demodulate_series(magnitude, radians, image, smoothed, width=width, passes=passes, device="cuda",
                             keep_phase=keep_phase, keep_real=keep_phase and engine_on_gpu, block_values=blocks)


def _remodulated_phase(denoised, background, mask, threads):
    """``denoise_complex``'s step 5, the phase, with NumPy on ``threads`` threads: that of R_hat e^{i phi},
    0 outside the mask; ``background`` (phi) turned into it in place."""
    out_phase = background

    def remodulate(s):
        turned = np.where(denoised[s] >= 0, background[s], background[s] + np.float32(math.pi))
        out_phase[s] = np.mod(turned + math.pi, 2 * math.pi) - math.pi

    _by_slabs(remodulate, denoised, threads)
    out_phase[~mask] = 0
    return out_phase


def _denoised_magnitude(denoised, magnitude_out, threads):
    """``denoise_complex``'s step 5, the magnitude, in place: R_hat = ``denoised`` becomes max(R_hat, 0)
    (``magnitude_out="clip"``) or |R_hat| (``"abs"``), on ``threads`` threads (on either engine: one cheap pass
    over the series, with no new series to allocate and write for the first time)."""

    def take(s):
        if magnitude_out == "abs":
            np.abs(denoised[s], out=denoised[s])
        else:
            np.maximum(denoised[s], 0, out=denoised[s])

    _by_slabs(take, denoised, threads)
    return denoised
