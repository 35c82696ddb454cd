"""How a GPU run is done: its settings, the choices they lead to, and the sizes that fit the device.

``GPUSettings`` holds what a caller may ask of ``pipeline.denoise_gpu`` beyond the options (for tests and
benchmarks: each path and eigensolver can be forced). ``GPURun`` holds what stays the same across the slabs
and batches of one run (the plan, the precision of the first pass, the eigensolver, the paths of the Gram
and reconstruction, the patch geometry on the device) and what the run learns (batch size, retries,
counts). The sizes: x-planes per slab (``slab_planes``) and windows per batch (``batch_size``) within the
run's device memory (``DeviceMemory``: a budget asked for, or all the device can give this process); a
batch that runs out of memory anyway is redone at half the size (``run_in_batches``), and a run whose slab
does not fit is redone in thinner slabs (``pipeline.denoise_gpu``).

Precision of the first pass (``gram_precision``): with voxel or volume demeaning everything runs in float32
(the Gram of a centred patch is well conditioned; the centring happens before the products, never as
X^T X - n mu mu^T). Without it (dwidenoise's mode) a baseline near 1000 makes the Gram's top eigenvalue ~1e6
times its noise eigenvalues, and float32 eigenvalues of X^T X lose the noise bulk (MRtrix3's own float32
mode differs from its float64 mode by 2.6e-4). There the fused Gram kernel returns the volume-demeaned Gram
and the mean mu instead, and the tridiagonal kernels take X^T X = X_c^T X_c + n mu mu^T with the rank-one
term apart (``takes_mean_apart``): the noise eigenvalues keep float32's precision of X_c^T X_c. Undemeaned
runs that the fused and tridiagonal kernels cannot serve run in float64.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
import math

import numpy as np
import torch

from ..backend import GIB
from ..errors import GPUOutOfMemoryError, is_out_of_memory
from ..estimators import LEADING_ESTIMATORS
from . import boxsums, cusolver, threshold
from .cusolver import BatchedEigh, ProjectorFromVectors
from .gram import fused_fits
from .tridiagonal import MAX_ORDER as TRIDIAGONAL_MAX_ORDER, TridiagonalEigh
from .upload import to_device

#: The eigensolvers ``GPUSettings.eigensolver`` takes ("auto": ``eigensolver_for``).
EIGENSOLVERS = ("auto", "tridiagonal", "xsyev")
#: How the first pass's Gram and reconstruction may be computed (``GPUSettings.path``).
PATHS = ("auto", "box", "fused", "gather")
#: Gram precisions ``GPUSettings.precision`` takes ("auto": ``gram_precision``).
PRECISIONS = ("auto", "float32", "float64")
#: Upper bound on windows per batch (beyond it XsyevBatched gains nothing and workspaces grow linearly).
MAX_BATCH = 16384
#: Share of the memory the run may still take (``DeviceMemory.free``) that one batch's buffers may take.
MEMORY_SHARE = 0.5
#: Share of the run's budget that a slab's series and sums may take (beside the next slab's upload); the
#: batches take ``MEMORY_SHARE`` of what is left.
SLAB_SHARE = MEMORY_SHARE / 2
#: Smallest batch an out-of-memory retry goes down to (below it the GPU would gain nothing over the CPU).
MIN_BATCH = 64
#: Largest m for which "auto" takes the tridiagonal kernels in float32: 5-7x faster than XsyevBatched in the
#: eigen step up to 64 (docs/benchmarks.md, "The eigen step"); 1.5-1.8x at 96 and 128, but their settling
#: slack (``threshold.TRIDIAGONAL_SETTLE_SLACK``) rests on measurements at m = 48.
AUTO_TRIDIAGONAL_MAX_ORDER = 64
#: Priority of the settling pass's stream (lower is higher; -1 or below is the highest torch gives): its short
#: chain of small launches is not queued behind the first pass's many programs.
SETTLE_PRIORITY = -1


@dataclass(frozen=True)
class GPUSettings:
    """What a run may be asked beyond the denoising options (defaults: what the engine chooses).

    ``path`` (one of ``PATHS``): how the first pass's Gram and reconstruction are computed; "auto": the box
    sums where ``boxsums.applies`` and their scratch fits, else the fused kernels where they fit, else
    gathered. ``eigensolver`` (one of ``EIGENSOLVERS``); ``precision`` (one of ``PRECISIONS``: of the Gram and
    eigensolver); ``max_batch``; ``planes`` (x-planes of window corners per slab; default from the free
    memory); ``normalize`` (divide the sums by the weights on the device); ``settle`` (redo in float64 the
    windows float32 cannot settle; False measures float32 alone); ``timeline`` (``info["timeline_ms"]``:
    where the host and the device were at each step; its CUDA events cost host time).
    """

    path: str = "auto"
    eigensolver: str = "auto"
    precision: str = "auto"
    max_batch: int | None = None
    planes: int | None = None
    normalize: bool = True
    settle: bool = True
    timeline: bool = False

    def __post_init__(self):
        for name, choices in (("path", PATHS), ("eigensolver", EIGENSOLVERS), ("precision", PRECISIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, not {getattr(self, name)!r}")


def gram_precision(options, precision: str = "auto", mean_apart: bool = False) -> torch.dtype:
    """float32 with voxel or volume demeaning, or without it where the patch's mean can be taken apart
    (``mean_apart``: ``takes_mean_apart``); else float64 (see the module's note); or as asked."""
    if precision == "auto":
        return torch.float32 if options.demean in ("voxel", "volume") or mean_apart else torch.float64
    return {"float32": torch.float32, "float64": torch.float64}[precision]


def takes_mean_apart(options, device, path, eigensolver, n_voxels, n_volumes) -> bool:
    """Whether an undemeaned run's first pass can be float32 with the patch's mean taken apart: the fused
    Gram kernel serves the patch (it returns the volume-demeaned Gram and the mean) and the tridiagonal kernels
    solve it (asked for, or ``auto``'s choice), taking n mu mu^T as a rank-one term."""
    if options.demean != "none" or path == "gather" or not fused_fits(n_voxels, n_volumes, torch.float32):
        return False
    if eigensolver == "auto":
        return torch.device(device).type == "cuda" and min(n_voxels, n_volumes) <= AUTO_TRIDIAGONAL_MAX_ORDER
    return eigensolver == "tridiagonal"


def eigensolver_for(name, device, m, dtype):
    """The eigensolver ``name`` for m x m matrices in the first pass's precision ``dtype``. "auto": the
    tridiagonal Triton kernels for float32 and m <= ``AUTO_TRIDIAGONAL_MAX_ORDER``, else XsyevBatched
    (float64 runs: XsyevBatched is a little faster there)."""
    if name not in EIGENSOLVERS:
        raise ValueError(f"eigensolver must be one of {EIGENSOLVERS}, not {name!r}")
    if name == "auto":
        name = ("tridiagonal" if dtype == torch.float32 and m <= AUTO_TRIDIAGONAL_MAX_ORDER
                and torch.device(device).type == "cuda" else "xsyev")
    if name == "tridiagonal":
        if m > TRIDIAGONAL_MAX_ORDER:
            raise ValueError(f"the tridiagonal eigensolver takes m <= {TRIDIAGONAL_MAX_ORDER}, not {m}")
        return TridiagonalEigh(device)
    return BatchedEigh(device)


def _bytes_per_window(n_voxels, n_volumes, dtype, fused, workspace_per_window, refine=False, lambda_plus=False,
                      leading=False):
    m = min(n_voxels, n_volumes)
    size = torch.empty((), dtype=dtype).element_size()
    per_window = m * m * (2 * size + 4) + 16 * m * 8 + 4 * n_volumes + workspace_per_window
    if leading:  # the float64 Gram, the Krylov basis and its products, the projected matrix and its copies
        width = cusolver.leading_width()
        per_window += m * m * 8 + m * width * 8 * 4 + width * width * 8 * 3
        size = 8
    elif refine:  # the float64 Gram, vectors and products beside the solver's copy; patches in float64
        per_window += m * m * (8 + 8 + 8 + size)
        size = 8
    if not fused:  # gathered patches (float32 and compute precision), restored, indices
        per_window += n_voxels * n_volumes * (4 + 2 * size) + n_voxels * 16
    if lambda_plus:  # its addend (``batch.SlabWindows``): a row (int64) and a value (float64, float32) per voxel
        per_window += n_voxels * 24
    return int(per_window)


class DeviceMemory:
    """The device memory one run may take: ``budget`` bytes held by this process's torch allocator during the
    run (the series or its slab, the sums, box sums, batches, workspaces, kept graphs and tables), and what
    it may still take (``free``).

    On a GPU the budget is the least of the one asked for (``GPUMemory``) and what the device can give this
    process: its free memory plus what torch holds already (its cache), within torch's per-process fraction
    of the device. A budget asked for is also enforced while the run lasts (``enforced``: torch's
    per-process fraction), so that an allocation beyond it runs out of memory and is redone smaller instead
    of taking memory another job counts on. On the CPU (the kernels interpreted) there is a budget only
    when one is asked for, against the slab the plan counts (``slab_bytes``).
    """

    def __init__(self, device, asked=None):
        self.device, self.asked, self.on_gpu = device, asked, device.type == "cuda"
        self.slab = 0  # bytes of the planned slab (what the CPU counts as taken)
        if self.on_gpu:
            free, self.total = torch.cuda.mem_get_info(device)
            fraction = torch.cuda.get_per_process_memory_fraction(device)
            self.held, reserved = torch_holds(device)  # (held before the run: kept graphs, tables)
            self.available = int(min(free + reserved, fraction * self.total))
            self.budget = self.available if asked is None else min(asked.bytes_of(self.total), self.available)
            # neither a budget asked for nor a per-process fraction: the device's free memory is the bound
            self.limited = asked is not None or fraction < 1
        else:
            self.total = self.available = None
            self.budget = None if asked is None else asked.bytes_of(64 * GIB)  # (a share of a nominal device)
            self.held, self.limited = 0, asked is not None

    def free(self) -> float:
        """Bytes the run may still allocate now."""
        if not self.on_gpu:
            return math.inf if self.budget is None else self.budget - self.slab
        free, _ = torch.cuda.mem_get_info(self.device)
        if not self.limited:  # (one driver call: torch's statistics cost ~0.1 ms a query in Python)
            return free
        allocated, reserved = torch_holds(self.device)
        return min(free + reserved - allocated, self.budget - allocated)

    @contextmanager
    def enforced(self):
        """Within: torch's allocator holds this process to the budget asked for (none asked: as it was)."""
        if not (self.on_gpu and self.asked is not None):
            yield
            return
        before = torch.cuda.get_per_process_memory_fraction(self.device)
        torch.cuda.set_per_process_memory_fraction(min(before, self.budget / self.total), self.device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(before, self.device)

    def describe(self) -> dict:
        """The budget for ``info``: bytes, and what was asked for."""
        return dict(gpu_memory_budget=None if self.budget is None else int(self.budget),
                    gpu_memory_asked=None if self.asked is None else str(self.asked))


def torch_holds(device) -> tuple[int, int]:
    """(allocated, reserved) bytes of torch's allocator on ``device``, from one query of its statistics
    (``torch.cuda.memory_allocated`` and ``memory_reserved`` each flatten all of them into a dict in Python)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return stats["allocated_bytes"]["all"]["current"], stats["reserved_bytes"]["all"]["current"]


def batch_size(memory, n_windows, n_voxels, n_volumes, dtype, fused, solver, max_batch=None, refine=False,
               lambda_plus=False, leading=False) -> int:
    """Windows per batch: what ``MEMORY_SHARE`` of the memory the run may still take holds (``memory``:
    ``DeviceMemory``), at most ``MAX_BATCH``; ``lambda_plus``: the run adds each window's lambda_+ too;
    ``leading``: the solver finds the leading eigenpairs alone (``GPURun.leading``)."""
    cap = min(max_batch or MAX_BATCH, max(n_windows, 1))
    free = memory.free()
    if math.isinf(free):
        return cap
    probe = 256
    if leading:  # its eigensolve is of the projected matrices, in float64
        workspace = solver.workspace_bytes(probe, cusolver.leading_width(), torch.float64) / probe
    else:
        workspace = solver.workspace_bytes(probe, min(n_voxels, n_volumes), dtype) / probe
    per_window = _bytes_per_window(n_voxels, n_volumes, dtype, fused, workspace, refine, lambda_plus, leading)
    return int(max(1, min(cap, MEMORY_SHARE * max(free, 0) // per_window)))


def run_in_batches(n_items, step, run, *, min_batch=None, on_batch=None, on_retry=None):
    """``run(a, b)`` over consecutive ranges of ``n_items`` items, ``step`` at a time; returns the results in
    order, the last step used and the number of out-of-memory retries.

    A range that runs out of device memory is redone at half the step (the step stays small for the rest),
    after ``on_retry()`` (to drop caches) and torch's cached memory is handed back; at ``min_batch`` (default
    ``MIN_BATCH``) the error goes up. ``run`` must allocate all it needs before it changes anything, so that a
    range can be redone. ``on_batch(b)`` after each range.
    """
    min_batch = MIN_BATCH if min_batch is None else min_batch
    results, start, retries = [], 0, 0
    while start < n_items:
        stop = min(start + step, n_items)
        try:
            results.append(run(start, stop))
        except Exception as err:  # noqa: BLE001 - only out-of-memory is recovered from
            if not is_out_of_memory(err) or step <= min_batch:
                raise
            step, retries = max(min_batch, step // 2), retries + 1
            if on_retry:
                on_retry()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        start = stop
        if on_batch:
            on_batch(stop)
    return results, step, retries


@dataclass(frozen=True)
class Slab:
    """A run of the plan's windows (``windows``, by corner x) and the x-planes they touch: from ``first`` to
    ``stop`` (exclusive; the corners' planes and the extent's halo). After them the planes below ``done``
    are final: no later window reaches them."""

    windows: slice
    first: int
    stop: int
    done: int


def plan_slabs(plan, planes: int) -> list[Slab]:
    """Cut the plan into slabs whose windows have their corners in ``planes`` consecutive x-planes."""
    nx, ex = plan.spatial_shape[0], plan.extent[0]
    corner_x = plan.window_corner[:, 0]
    slabs = []
    for first in range(0, nx, max(1, int(planes))):
        done = min(first + max(1, int(planes)), nx)
        w0, w1 = np.searchsorted(corner_x, [first, done])
        slabs.append(Slab(slice(int(w0), int(w1)), first, min(done + ex - 1, nx), done))
    return slabs


def slab_bytes(plan, n_volumes: int, planes: int, lambda_plus=False) -> int:
    """Device bytes of a slab of ``planes`` x-planes of window corners: the whole series (with its sums) when
    that is all of them; else the slab with its halo, its sums and the next slab's series arriving beside it.
    ``lambda_plus``: one more sum per voxel."""
    nx, ny, nz = plan.spatial_shape
    more = 4 if lambda_plus else 0
    if planes >= nx:
        return nx * ny * nz * (8 * n_volumes + 20 + more)  # series + finite, image + weight/sigma/rank sums
    return (planes + plan.extent[0] - 1) * ny * nz * (12 * n_volumes + 24 + more)


def slab_planes(memory, plan, n_volumes: int, lambda_plus=False) -> int:
    """x-planes of window corners per slab: all of them when the whole series and its sums take at most
    ``SLAB_SHARE`` of what the run may take (``memory``: ``DeviceMemory``; the batches get the rest), else as
    many as fit there with the halo and the next slab's upload beside them. Raises GPUOutOfMemoryError when
    even one plane's slab would take more than half of it."""
    nx = plan.spatial_shape[0]
    room = memory.free()
    if math.isinf(room):
        return nx
    if slab_bytes(plan, n_volumes, nx, lambda_plus) <= SLAB_SHARE * room:
        planes = nx
    else:
        per_plane = slab_bytes(plan, n_volumes, 1, lambda_plus) // plan.extent[0]
        planes = max(1, int(SLAB_SHARE * room // per_plane) - (plan.extent[0] - 1))
    least = slab_bytes(plan, n_volumes, 1, lambda_plus)
    if least > room / 2:
        raise GPUOutOfMemoryError(
            f"the GPU memory this run may take ({room / GIB:.2f} GiB) is too small for this series: a slab of "
            f"one x-plane of patches takes {least / GIB:.2f} GiB, and needs at least {2 * least / GIB:.2f} GiB")
    memory.slab = slab_bytes(plan, n_volumes, planes, lambda_plus)
    return planes


def box_fits(memory, plan, n_volumes, slab) -> bool:
    """Whether the box sums' scratch for ``slab`` fits in ``MEMORY_SHARE`` of what the run may still take."""
    return boxsums.scratch_bytes(plan, n_volumes, slab.done - slab.first) <= MEMORY_SHARE * memory.free()


class GPURun:
    """What stays the same across the slabs and batches of one run: the plan, options, settings, precision,
    eigensolver and paths, the patch geometry on the device; and what the run learns (batch size, retries,
    counts of windows redone)."""

    def __init__(self, plan, options, device, settings: GPUSettings, n_volumes, memory: DeviceMemory):
        self.plan, self.options, self.device, self.memory = plan, options, device, memory
        self.path, self.max_batch = settings.path, settings.max_batch
        self.demean, self.center = options.demean, options.aggregation == "center"
        self.dtype = gram_precision(options, settings.precision, takes_mean_apart(
            options, device, settings.path, settings.eigensolver, plan.patch_size, n_volumes))
        self.solver = eigensolver_for(settings.eigensolver, device, min(plan.patch_size, n_volumes), self.dtype)
        self.settle = settings.settle and self.dtype == torch.float32
        self.settle_slack = (threshold.TRIDIAGONAL_SETTLE_SLACK if isinstance(self.solver, TridiagonalEigh)
                             else threshold.SETTLE_SLACK)
        self.window_base = plan.window_base()
        self.voxel_offsets = to_device(plan.voxel_offsets.astype(np.int32), device)
        # each patch voxel's factor on its window's weight, None where all are 1 (``PatchPlan.voxel_weights``)
        voxel_scale = plan.voxel_weights(options.aggregation)
        self.voxel_scale = None if voxel_scale is None else to_device(voxel_scale.astype(np.float32), device)
        # a given noise level on the device: sigma^2, one number (one element) or a map of the series' rows
        self.noise_map = np.ndim(options.noise_variance) > 0
        self.noise_variance = (None if options.noise_variance is None
                               else to_device(np.asarray(options.noise_variance, dtype=np.float64).reshape(-1),
                                              device))
        self.step, self.retries, self.n_settled, self.n_redone_on_cpu = 0, 0, 0, 0
        self.settled_on_device = []  # per part or slab settled on the device: windows it redid (device scalars)
        self._settled_counts = None  # their copies on the host (``download_counts``)
        self.fused = None  # the paths, set with the first slab (``choose_paths``)
        self.refine = 0  # block size of the refinement (0: none)
        self.leading = False  # whether a refined run finds the leading eigenpairs alone (``choose_paths``)
        self.mean_apart = False  # float32 first pass of an undemeaned run, fused, tridiagonal
        self.takes_box_sums = False  # whether the first pass may take ``boxsums``
        self.n_box_slabs = 0
        self.first_pass = "queued"  # or "captured" / "replayed" as CUDA graphs (``graphs.FirstPassGraphs``)
        self.side = torch.cuda.Stream(device, priority=SETTLE_PRIORITY) if device.type == "cuda" else None

    def choose_paths(self, finite_host, n_volumes):
        """The Gram and reconstruction paths, the refinement and the mean taken apart (once, at the first
        slab); raises ValueError where a forced path cannot serve the patch."""
        if self.fused is not None:
            return
        n_voxels = self.plan.patch_size
        self.fused = self.path in ("fused", "box") or (self.path == "auto"
                                                     and fused_fits(n_voxels, n_volumes, self.dtype))
        if self.fused and not fused_fits(n_voxels, n_volumes, self.dtype):
            raise ValueError(f"the fused kernels do not take n={n_voxels}, T={n_volumes} in {self.dtype}")
        m = min(n_voxels, n_volumes)
        refines = (self.settle and not self.fused and isinstance(self.solver, ProjectorFromVectors)
                   and m >= cusolver.REFINE_MIN_ORDER)
        self.refine = cusolver.refine_block(m) if refines else 0
        # on the longest series, where the estimate reads only the leading eigenvalues and the trace, a block
        # Krylov space finds those alone, for far less than the full eigensolve (``cusolver.LEADING_MIN_ORDER``)
        self.leading = bool(self.refine) and m >= cusolver.LEADING_MIN_ORDER and (
            self.noise_variance is not None or self.options.estimator in LEADING_ESTIMATORS)
        self.mean_apart = (self.fused and self.demean == "none" and self.dtype == torch.float32
                           and isinstance(self.solver, TridiagonalEigh))
        self.takes_box_sums = (self.path in ("auto", "box") and boxsums.applies(
            self.plan, self.options, finite_host, n_volumes, self.dtype, self.fused))
        if self.path == "box" and not self.takes_box_sums:
            raise ValueError("the box sums take voxel demeaning, weighted or uniform aggregation, a float32 "
                             f"first pass, T <= {boxsums.MAX_VOLUMES}, stride > 1 with every window active "
                             "and every voxel finite, in cuboid patches")

    def settles_on_device(self, n_volumes) -> bool:
        """Whether the settling pass can run with no synchronisation (``settling.settle_on_device``): a float32
        first pass settled by the fused kernels in float64 and the tridiagonal kernels (which cannot fail, so
        nothing is left for the CPU), weighted or uniform aggregation (centre rows are chosen on the host)."""
        return (self.settle and not self.refine and not self.center and self.path != "gather"
                and isinstance(self.solver, TridiagonalEigh)
                and fused_fits(self.plan.patch_size, n_volumes, torch.float64))

    def batch_size(self, n_windows, n_volumes, dtype=None, fused=None, refine=None) -> int:
        """``batch_size`` for this run's patch and solver (default: the first pass's precision and paths)."""
        refine = self.refine if refine is None else refine
        return batch_size(self.memory, n_windows, self.plan.patch_size, n_volumes, dtype or self.dtype,
                          self.fused if fused is None else fused, self.solver, self.max_batch,
                          refine, self.options.lambda_plus, leading=bool(refine) and self.leading)

    @property
    def gram_path(self):
        """How the first pass's Gram matrices were computed: "box" (in some slab), "fused" or "gather"."""
        return "box" if self.n_box_slabs else "fused" if self.fused else "gather"

    def download_counts(self):
        """Queue the copy of the device's counts of redone windows to the host (no wait: ``settled`` reads
        them once the device is done)."""
        if self.settled_on_device:
            counts = torch.stack(self.settled_on_device)
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=counts.is_cuda)
            self._settled_counts = host.copy_(counts, non_blocking=True)

    def settled(self) -> int:
        """Windows redone in float64 (after ``download_counts`` and the device's last work)."""
        on_device = int(self._settled_counts.sum()) if self._settled_counts is not None else 0
        return self.n_settled + on_device
