"""What every backend shares: the options it receives, what it returns, and the CPUs it may use.

``engine.denoise`` resolves a ``DenoiseOptions``, hands it with the patch plan to a backend (``cpu`` or
``gpu``), and turns the backend's ``PatchSums`` into the caller's result. Both backends import this module;
it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import os

import numpy as np

#: Bytes in a GiB: GPU memory budgets are given in GiB (``GPUMemory``).
GIB = 2**30


@dataclass(frozen=True)
class DenoiseOptions:
    """Validated, resolved options: what every backend receives.

    ``noise_variance``: None to estimate each patch's noise (``estimator``); else the given noise as a
    variance, one number (sigma^2) or a flat (X*Y*Z,) float64 map of sigma^2 with 0 where a voxel outside
    the mask had no usable value (``engine.resolve_noise``). ``filter``: what each patch keeps of its
    components (``estimators.FILTERS``): ``hard`` its P_hat leading ones whole, else the weights of
    ``estimators.component_weights``.
    """

    extent: tuple[int, int, int]
    stride: int
    estimator: str
    aggregation: str
    demean: str
    filter: str = "hard"
    noise_variance: float | np.ndarray | None = field(default=None, compare=False, repr=False)
    #: Means per voxel removed before the series reached the backend (``groups.denoise_by_groups``: G group
    #: means); each costs the patch one parameter in the aggregation weight.
    removed_means: int = 0
    #: Whether to aggregate each patch's Marchenko-Pastur upper edge too (``PatchSums.lambda_plus``).
    lambda_plus: bool = False
    #: The patch shape (``patches.PATCH_SHAPES``); for a sphere ``extent`` is its bounding cube.
    shape: str = "cuboid"

    @property
    def demeaned(self) -> bool:
        """Whether a mean was removed (it costs the patch one parameter in the aggregation weight)."""
        return self.demean != "none"

    @property
    def mean_parameters(self) -> int:
        """The parameters per voxel the means cost: 1 for ``voxel`` or ``volume`` demeaning, plus
        ``removed_means``."""
        return int(self.demeaned) + self.removed_means

    @property
    def noise_given(self) -> bool:
        """Whether the noise level is given rather than estimated per patch."""
        return self.noise_variance is not None


@dataclass
class PatchSums:
    """What a backend returns: per-voxel sums over the patches that served each voxel.

    ``image`` (X*Y*Z, T), ``weight``, ``sigma``, ``rank`` (X*Y*Z,), all float64 (or float32 from the GPU); a
    ``normalized`` image may also come as the (X, Y, Z, T) series in the caller's order.
    For ``center`` aggregation each voxel is served by exactly one patch with weight 1, so the sums are the
    values themselves. ``normalized``: the backend has already divided ``image``, ``sigma``, ``rank`` (and
``lambda_plus``) by
    ``weight`` (0 where the weight is 0), e.g. on its device; ``weight`` still says which voxels were served.
    """

    image: np.ndarray
    weight: np.ndarray
    sigma: np.ndarray
    rank: np.ndarray
    info: dict = field(default_factory=dict)
    normalized: bool = False
    #: With ``DenoiseOptions.lambda_plus``: the sums of each patch's lambda_+ (X*Y*Z,), weighted as ``sigma``.
    lambda_plus: np.ndarray | None = None

    def cropped(self, padded_shape, padding: int) -> PatchSums:
        """The sums of the image inside ``padding`` voxels on each side of the (X, Y, Z) ``padded_shape``
        grid they were added on (``patches.PatchPlan.padding``): the padding's rows dropped, copied in the
        image's order; itself where ``padding`` is 0."""
        if not padding:
            return self
        inside = (slice(padding, -padding),) * 3

        def crop(values):
            if values is None:
                return None
            if values.ndim == 4:  # a normalized series in the caller's order: cropped in that order
                kept = values[inside]
                return np.array(kept, order="K") if isinstance(kept, np.ndarray) else _copied_in_order(kept)
            grid = values.reshape(tuple(padded_shape) + values.shape[1:])[inside]
            return np.ascontiguousarray(grid).reshape((-1,) + values.shape[1:])

        return PatchSums(crop(self.image), crop(self.weight), crop(self.sigma), crop(self.rank), self.info,
                         self.normalized, crop(self.lambda_plus))


def _copied_in_order(series):
    """A copy of a view of an (X, Y, Z, T) torch tensor (a GPU run's result on the device, cropped) laid out as
    the view's strides run: volume-major where its first axis is the fastest, else voxel-major."""
    from .gpu.upload import empty_series  # (only a GPU run's result is a tensor)

    layout = "F" if series.stride(0) < series.stride(3) else "C"
    return empty_series(series.shape, layout, series.device).copy_(series)


@dataclass(frozen=True)
class GPUMemory:
    """A GPU memory budget as asked (``engine.resolve_gpu_memory``): ``amount`` GiB, or ``amount`` percent of
    the device's memory (``unit`` "GiB" or "%"). The GPU engine takes the least of it and what the device can
    give this process (``gpu.plan.DeviceMemory``)."""

    amount: float
    unit: str = "GiB"

    def bytes_of(self, total: int) -> int:
        """The budget in bytes on a device of ``total`` bytes."""
        return int(self.amount * (total / 100 if self.unit == "%" else GIB))

    def __str__(self):
        return f"{self.amount:g}%" if self.unit == "%" else f"{self.amount:g} GiB"


def available_cpus() -> int:
    """CPUs this process may use: its affinity, capped by SLURM_CPUS_PER_TASK when running under SLURM."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        cpus = min(cpus, int(slurm))
    return max(cpus, 1)
