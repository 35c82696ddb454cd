"""Synthetic series with a known ground truth, for examples, tests and benchmarks (no download needed).

``low_rank_phantom`` is a rank-P signal on a baseline near 1000 plus Gaussian noise (the benchmarks'
``lowrank`` phantom); ``dwi_phantom`` is a head-shaped diffusion-weighted series from a three-compartment
tensor model, with b-values and gradient directions, so that its signal is low rank only approximately, as
real data are. ``complex_dwi_phantom`` is that series as a complex image on a smooth background phase that
changes from volume to volume, returned as magnitude and phase. ``multi_echo_phantom`` is a multi-echo
fMRI-like series: every echo decays with the same R2* and carries the same BOLD fluctuations, scaled by its
echo time.
"""

from __future__ import annotations

import numpy as np


def _smooth_fields(rng, shape, count, waves=3, frequencies=(0.5, 2.5)):
    """``count`` smooth random fields on ``shape``, each a sum of a few cosines of ``frequencies`` (cycles
    across the image, per axis), in [-1, 1]."""
    axes = np.meshgrid(*(np.linspace(0, 1, s) for s in shape), indexing="ij")
    fields = np.zeros((count, *shape))
    for k in range(count):
        for _ in range(waves):
            freq = rng.uniform(*frequencies, size=3)
            phase = rng.uniform(0, 2 * np.pi)
            fields[k] += np.cos(2 * np.pi * sum(f * a for f, a in zip(freq, axes)) + phase)
        fields[k] /= np.abs(fields[k]).max()
    return fields


def low_rank_phantom(shape=(64, 64, 40), n_volumes=48, rank=5, sigma=5.0, baseline=1000.0, seed=0):
    """A rank-``rank`` series on a baseline near ``baseline`` plus Gaussian noise of std ``sigma``.

    Returns ``(noisy, truth)``, float32 arrays of shape ``(*shape, n_volumes)``.
    """
    rng = np.random.default_rng(seed)
    spatial = _smooth_fields(rng, shape, rank)
    temporal = rng.standard_normal((rank, n_volumes))
    truth = baseline + 50.0 * np.tensordot(spatial, temporal, axes=(0, 0))
    noisy = truth + sigma * rng.standard_normal(truth.shape)
    return noisy.astype(np.float32), truth.astype(np.float32)


def gradient_table(n_volumes, bvalue=1000.0, n_b0=None, seed=0):
    """b-values and unit gradient directions: ``n_b0`` b=0 volumes then directions spread on the sphere."""
    n_b0 = max(1, n_volumes // 10) if n_b0 is None else n_b0
    n_dirs = n_volumes - n_b0
    # a Fibonacci spiral on the half sphere: roughly uniform, deterministic
    i = np.arange(n_dirs) + 0.5
    z = 1 - i / n_dirs
    phi = np.pi * (1 + 5**0.5) * i
    dirs = np.stack([np.sqrt(1 - z**2) * np.cos(phi), np.sqrt(1 - z**2) * np.sin(phi), z], axis=1)
    bvals = np.concatenate([np.zeros(n_b0), np.full(n_dirs, bvalue)])
    bvecs = np.concatenate([np.zeros((n_b0, 3)), dirs])
    return bvals, bvecs


def dwi_phantom(shape=(64, 64, 40), n_volumes=48, sigma=20.0, bvalue=1000.0, seed=0, rician=False, coils=1):
    """A head-shaped DWI series: an ellipsoid of three tissues with smoothly varying fibre orientation.

    Returns ``(noisy, truth, bvals, bvecs)``; the series are float32 of shape ``(*shape, n_volumes)``.
    Outside the head the signal is 0 (plus noise). With ``rician=True`` the noise is Rician (the magnitude
    of a complex Gaussian), as in magnitude images; with ``coils=N`` as well, non-central chi: the root sum
    of squares of N complex channels, each with noise of std ``sigma`` per real part, whose signals' squares
    add up to the truth's.
    """
    if coils != 1 and not rician:
        raise ValueError("coils > 1 describes magnitude data: give rician=True as well")
    rng = np.random.default_rng(seed)
    bvals, bvecs = gradient_table(n_volumes, bvalue, seed=seed)
    axes = np.meshgrid(*(np.linspace(-1, 1, s) for s in shape), indexing="ij")
    radius = np.sqrt((axes[0] / 0.9) ** 2 + (axes[1] / 0.8) ** 2 + (axes[2] / 0.85) ** 2)
    head = radius < 1
    fields = _smooth_fields(rng, shape, 4)
    csf = np.clip(1.2 - 4 * radius * (0.8 + 0.2 * fields[0]), 0, 1) * head
    white = np.clip(0.5 + 0.5 * fields[1], 0, 1) * (1 - csf) * head
    grey = (1 - csf - white) * head
    # fibre direction: a smooth field on the sphere
    fibre = np.stack([np.cos(np.pi * fields[2]), np.sin(np.pi * fields[2]), 0.5 * fields[3]], axis=-1)
    fibre /= np.linalg.norm(fibre, axis=-1, keepdims=True)
    cos2 = (fibre @ bvecs.T) ** 2  # (X, Y, Z, T)
    b = bvals / 1000.0  # in ms/um^2, diffusivities in um^2/ms
    s_white = np.exp(-b * (0.3 + (1.7 - 0.3) * cos2))
    s_grey = np.exp(-b * 0.8)
    s_csf = np.exp(-b * 3.0)
    s0 = 1000.0 * (1 + 0.1 * fields[0])
    truth = s0[..., None] * (white[..., None] * s_white + grey[..., None] * s_grey
                             + csf[..., None] * 1.6 * s_csf)
    if rician:
        real = truth + sigma * rng.standard_normal(truth.shape)
        imag = sigma * rng.standard_normal(truth.shape)
        noisy = real**2 + imag**2
        for _ in range(2 * (coils - 1)):  # the other channels' real and imaginary parts: noise only
            noisy += (sigma * rng.standard_normal(truth.shape)) ** 2
        noisy = np.sqrt(noisy)
    else:
        noisy = truth + sigma * rng.standard_normal(truth.shape)
    return noisy.astype(np.float32), truth.astype(np.float32), bvals, bvecs


#: The background phase's spatial frequencies, in cycles across the image per axis: at most one cycle, so that
#: on a 32-voxel phantom it changes by at most about 0.9 rad from voxel to voxel.
PHASE_FREQUENCIES = (0.25, 1.0)


def background_phase_field(shape, n_volumes, *, amplitude=np.pi, drift=0.5 * np.pi, seed=0):
    """A smooth background phase in radians, (*shape, n_volumes): one slowly varying field of peak ``amplitude``
    shared by every volume (coil sensitivities, B0) plus, per volume, a field of peak ``drift`` (the phase that
    motion during diffusion encoding adds to each volume), each a sum of two cosines of PHASE_FREQUENCIES
    (``_smooth_fields``)."""
    rng = np.random.default_rng(seed + 1)
    shared = amplitude * _smooth_fields(rng, shape, 1, waves=2, frequencies=PHASE_FREQUENCIES)[0]
    per_volume = drift * _smooth_fields(rng, shape, n_volumes, waves=2, frequencies=PHASE_FREQUENCIES)
    return (shared[..., None] + np.moveaxis(per_volume, 0, -1)).astype(np.float32)


def complex_dwi_phantom(shape=(64, 64, 40), n_volumes=48, sigma=20.0, bvalue=1000.0, seed=0):
    """``dwi_phantom``'s signal as a complex image: truth e^{i phi} plus complex Gaussian noise of std ``sigma``
    in each of the real and imaginary parts, phi a smooth background phase (``background_phase_field``).

    Returns ``(magnitude, phase, truth, phi, bvals, bvecs)``: the noisy image's modulus and its phase in radians
    in [-pi, pi), the noise-free magnitude and the background phase, float32 of shape ``(*shape, n_volumes)``.
    The magnitude alone is the Rician series ``dwi_phantom(..., rician=True)`` models.
    """
    _, truth, bvals, bvecs = dwi_phantom(shape, n_volumes, sigma=0.0, bvalue=bvalue, seed=seed)
    phi = background_phase_field(shape, n_volumes, seed=seed)
    rng = np.random.default_rng(seed + 2)
    noise = rng.standard_normal((2, *truth.shape))
    image = truth * np.exp(1j * phi) + sigma * (noise[0] + 1j * noise[1])
    return (np.abs(image).astype(np.float32), np.angle(image).astype(np.float32), truth, phi, bvals, bvecs)


def multi_echo_phantom(shape=(64, 64, 40), n_volumes=600, echo_times=(14.0, 38.0, 62.0), sigma=8.0,
                       components=4, seed=0):
    """A multi-echo fMRI-like series: S_e(x, t) = S0(x) exp(-TE_e R2*(x, t)) plus Gaussian noise of std
    ``sigma`` per echo.

    S0 is smooth between 600 and 1000; R2*(x, t) = R2*_0(x) (20-40 /s) + a BOLD change of ``components``
    smooth spatial maps times slow random time courses (about 0.5 /s rms), so that the echoes share their
    temporal components, each scaled by its echo time (ms) and its own decay. Returns ``(noisy, truth)``,
    float32 of shape ``(*shape, E, n_volumes)``: the (X, Y, Z, E, T) layout ``denoise`` takes.
    """
    rng = np.random.default_rng(seed)
    s0 = 800.0 + 200.0 * _smooth_fields(rng, shape, 1)[0]
    r2_base = 30.0 + 10.0 * _smooth_fields(rng, shape, 1)[0]
    maps = _smooth_fields(rng, shape, components)
    # slow time courses: white noise smoothed over ~8 volumes, scaled to unit rms
    kernel = np.hanning(17)
    courses = np.stack([np.convolve(rng.standard_normal(n_volumes + 16), kernel, mode="valid")[:n_volumes]
                        for _ in range(components)])
    courses /= np.sqrt(np.mean(courses**2, axis=1, keepdims=True))
    r2 = r2_base[..., None] + 0.5 / np.sqrt(components) * np.tensordot(maps, courses, axes=(0, 0))  # (X,Y,Z,T)
    times = np.asarray(echo_times, dtype=np.float64) / 1000.0
    truth = s0[..., None, None] * np.exp(-times[None, None, None, :, None] * r2[..., None, :])
    noisy = truth + sigma * rng.standard_normal(truth.shape)
    return noisy.astype(np.float32), truth.astype(np.float32)
