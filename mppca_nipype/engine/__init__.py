"""MP-PCA denoising of 4D arrays: arrays in, arrays out; no files, no Nipype.

``denoise`` validates the options, lays out the patches (``patches``), and hands the work to a backend:
``cpu`` (NumPy/OpenBLAS, a process pool with one BLAS thread per process) or ``gpu`` (Triton kernels and
cuSOLVER's batched eigensolver). Both share the estimators (``estimators``) and the patch plan, so they
compute the same function.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
import math
import numbers
import os
import sys
import threading
import time
import warnings

import numpy as np

from . import costs
from .backend import DenoiseOptions, GPUMemory, PatchSums, available_cpus
from .errors import GPUOutOfMemoryError, MPPCAInputError, MPPCAWarning, is_out_of_memory
from .estimators import AGGREGATIONS, DEMEANING, ESTIMATORS, FILTERS
from .groups import GROUP_DEMEANING, denoise_by_groups, shell_labels
from .noise_floor import NOISE_FLOORS, check_noise_floor, denoise_magnitude
from .layout import as_float32, empty_like_series, in_parts, is_volume_major, planes_of_rows
from .maps import MAPS, removed_variance, resolve_maps
from .patches import (FEW_SAMPLES, PATCH_SHAPES, PatchPlan, check_sphere_stride, largest_sphere_stride,
                      plan_patches, resolve_extent, resolve_sphere)

__all__ = ["denoise", "DenoiseResult", "estimate_noise", "NoiseResult", "DenoiseOptions", "MPPCAInputError",
           "MPPCAWarning", "GPUOutOfMemoryError", "MIN_VOLUMES", "DEFAULTS", "NOISE_STRIDE", "available_cpus",
           "check_device", "choose_device", "resolve_gpu_memory", "resolve_noise", "resolve_options",
           "GPU_MEMORY_VARIABLE", "NOISE_FLOORS", "GROUP_DEMEANING", "shell_labels", "MAPS", "PATCH_SHAPES",
           "noise_stride", "COMPLEX_FILTER", "default_filter"]

#: MP-PCA needs at least two usable components to tell signal from noise; removing the voxel means costs
#: one, so three volumes is the floor.
MIN_VOLUMES = 3

#: The defaults, chosen by measurement (docs/benchmarks.md, "Choosing the defaults").
DEFAULTS = dict(extent="wide", stride=3, estimator="olesen2023", aggregation="gaussian", demean="volume",
                filter="optshrink", shape="cuboid")
#: The filter of complex data (``denoise_complex``): denoised for a magnitude without the noise floor's bias,
#: and optthresh leaves little of it at every SNR. On the complex phantoms at SNR 2, 5, 10 and 20 its mean bias
#: where the true signal is below 3 sigma was 6%, 16%, 4% and 18% of magnitude-only MP-PCA's with the defaults
#: (with optshrink: 1%, 13%, 49%, 3%), the head's RMSE 1-7% above optshrink's (docs/benchmarks.md, "Complex
#: data").
COMPLEX_FILTER = "optthresh"
#: MRtrix3 dwidenoise's method, which ``denoise`` reproduces with these options (docs/options.md).
DWIDENOISE_MODE = dict(extent="auto", stride=1, aggregation="center", demean="none", estimator="exp2", filter="hard")

#: ``estimate_noise``'s grid step: coarser than ``denoise``'s, chosen by measurement (docs/benchmarks.md,
#: "The noise map alone").
NOISE_STRIDE = 7

DEVICES = ("auto", "cpu", "cuda")

#: The environment variable that gives the GPU memory budget where the call does not (``resolve_gpu_memory``):
#: a batch system's job script can set it once for every run.
GPU_MEMORY_VARIABLE = "MPPCA_GPU_MEMORY"


@dataclass
class DenoiseResult:
    """What ``denoise`` returns.

    Attributes
    ----------
    denoised : (X, Y, Z, T) float32 array
        The denoised series, in the input's memory order. Outside the mask: 0. Voxels holding NaN/Inf: as
        they were.
    sigma : (X, Y, Z) float32 array
        The noise level (standard deviation) estimated by MP-PCA: the patch's own value (``center``) or
        the weighted mean of the patches covering the voxel. 0 outside the mask.
    rank : (X, Y, Z) float32 array
        The number of signal components kept (same aggregation as ``sigma``). 0 outside the mask.
    info : dict
        How the run was done: resolved options, backend, device, patch counts, and ``seconds``: the time of
        each phase of the call (input check, plan, backend, output).
    lambda_plus : (X, Y, Z) float32 array or None
        Asked for with ``maps``: each patch's Marchenko-Pastur upper edge sigma^2 (1 + sqrt(gamma))^2, in the
        data's variance units (``estimators.marchenko_pastur_edge``), aggregated as ``sigma``. 0 outside the
        mask. None when not asked for.
    variance_removed : (X, Y, Z) float32 array or None
        Asked for with ``maps``: the mean over volumes of (input - denoised)^2 (``maps.removed_variance``).
        0 outside the mask. None when not asked for.
    """

    denoised: np.ndarray
    sigma: np.ndarray
    rank: np.ndarray
    info: dict = field(default_factory=dict)
    lambda_plus: np.ndarray | None = None
    variance_removed: np.ndarray | None = None


def _check_choice(name, value, choices):
    if value not in choices:
        raise MPPCAInputError(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def resolve_options(data_shape, /, *, extent, stride, estimator, aggregation, demean, noise=None,
                    mask=None, filter="hard", removed_means=0, shape="cuboid") -> DenoiseOptions:  # noqa: A002
    """Check every option against the data's shape; raise MPPCAInputError with one sentence if wrong.

    ``shape``, the patch shape: for a sphere the resolved extent is its bounding cube
    (``patches.resolve_sphere``), which must fit the image, and the stride's grid of centres must leave no
    voxel farther than the radius from every centre (``patches.check_sphere_stride``).

    ``noise`` and ``mask`` as ``denoise`` takes them (``resolve_noise``). ``removed_means``: the means per
    voxel taken out of the series before it came here (the group contrasts of ``groups.denoise_by_groups``).
    """
    _check_choice("estimator", estimator, ESTIMATORS)
    _check_choice("filter", filter, FILTERS)
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_choice("demean", demean, DEMEANING)
    _check_choice("shape", shape, PATCH_SHAPES)
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
        raise MPPCAInputError(f"stride must be a positive integer, not {stride!r}")
    if aggregation == "center" and stride != 1:
        raise MPPCAInputError("aggregation 'center' takes each voxel from its own patch and needs stride 1")
    n_volumes = data_shape[3]
    try:
        extent = resolve_extent(extent, data_shape[:3], n_volumes)
        if shape == "sphere":
            extent = resolve_sphere(extent, data_shape[:3])
            check_sphere_stride(data_shape[:3], extent[0] // 2, stride)
    except ValueError as err:
        raise MPPCAInputError(str(err)) from None
    return DenoiseOptions(extent, int(stride), estimator, aggregation, demean, filter,
                          noise_variance=resolve_noise(noise, data_shape[:3], mask), removed_means=int(removed_means),
                          shape=shape)


def resolve_noise(noise, spatial_shape, mask=None):
    """The given noise level as ``DenoiseOptions.noise_variance``: None, sigma^2, or a flat float64 map of
    sigma^2 (0 where a voxel outside the mask has no usable value).

    ``noise`` is None, a positive number, or an (X, Y, Z) array of sigma on the input's grid (a trailing
    axis of length 1 allowed). Inside the mask (everywhere without one) every value must be finite and
    positive; outside it, non-finite or non-positive values are allowed (a map masked to the brain) and
    such voxels are left out of the patches' mean sigma^2.
    """
    if noise is None:
        return None
    if isinstance(noise, (numbers.Real, np.floating, np.integer)) and not isinstance(noise, bool):
        if not (math.isfinite(noise) and noise > 0):
            raise MPPCAInputError(f"the given noise level must be a positive number, not {noise!r}")
        return float(noise) ** 2
    sigma = np.asarray(noise)
    if sigma.ndim == 4 and sigma.shape[3] == 1:
        sigma = sigma[..., 0]
    if not (np.issubdtype(sigma.dtype, np.floating) or np.issubdtype(sigma.dtype, np.integer)):
        raise MPPCAInputError(f"the given noise level must be a number or a 3D array of numbers, not "
                              f"{sigma.dtype} values")
    if sigma.shape != tuple(spatial_shape):
        raise MPPCAInputError(f"the noise map's shape {sigma.shape} does not match the image's "
                              f"{tuple(spatial_shape)}")
    sigma = sigma.astype(np.float64)
    usable = np.isfinite(sigma) & (sigma > 0)
    inside = np.ones(sigma.shape, dtype=bool) if mask is None else np.asarray(mask) != 0
    bad = inside & ~usable
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        where = "inside the mask" if mask is not None else "(allowed only outside a mask)"
        raise MPPCAInputError(f"the noise map is not a positive finite number at {int(bad.sum())} voxels "
                              f"{where}, the first at {first}")
    return np.where(usable, sigma, 0.0).reshape(-1) ** 2


def resolve_gpu_memory(value, environ=os.environ) -> GPUMemory | None:
    """The GPU memory budget asked for, as a ``GPUMemory``; None: all the device can give this process.

    ``value``: a number of GiB (> 0; a number or its text, "8", "8GiB" or "8G"), or a share of the device's
    memory ("50%": two jobs sharing a GPU ask half each), or a ``GPUMemory``; None takes the environment
    variable ``GPU_MEMORY_VARIABLE`` (``MPPCA_GPU_MEMORY``) when it is set and not empty.
    """
    source = "the GPU memory budget"
    if value is None:
        value = environ.get(GPU_MEMORY_VARIABLE, "").strip() or None
        source = f"{GPU_MEMORY_VARIABLE}"
    if value is None or isinstance(value, GPUMemory):
        return value
    unit, amount = "GiB", value
    if isinstance(value, str):
        text = value.strip()
        for suffix, name in (("%", "%"), ("GiB", "GiB"), ("G", "GiB")):
            if text.endswith(suffix):
                text, unit = text[:-len(suffix)].strip(), name
                break
        try:
            amount = float(text)
        except ValueError:
            amount = None
    if (isinstance(amount, bool) or not isinstance(amount, (numbers.Real, np.floating, np.integer))
            or not math.isfinite(amount) or amount <= 0 or (unit == "%" and amount > 100)):
        raise MPPCAInputError(f"{source} must be a positive number of GiB (8, 8GiB) or a share of the GPU's "
                              f"memory (50%), not {value!r}")
    return GPUMemory(float(amount), unit)


def check_data(data, mask):
    """Validate the array and mask; return (data as float32, in its own order where it is contiguous:
    ``layout``; mask as bool)."""
    data = np.asarray(data)
    if data.ndim != 4:
        raise MPPCAInputError(f"the input must be a 4D series (X, Y, Z, T), not {data.ndim}D {data.shape}")
    if not (np.issubdtype(data.dtype, np.floating) or np.issubdtype(data.dtype, np.integer)):
        raise MPPCAInputError(f"the input must hold real numbers, not {data.dtype}")
    if data.shape[3] < MIN_VOLUMES:
        raise MPPCAInputError(
            f"the input has {data.shape[3]} volumes; MP-PCA needs at least {MIN_VOLUMES}")
    if min(data.shape[:3]) < 1:
        raise MPPCAInputError(f"the input has an empty spatial dimension {data.shape[:3]}")
    if mask is None:
        mask = np.ones(data.shape[:3], dtype=bool)
    else:
        mask = np.asarray(mask)
        if mask.shape != data.shape[:3]:
            raise MPPCAInputError(
                f"the mask's shape {mask.shape} does not match the image's {data.shape[:3]}")
        mask = mask != 0
    return as_float32(data), mask


def count_negative(data, mask, threads=None) -> int:
    """How many values of the 4D ``data`` (contiguous, either order) lie below 0 in the voxels of the (X, Y, Z)
    bool ``mask`` (NaN is not), counted in slabs along the slowest axis in memory on threads
    (``layout.in_parts``): one pass, the masked values not gathered into a copy."""
    volume_major = is_volume_major(data)
    inside = None if mask.all() else mask[..., None]
    counts = []

    def count(part):
        where = (Ellipsis, part) if volume_major else (part,)
        with np.errstate(invalid="ignore"):
            below = data[where] < 0
        if inside is not None:
            below &= inside if volume_major else inside[part]
        counts.append(int(np.count_nonzero(below)))

    in_parts(count, data.shape[3] if volume_major else data.shape[0], data.size, threads)
    return sum(counts)


#: Values a thread reduces at a time (``value_range``).
RANGE_CHUNK = 1 << 20


def value_range(values, threads=None) -> tuple[float, float]:
    """(min, max) of an array, both NaN where a value is NaN, in chunks on threads (``layout.in_parts``)."""
    flat = values.reshape(-1, order="A") if values.flags.c_contiguous or values.flags.f_contiguous else values.ravel()
    lows, highs = [], []

    def ranges(chunks):
        for start in range(chunks.start * RANGE_CHUNK, min(chunks.stop * RANGE_CHUNK, flat.size), RANGE_CHUNK):
            piece = flat[start:start + RANGE_CHUNK]
            lows.append(piece.min())
            highs.append(piece.max())

    in_parts(ranges, -(-flat.size // RANGE_CHUNK), flat.size, threads)
    return float(np.min(lows)), float(np.max(highs))


def check_nprocs(nprocs) -> None:
    """Raise MPPCAInputError unless ``nprocs`` is None or a positive integer."""
    if nprocs is not None and (isinstance(nprocs, bool) or int(nprocs) != nprocs or nprocs < 1):
        raise MPPCAInputError(f"nprocs must be a positive integer, not {nprocs!r}")


def _finite_input(data, mask):
    """(the caller's series, the series with 0 for NaN/Inf, finite voxels, how many mask voxels were not);
    warns about those voxels (as from the caller of the caller: ``denoise`` or ``estimate_noise``)."""
    finite = _finite_voxels(data)
    n_nonfinite = int(np.count_nonzero(mask & ~finite))
    if n_nonfinite:
        warnings.warn(f"{n_nonfinite} voxels hold NaN or Inf; they are left out of every patch and left "
                      "as they were", MPPCAWarning, stacklevel=3)
    raw = data
    if n_nonfinite or not finite.all():
        data = data.copy(order="K")
        data[~finite] = 0
    return raw, data, finite, n_nonfinite


def _is_tensor(data) -> bool:
    """Whether ``data`` is a torch tensor: a series on a device (torch is not imported to ask: a tensor comes
    only from a process that has imported it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(data, torch.Tensor)


def _on_host(data):
    """A series on a device as a NumPy array in its layout (a copy on the host); any other ``data`` as it is."""
    return data.cpu().numpy() if _is_tensor(data) else data


def _on_device_as(values: np.ndarray, device):
    """A NumPy array as a torch tensor on ``device``, in its layout."""
    import torch

    return torch.from_numpy(values).to(device)


def _check_series_on_device(data, device, demean, noise_floor, maps) -> None:
    """MPPCAInputError, one sentence, for a series on a device (a torch tensor) that the GPU engine cannot take
    there as it is: not 4D float32, not contiguous in either order, or asked for the CPU, a noise floor, groups
    of volumes or the ``variance_removed`` map (each needs the series on the host)."""
    from .gpu.upload import series_layout

    if data.dim() != 4 or str(data.dtype) != "torch.float32":
        raise MPPCAInputError(f"a series on a device must be a 4D float32 tensor, not {data.dim()}D {data.dtype}")
    if device == "cpu" or noise_floor != "none" or demean in GROUP_DEMEANING or "variance_removed" in maps:
        raise MPPCAInputError("a series on a device is denoised there by the GPU engine alone: without "
                              "device='cpu', a noise floor, groups of volumes or the variance_removed map")
    if data.shape[3] < MIN_VOLUMES:
        raise MPPCAInputError(f"the input has {data.shape[3]} volumes; MP-PCA needs at least {MIN_VOLUMES}")
    try:
        series_layout(data)
    except ValueError as err:
        raise MPPCAInputError(str(err)) from None


def _checked_mask(data, mask):
    """``check_data``'s (data, mask) for a series on a device (``_check_series_on_device``)."""
    if mask is None:
        return data, np.ones(tuple(data.shape[:3]), dtype=bool)
    mask = np.asarray(mask)
    if mask.shape != tuple(data.shape[:3]):
        raise MPPCAInputError(f"the mask's shape {mask.shape} does not match the image's {tuple(data.shape[:3])}")
    return data, mask != 0


def _gpu_sums_of_a_finite_series(backend, data, every_voxel, plan, options, run_options) -> PatchSums | None:
    """The GPU backend's sums of ``data`` taken as finite (``every_voxel``: all True, ``plan`` made with it),
    or None where some value is NaN or Inf (the caller then runs the host's check, the plan and the backend).

    The host's pass to find the non-finite voxels (``_finite_voxels``) costs as much as a third of the GPU
    backend on the seed's problem (3-6 ms against 9 ms for 96x96x48x48), and the backend reads every value
    anyway: it checks them on the device and reports it at the run's end (``info["series_finite"]``). A
    run over NaN or Inf may also fail where a finite one would not (the settling pass on the host, the CPU's
    redo of failed eigensolves): its error is raised only where the host finds every value finite.
    """
    try:
        sums = backend(data, every_voxel, plan, options, **run_options)
    except Exception:  # noqa: BLE001 - any error over a series that is not finite is answered by the redo
        if _finite_voxels(_on_host(data)).all():
            raise
        return None
    return sums if sums.info.pop("series_finite") else None


def _compile_ahead(backend, n_volumes, options):
    """The GPU run's kernels queued for compilation side by side where this machine has not compiled them
    (``gpu.warmup.compile_ahead``: a ``KernelsAhead``, or None)."""
    from .gpu import use_kernel_cache
    from .gpu.warmup import compile_ahead

    return compile_ahead(n_volumes, options, backend, use_kernel_cache())


def _plan(data, mask, finite, options) -> PatchPlan:
    """The patch plan; warns (as from the caller's caller) when patches or series are too small for MP-PCA."""
    plan = plan_patches(data.shape[:3], options.extent, options.stride, mask, finite, options.shape)
    t_eff = data.shape[3] - (options.demean == "voxel")
    if plan.patch_size < FEW_SAMPLES or t_eff < FEW_SAMPLES:
        warnings.warn(
            f"patches of {plan.patch_size} voxels and {t_eff} usable volumes: MP-PCA is unreliable with "
            f"fewer than {FEW_SAMPLES} of either", MPPCAWarning, stacklevel=3)
    return plan


def denoise(data, mask=None, *, extent=DEFAULTS["extent"], stride=DEFAULTS["stride"],
            estimator=DEFAULTS["estimator"],
            aggregation=DEFAULTS["aggregation"], demean=DEFAULTS["demean"], filter=DEFAULTS["filter"],  # noqa: A002
            shape=DEFAULTS["shape"], noise=None, noise_floor="none", coils=1, device="auto", nprocs=None,
            gpu_memory=None, progress=None, groups=None, bvals=None, maps=(), _removed_means=0) -> DenoiseResult:
    """Denoise a 4D series, or a multi-echo 5D one, by Marchenko-Pastur PCA (MP-PCA).

    Each patch (a cuboid of ``extent`` voxels, or a sphere) becomes an n x T matrix; the eigenvalues of its Gram matrix
    are split into signal and noise by the Marchenko-Pastur law (Veraart 2016; Cordero-Grande 2019), the
    patch is projected onto the signal components, and overlapping patches are combined.

    Parameters
    ----------
    data : (X, Y, Z, T) array, or a multi-echo (X, Y, Z, E, T) array or list of E (X, Y, Z, T) arrays
        The series (any real dtype; computed in float32 on the GPU, float64 on the CPU). In either memory
        order: a volume-major (Fortran-order) series, as nibabel reads a NIfTI file, is not transposed, and
        ``denoised`` comes back in the same order (``layout``). A float32 torch tensor on a CUDA device (either
        order) is denoised there by the GPU engine with no copy through the host, and ``denoised`` comes back
        as a tensor on that device (``device`` "auto" or "cuda"; the maps as NumPy; no noise floor, groups,
        echoes or ``variance_removed``): a step on the device before or after ``denoise`` keeps the series
        there (``complex_data``). The echoes of a multi-echo series are
        denoised jointly, each patch's matrix holding their E * T columns, with each voxel's mean per echo
        removed (the echoes as groups, ``groups.denoise_by_groups``); ``denoised`` is then (X, Y, Z, E, T).
    mask : (X, Y, Z) array, optional
        Voxels to denoise (non-zero). Patches may still read voxels outside it; outputs there are 0.
    extent : "wide", "auto", int or three ints
        Patch size, odd. "auto": the smallest odd e with e^3 >= T (dwidenoise's rule); "wide": the same but
        at least 7; both capped at the image size.
    stride : int
        1: every voxel is the centre of its own patch (dwidenoise). s > 1: patches on a grid of step s,
        plus one flush against each far edge.
    shape : {"cuboid", "sphere"}
        The patch: the cuboid of ``extent``, or the smallest sphere (the voxels within Euclidean distance r
        of the centre) holding at least as many voxels as that cuboid (``patches.sphere_radius``), whose
        bounding cube of side 2r + 1 must fit the image. Spheres are centred on every voxel (stride 1) or on
        the grid 0, s, 2s, ... and the last voxel of each axis, which must leave no voxel farther than r from
        every centre, and clipped at the image's edges; each reconstructs only its own voxels
        (docs/options.md, "Patch shape").
    estimator : {"exp2", "exp1", "med", "olesen2023"}
        Marchenko-Pastur noise estimator (see ``estimators.marchenko_pastur_threshold``; docs/options.md,
        "Estimators").
    aggregation : {"weighted", "center", "uniform", "gaussian"}
        How overlapping patches combine: ``center`` takes each voxel from its own patch (needs stride 1;
        dwidenoise); ``weighted`` averages all covering patches with weight 1/(1 + P + demeaned);
        ``uniform`` averages them equally; ``gaussian`` as ``weighted``, each voxel's weight times a Gaussian
        of its distance from its patch's centre (``patches.GAUSSIAN_WIDTH``).
    demean : {"volume", "voxel", "none", "shells", "groups"}
        What mean to remove inside a patch before PCA (and add back after): ``volume``, the patch's mean
        time course (the mean over its voxels of each volume; DIPY's centring; costs one voxel's worth of
        degrees of freedom); ``voxel``, each voxel's temporal mean (costs one volume); ``none``,
        dwidenoise's behaviour; ``shells``, each voxel's mean over the volumes of each b-value shell
        (``bvals``, clustered as MRtrix3 does: ``groups.shell_labels``); ``groups``, each voxel's mean
        over the volumes of each group (``groups``). G groups cost G volumes (``groups.denoise_by_groups``;
        ``voxel`` is G = 1). With a multi-echo series the echoes are groups too: ``volume`` then also removes
        the patch's mean time course, ``voxel`` nothing more, and ``none`` is refused.
    filter : {"hard", "optshrink", "optthresh"}
        What each patch keeps of its components, the noise level (estimated or given) taken as known:
        ``hard``, its P leading components whole (MP-PCA, dwidenoise); ``optshrink``, every component above
        the noise edge, its singular value shrunk by Gavish & Donoho's optimal shrinker for the Frobenius loss
        (2017); ``optthresh``, the components above their optimal hard threshold (2014), whole
        (``estimators.component_weights``; docs/options.md, "Filters"). ``rank`` counts the components kept.
    noise : positive number or (X, Y, Z) array, optional
        A given noise level (standard deviation) that replaces the per-patch estimate: one number, or a map
        of sigma on the input's grid (each patch takes the mean of sigma^2 over its finite voxels; inside the
        mask every value must be positive and finite, ``resolve_noise``). A patch keeps the components
        whose lambda_i = s_i / q lie above the Marchenko-Pastur edge sigma^2 (1 + sqrt(r / q))^2
        (``estimators.given_noise_threshold``), and ``sigma`` reports the given level. With a
        ``noise_floor``, it is the channels' sigma of the magnitude data instead.
    noise_floor : {"none", "rician", "ncchi"}
        The magnitude noise floor to remove: ``none`` takes the data as signal plus Gaussian noise (as
        dwidenoise does); ``rician`` (one complex channel) and ``ncchi`` (the root sum of squares of
        ``coils`` channels) denoise a variance-stabilised transform of the magnitude and map the result back
        to the signal without the floor's bias (``noise_floor.denoise_magnitude``: two passes of MP-PCA when
        ``noise`` is not given). The data must not be negative. ``sigma`` is then the channels' noise level.
    coils : int
        The number of channels of an ``ncchi`` floor (1 otherwise).
    device : {"auto", "cpu", "cuda"}
        ``auto`` uses a usable CUDA GPU where the GPU engine is installed and would finish first, its start
        included (``choose_device``; ``info["device_choice"]`` says why), else the CPU.
    nprocs : int, optional
        CPU worker processes (default: the CPUs this process may use).
    gpu_memory : number, str or GPUMemory, optional
        The most device memory a GPU run may take: GiB (8, "8GiB") or a share of the device ("50%");
        default ``$MPPCA_GPU_MEMORY``, else all the device can give this process (its free memory, within
        torch's per-process fraction). Every device allocation of the run is planned inside it (slabs along
        x, batch sizes) and torch's allocator holds the run to it; the results are the same as an
        unlimited run's (``resolve_gpu_memory``; docs/gpu.md, "Device memory").
    progress : callable(done, total), optional
        Called as work units finish.
    groups : (T,) integers, optional
        For ``demean="groups"``: the group of each volume (any integers; volumes with equal labels form a
        group).
    bvals : (T,) numbers, optional
        For ``demean="shells"``: the b-value of each volume.
    maps : str or iterable of str, optional
        Extra maps to compute, from ``MAPS``: ``lambda_plus`` (each patch's Marchenko-Pastur upper edge,
        aggregated as ``sigma``: one more sum per voxel in the backend) and ``variance_removed`` (the mean
        square of input - denoised over volumes: one more pass over the series). Each is None in the result
        unless asked for. ``lambda_plus`` is not available with a ``noise_floor`` (its edge would be the
        transformed data's). With groups of volumes or echoes, ``lambda_plus`` is that of the patches of the
        group contrasts (orthonormal: the same noise variance), ``variance_removed`` over every volume of
        every echo.
    _removed_means : int
        Internal: the means per voxel ``groups.denoise_by_groups`` took out of the series of group contrasts it
        hands over (counted in the aggregation weight).

    Returns
    -------
    DenoiseResult
        ``denoised`` (float32, same shape), ``sigma`` and ``rank`` maps, ``info``, and the ``maps`` asked for.

    The defaults (extent "wide", stride 3, volume demeaning, olesen2023, optshrink, gaussian aggregation) were
    chosen by measurement (docs/benchmarks.md, "Choosing the defaults"); dwidenoise's mode is
    ``DWIDENOISE_MODE``: ``extent="auto", stride=1, aggregation="center", demean="none", estimator="exp2",
    filter="hard"``.
    """
    maps = resolve_maps(maps)
    on_device = _is_tensor(data)
    if on_device:
        _check_series_on_device(data, device, demean, noise_floor, maps)
    elif demean in GROUP_DEMEANING or isinstance(data, (list, tuple)) or np.ndim(data) == 5:
        result = denoise_by_groups(data, mask, demean=demean, groups=groups, bvals=bvals, extent=extent,
                                   stride=stride, shape=shape, estimator=estimator, aggregation=aggregation,
                                   filter=filter, noise=noise, noise_floor=noise_floor, coils=coils, device=device,
                                   nprocs=nprocs, gpu_memory=gpu_memory, progress=progress,
                                   maps=tuple(name for name in maps if name != "variance_removed"))
        if "variance_removed" in maps:
            result.variance_removed = _removed_variance_of(data, mask, result.denoised)
        return result
    if check_noise_floor(noise_floor, coils) and noise_floor != "none":
        if "lambda_plus" in maps:
            raise MPPCAInputError("the lambda_plus map is not available with a noise floor: the patches' "
                                  "Marchenko-Pastur edges are those of the variance-stabilised data")
        result = denoise_magnitude(data, mask, noise_floor=noise_floor, coils=coils, noise=noise,
                                   denoise_options=dict(extent=extent, stride=stride, estimator=estimator,
                                                        aggregation=aggregation, demean=demean, filter=filter,
                                                        shape=shape),
                                   run_options=dict(device=device, nprocs=nprocs, gpu_memory=gpu_memory,
                                                    progress=progress))
        if "variance_removed" in maps:
            result.variance_removed = _removed_variance_of(data, mask, result.denoised)
        return result
    seconds, last = dict.fromkeys(("input check", "plan", "backend", "output"), 0.0), time.perf_counter()

    def lap(phase):  # the seconds since the last lap, added to the phase's
        nonlocal last
        now = time.perf_counter()
        seconds[phase], last = seconds[phase] + now - last, now

    data, mask = _checked_mask(data, mask) if on_device else check_data(data, mask)
    options = resolve_options(data.shape, extent=extent, stride=stride, estimator=estimator,
                              aggregation=aggregation, demean=demean, noise=noise, mask=mask, filter=filter,
                              removed_means=_removed_means, shape=shape)
    if "lambda_plus" in maps:
        options = replace(options, lambda_plus=True)
    check_nprocs(nprocs)
    gpu_memory = resolve_gpu_memory(gpu_memory)
    lap("input check")
    chosen, choice = ("cuda", None) if on_device else choose_device(device, data.shape, options, nprocs)
    lap("backend")  # (where ``auto`` asks CUDA: torch's import, the backend's start)
    on_gpu = chosen == "cuda"
    if on_gpu:  # the device checks the series it uploads (``_gpu_sums_of_a_finite_series``)
        raw, finite, n_nonfinite = data, np.ones(data.shape[:3], dtype=bool), 0
    else:
        raw, data, finite, n_nonfinite = _finite_input(data, mask)
    lap("input check")
    plan = _plan(data, mask, finite, options)
    lap("plan")

    backend = _backend(chosen)
    run_options = dict(nprocs=nprocs, progress=progress, **(dict(gpu_memory=gpu_memory) if on_gpu else {}))
    series_device = data.device if on_device else None  # (the backend runs there)
    ahead = _compile_ahead(backend, data.shape[3], options) if on_gpu else None
    try:
        sums = None
        if on_gpu:
            sums = _gpu_sums_of_a_finite_series(backend, data, finite, plan, options, run_options)
            if sums is None:  # NaN or Inf in the series: checked, planned and run as on the CPU
                lap("backend")
                raw, data, finite, n_nonfinite = _finite_input(_on_host(data), mask)
                if on_device:  # (from the host now, on the series' device still)
                    run_options["device"] = series_device
                lap("input check")
                plan = plan_patches(data.shape[:3], options.extent, options.stride, mask, finite,
                                    options.shape)  # (_plan warned)
                lap("plan")
        if sums is None:
            sums = backend(data, finite, plan, options, **run_options)
    except Exception as err:  # noqa: BLE001 - only the GPU running out of memory is recovered from
        from .cpu import denoise_cpu

        if backend is denoise_cpu or not is_out_of_memory(err):
            raise
        out_of_memory = err if isinstance(err, GPUOutOfMemoryError) else GPUOutOfMemoryError(
            f"the GPU ran out of memory even in batches of a few windows ({_first_line(err)})")
        if device == "cuda":
            raise out_of_memory from None
        warnings.warn(out_of_memory.fallback_note, MPPCAWarning, stacklevel=2)
        raw, data = _on_host(raw), _on_host(data)
        sums = denoise_cpu(data, finite, plan, options, nprocs=nprocs, progress=progress)
        sums.info["cpu_fallback"] = out_of_memory.reason
    else:
        if ahead is not None:
            ahead.run_succeeded()
    lap("backend")
    result = _finish(raw, mask, finite, sums)
    if on_device and not _is_tensor(result.denoised):  # (run on the host: NaN or Inf, or out of memory)
        result.denoised = _on_device_as(result.denoised, series_device)
    if "variance_removed" in maps:
        result.variance_removed = removed_variance(raw, result.denoised, _served(sums, mask, finite))
    lap("output")
    result.info.update(sums.info)
    result.info.update(dict(extent=list(options.extent), stride=options.stride, shape=options.shape,
                            estimator=options.estimator,
                            aggregation=options.aggregation, demean=options.demean, filter=options.filter,
                            noise="given" if options.noise_given else "estimated",
                            n_patches=int(plan.multiplicity.sum()), n_windows=plan.n_windows,
                            n_nonfinite_voxels=n_nonfinite,
                            seconds={phase: round(spent, 4) for phase, spent in seconds.items()}))
    if ahead is not None:
        result.info["kernels_compiled_ahead"] = ahead.queued
    if choice:
        result.info["device_choice"] = choice
    return result


@dataclass
class NoiseResult:
    """What ``estimate_noise`` returns: the ``sigma`` and ``rank`` maps ((X, Y, Z) float32, 0 outside the
    mask, as ``DenoiseResult``'s) and ``info`` (resolved options, backend, patch counts, ``seconds``)."""

    sigma: np.ndarray
    rank: np.ndarray
    info: dict = field(default_factory=dict)


def default_filter(complex_data: bool) -> str:
    """The filter a run takes where none is given: ``COMPLEX_FILTER`` for complex data (a magnitude with its
    phase, or a complex series), else the defaults' (``DEFAULTS``)."""
    return COMPLEX_FILTER if complex_data else DEFAULTS["filter"]


def noise_stride(data_shape, *, extent=DEFAULTS["extent"], shape=DEFAULTS["shape"]) -> int:
    """``estimate_noise``'s grid step where none is given: NOISE_STRIDE, or less for spheres
    (``coarse_stride``). ``data_shape``: (X, Y, Z, T)."""
    return coarse_stride(data_shape, NOISE_STRIDE, extent=extent, shape=shape)


def coarse_stride(data_shape, at_most: int, *, extent=DEFAULTS["extent"], shape=DEFAULTS["shape"]) -> int:
    """A grid step for a pass coarser than ``denoise``'s: ``at_most``, for spheres at most the largest step
    whose grid leaves no voxel outside every sphere (``patches.largest_sphere_stride``), as a cuboid's step is
    capped at its extent by the layout. ``data_shape``: (X, Y, Z, T)."""
    if shape != "sphere":
        return at_most
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MPPCAWarning)  # (``resolve_options`` gives them)
            cube = resolve_sphere(resolve_extent(extent, data_shape[:3], data_shape[3]), data_shape[:3])
    except ValueError:  # (refused by ``resolve_options``, in its own sentence)
        return at_most
    return largest_sphere_stride(data_shape[:3], cube[0] // 2, at_most)


def estimate_noise(data, mask=None, *, extent=DEFAULTS["extent"], stride=None,
                   estimator=DEFAULTS["estimator"], aggregation=DEFAULTS["aggregation"],
                   demean=DEFAULTS["demean"], shape=DEFAULTS["shape"], nprocs=None, progress=None) -> NoiseResult:
    """The MP-PCA noise map of a 4D series, without denoising it.

    Each window's Gram matrix is eigen-decomposed for its eigenvalues only and thresholded by the
    Marchenko-Pastur law, exactly as in ``denoise``; no eigenvector is computed and nothing is reconstructed.
    The windows' noise levels are aggregated to voxels as ``denoise`` aggregates them: with the same options
    the ``sigma`` and ``rank`` maps are bit-identical to ``denoise``'s.

    Parameters
    ----------
    data, mask, extent, shape, estimator, aggregation, demean, nprocs, progress
        As for ``denoise``.
    stride : int, optional
        The grid step, as for ``denoise``; default ``noise_stride``: NOISE_STRIDE, patches on a coarser grid
        than ``denoise``'s, each voxel's sigma the weighted mean of the patches covering it (the step is capped
        at the extent, for spheres at the largest step whose spheres cover the image, so every voxel is
        covered) (docs/benchmarks.md, "The noise map alone").

    Returns
    -------
    NoiseResult
        ``sigma`` (the noise standard deviation) and ``rank`` maps, and ``info``.

    Runs on the CPU engine's worker processes (``engine.noise``).
    """
    from .noise import noise_cpu

    seconds, last = {}, time.perf_counter()

    def lap(phase):
        nonlocal last
        now = time.perf_counter()
        seconds[phase], last = round(now - last, 4), now

    data, mask = check_data(data, mask)
    if stride is None:
        stride = noise_stride(data.shape, extent=extent, shape=shape)
    options = resolve_options(data.shape, extent=extent, stride=stride, estimator=estimator,
                              aggregation=aggregation, demean=demean, shape=shape)
    check_nprocs(nprocs)
    _, data, finite, n_nonfinite = _finite_input(data, mask)
    lap("input check")
    plan = _plan(data, mask, finite, options)
    lap("plan")
    sums = noise_cpu(data, finite, plan, options, nprocs=nprocs, progress=progress)
    lap("backend")
    shape3 = data.shape[:3]
    served = (sums.weight > 0).reshape(shape3) & mask & finite
    weight = np.where(served.ravel(), sums.weight, 1.0)  # as ``_finish`` divides them
    sigma, rank = (sums.sigma / weight).reshape(shape3), (sums.rank / weight).reshape(shape3)
    result = NoiseResult(np.where(served, sigma, 0).astype(np.float32), np.where(served, rank, 0).astype(np.float32))
    lap("output")
    result.info.update(sums.info)
    result.info.update(dict(extent=list(options.extent), stride=options.stride, shape=options.shape,
                            estimator=options.estimator,
                            aggregation=options.aggregation, demean=options.demean, noise="estimated",
                            n_patches=int(plan.multiplicity.sum()), n_windows=plan.n_windows,
                            n_nonfinite_voxels=n_nonfinite, seconds=seconds))
    return result


def _first_line(err: BaseException) -> str:
    """An exception's message on one line, at most 200 characters (for a warning or the provenance)."""
    return " ".join(str(err).split())[:200]


#: Bytes of the series each thread of the finiteness check reads, at least (``_squares_finite``).
FINITE_CHECK_BYTES = 8 << 20
#: Threads of the finiteness check, at most (it is bound by memory bandwidth beyond a few).
FINITE_CHECK_THREADS = 8
_finite_check_pool = None
_finite_check_lock = threading.Lock()


def _squares_finite(flat) -> bool:
    """Whether the sum of squares of the 1D float array ``flat`` is finite, summed by parts on threads
    (NumPy's dot releases the GIL, and OpenBLAS's sdot runs on one thread: the seed's 81 MB took 7.3 ms in one
    dot and 3.9 ms in two on the 2-core development machine)."""
    global _finite_check_pool
    parts = min(available_cpus(), FINITE_CHECK_THREADS, max(1, flat.nbytes // FINITE_CHECK_BYTES))
    if parts == 1:
        return _sum_of_squares_finite(flat)
    with _finite_check_lock:
        if _finite_check_pool is None:
            _finite_check_pool = ThreadPoolExecutor(FINITE_CHECK_THREADS, thread_name_prefix="mppca-finite")
    return all(list(_finite_check_pool.map(_sum_of_squares_finite, np.array_split(flat, parts))))


def _sum_of_squares_finite(part) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):  # per thread: NumPy's error state does not cross threads
        return bool(np.isfinite(np.dot(part, part)))


def _finite_voxels(data) -> np.ndarray:
    """(X, Y, Z) bool: the voxels whose whole time course is finite.

    One pass over the series when all of it is finite (the usual case: ``.all(axis=3)`` over a short last
    axis costs 2.5 times the ``isfinite`` itself): the sum of squares (BLAS, by parts on threads:
    ``_squares_finite``) is finite exactly when every value is, unless it overflows, which only sends very
    large values down the exact path (on 96x96x48x48: 7.8 ms in one dot, against 12.4 for
    ``isfinite(...).all()``); voxel by voxel only when something is not finite.
    """
    contiguous = data.flags.c_contiguous or data.flags.f_contiguous
    squares_finite = contiguous and _squares_finite(data.reshape(-1, order="A"))
    if squares_finite or np.isfinite(data).all():
        return np.ones(data.shape[:3], dtype=bool)
    return np.isfinite(data).all(axis=3)


def check_device(device: str) -> str:
    """The backend ``denoise(device=device)`` would run: "cuda" or "cpu".

    ``auto`` takes a usable CUDA GPU when the GPU engine is installed, else the CPU; ``cuda`` raises
    MPPCAInputError, with the reason, when no GPU can be used. ``cpu`` probes nothing. ``auto`` and ``cuda``
    import torch (2-3 s) where a GPU may be present, to ask CUDA whether it can be used (then the run uses
    it, and torch, anyway); where none can be (no driver's device, torch or triton not installed,
    ``CUDA_VISIBLE_DEVICES`` empty) they answer without importing it (``gpu.absent_reason``).
    """
    _check_choice("device", device, DEVICES)
    if device == "cpu":
        return "cpu"
    try:
        from .gpu import usable as gpu_usable
        reason = gpu_usable()
    except ImportError as err:
        reason = f"the GPU engine is not installed ({err.name} is missing; pip install 'mppca-nipype[gpu]')"
    if reason is None:
        return "cuda"
    if device == "cuda":
        raise MPPCAInputError(f"device 'cuda' was asked for but {reason}")
    return "cpu"


def _backend(device: str):
    """The backend function of a device ``choose_device`` chose."""
    if device == "cuda":
        from .gpu.pipeline import denoise_gpu
        return denoise_gpu
    from .cpu import denoise_cpu
    return denoise_cpu


def choose_device(device: str, shape, options: DenoiseOptions, nprocs=None) -> tuple[str, str | None]:
    """The backend ``denoise`` runs for this series: ("cuda" or "cpu", why, for ``auto``; else None).

    ``auto`` takes the GPU where it is usable and would finish first, the start of its libraries included
    (``costs``: a small series is done on the CPU before torch is imported); the estimate comes first, so a
    series the CPU wins never imports torch. ``cuda`` raises MPPCAInputError when no GPU can be used; ``auto``
    then runs on the CPU.
    """
    if device != "auto":
        return check_device(device), None
    guess = costs.estimate(shape[:3], shape[3], options.extent, options.stride, nprocs or available_cpus())
    if guess.device == "cpu":
        return "cpu", f"auto: the CPU ({guess.reason()})"
    if check_device("auto") == "cpu":
        return "cpu", "auto: the CPU (no usable GPU)"
    return "cuda", f"auto: the GPU ({guess.reason()})"


def steps_device(device: str, shape, denoise_options: dict, nprocs=None) -> str:
    """Where the steps over the whole series around ``denoise`` run (complex data's phase, a noise floor's
    transforms and noise level): "cuda" where ``denoise`` of a series of ``shape`` with ``denoise_options``
    (extent, stride, estimator, aggregation, demean, filter, shape) runs on the GPU engine (``choose_device``),
    else "cpu" (their NumPy code, on the host)."""
    options = resolve_options(shape, **denoise_options)
    return choose_device(device, shape, options, nprocs)[0]


def _finish(data, mask, finite, sums: PatchSums) -> DenoiseResult:
    """Divide the sums by the weights; put back what was not denoised.

    ``data`` is the caller's series (with its NaN/Inf): voxels in the mask that held them keep them. The
    denoised series comes in ``data``'s order (``layout``): a volume-major series is written volume after
    volume as the sums are divided, not transposed after.
    """
    shape3 = data.shape[:3]
    served = _served(sums, mask, finite)
    if sums.normalized:
        image = sums.image if _is_tensor(sums.image) else np.asarray(sums.image, dtype=np.float32)
        if image.ndim == 4:  # (the backend gave the series in the caller's order; on the device for a tensor)
            denoised = image
        elif is_volume_major(data):
            denoised = planes_of_rows(image, empty_like_series(data))
        else:
            denoised = image.reshape(data.shape)
        sigma, rank = sums.sigma.reshape(shape3), sums.rank.reshape(shape3)
    else:
        weight = np.where(served.ravel(), sums.weight, 1.0)
        # divided in the sums' precision and rounded once to float32, with no (V, T) temporary
        denoised = planes_of_rows(sums.image, empty_like_series(data), divisor=weight)
        sigma, rank = (sums.sigma / weight).reshape(shape3), (sums.rank / weight).reshape(shape3)
    every_voxel = served.all()
    if not every_voxel:  # (a pass over the whole series, only where some voxel was not served)
        denoised[_on_device_as(~served, denoised.device) if _is_tensor(denoised) else ~served] = 0
        keep_input = mask & ~finite
        if keep_input.any():
            denoised[keep_input] = data[keep_input]

    def voxel_map(values):  # float32, 0 where not served (the backend's own array where every voxel was)
        return (np.asarray(values, dtype=np.float32).reshape(shape3) if every_voxel
                else np.where(served, values.reshape(shape3), 0).astype(np.float32))

    result = DenoiseResult(denoised, voxel_map(sigma), voxel_map(rank), info={})
    if sums.lambda_plus is not None:
        result.lambda_plus = voxel_map(sums.lambda_plus if sums.normalized else sums.lambda_plus / weight)
    return result


def _removed_variance_of(data, mask, denoised) -> np.ndarray:
    """``maps.removed_variance`` of a result that did not come from one backend run (a noise floor's passes,
    groups of volumes, echoes): the caller's series (a 4D or 5D array or a list of echoes) against its
    denoised one, over every volume, at the finite voxels of the mask."""
    series = np.stack(data, axis=3) if isinstance(data, (list, tuple)) else np.asarray(data)
    series, denoised = (a.reshape(a.shape[:3] + (-1,)) for a in (series, denoised))
    series, mask = check_data(series, mask)
    return removed_variance(series, denoised, mask & _finite_voxels(series))


def _served(sums: PatchSums, mask, finite) -> np.ndarray:
    """(X, Y, Z) bool: the voxels of the mask that took part in a patch and got a value from the sums."""
    served = (sums.weight > 0).reshape(mask.shape)
    for voxels in (mask, finite):  # (most often every voxel: a check, not a pass that writes)
        if not voxels.all():
            served &= voxels
    return served
