"""The GPU pipeline: upload, batches of windows through Gram -> eigensolver -> estimator -> reconstruction,
download. Same contract and same function as ``cpu.denoise_cpu``.

Per batch, with no host synchronisation:

1. Gram matrices of the windows: with voxel demeaning on a full grid of windows (stride > 1, every voxel
   finite), the whole slab's by separable box sums once (``boxsums``: each voxel's outer product summed along
   z, then y, then x); else the fused Triton kernel (time side, n >= T, T up to
   ``kernels.MAX_FUSED_VOLUMES``), or for other shapes (voxel side when n < T, long series) the patches
   gathered into a (B, n, T) batch and multiplied by torch (cuBLAS, IEEE float32/float64).
2. The eigenvalues: ``tridiagonal.TridiagonalEigh`` (Triton: Householder + bisection; then, once the
   ranks are known, inverse iteration for the kept eigenvectors only) or ``eigh.BatchedEigh``
   (cusolverDnXsyevBatched, all eigenvectors); ``eigensolver_for`` says which runs.
   Either on torch's current stream; ``info`` stays on the device.
3. ``estimators.marchenko_pastur_threshold`` (the CPU's own code, on torch tensors, in float64; or, with
   ``FUSED_THRESHOLD``, the same decision and the settling test in one kernel, ``threshold``), the
   solver's projector onto the kept eigenvectors, ``aggregation_weights`` times the window's multiplicity.
4. Reconstruction added into (V, T) image and (V,) weight/sigma/rank sums on the device (atomics), or for
   ``center`` each centre row written to its voxel; with the box sums, the weighted projectors spread back
   over x and y and applied to each voxel once (no atomics). With the box sums the first pass runs in
   parts, on the windows whose rows have arrived while the rest of the series is staged and copied
   (``_SlabContext.start``); with the settling pass on the device, each part is then settled, its final
   x-planes reconstructed, divided and downloaded on a side stream while the next part runs
   (``_PartFinishing``, ``_Finisher``).

Demeaning: ``voxel`` removes each voxel's temporal mean (T - 1 volumes go to the estimator); ``volume``
removes the patch's mean time course over its finite voxels (n_eff - 1 voxels go to the estimator; the
Gram kernel returns the means, (B, T), and the reconstruction adds them back: (x - mu) P + mu), as
``cpu.fit_windows`` does.

Precision: with voxel or volume demeaning everything runs in float32 (the Gram of a centred patch is well
conditioned; the centring happens before the products, never as X^T X - n mu mu^T). Without it
(dwidenoise's mode) a baseline near 1000 makes the Gram's top eigenvalue ~1e6 times its noise eigenvalues,
and float32 eigenvalues of X^T X lose the noise bulk (MRtrix3's own float32 mode differs from its float64
mode by 2.6e-4). There the fused Gram kernel returns the volume-demeaned Gram and the mean mu instead, and the
tridiagonal kernels take X^T X = X_c^T X_c + n mu mu^T with the rank-one term apart (``takes_mean_apart``,
``TridiagonalEigh.values(rank_one=...)``): the noise eigenvalues keep float32's precision of X_c^T X_c.
Undemeaned runs that the fused and tridiagonal kernels cannot serve run in float64.

Settling: the rank test is a comparison, and a window whose margin is below float32's error on its Gram
(~eps lambda_max) can land on either side of it; one such flip in a small phantom is 1e-4 of rms difference
from the float64 CPU path. A float32 run therefore flags, on the device, the windows whose rank would change
if the eigenvalues moved by ``SETTLE_SLACK`` float32 roundings of the largest (``TRIDIAGONAL_SETTLE_SLACK``
for the tridiagonal kernels, whose error is smaller; ``unsettled_ranks``), gives
them weight 0, and after the first pass redoes them, with any failed eigensolves, in float64 on the device:
chosen on the device (``_PlanRun.settles_on_device``: fused kernels, tridiagonal eigensolver, weighted or
uniform aggregation; the run then waits for the device once, at its end; on a stream of its own beside the
first pass's end, or with the box sums beside its next part, ``_PartFinishing``), else after one
synchronisation.

On long series (gathered path, m >= ``REFINE_MIN_ORDER``: T > 128 with the defaults) a float32 eigensolve's
error (~eps lambda_max) exceeds the spacing of the noise bulk, and the test above would flag most windows
(83% at T = 1000, measured). There the patches and the Gram are float64, the eigensolver runs on the Gram
rounded to float32, and Rayleigh-Ritz in float64 on the 64 lowest and 64 highest eigenvectors
(``ProjectorFromVectors.refine``) gives both ends of the spectrum, where the estimator decides, with a
second-order error, and the projector from the top block's Ritz vectors; then only windows whose rank
changes within ``REFINED_SETTLE_SLACK`` roundings (0.3-0.8% at T = 300 and 1000) or reaches the top block
are redone in float64.

Windows whose eigensolve did not converge in the last pass are redone on the CPU with the CPU backend's own
functions and added to the sums.

Out of memory: the batch size comes from the free device memory, but the memory can be taken by another
process meanwhile, or a workspace can outgrow the estimate. A batch that runs out is redone at half the
size (``run_in_batches``), down to ``MIN_BATCH`` windows; then the error goes up (``denoise(device="auto")``
then runs on the CPU, with a warning). A retry is safe because a batch allocates everything it needs before
it adds anything into the sums.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
import threading
import time

import numpy as np
import torch

from ..estimators import aggregation_weights, marchenko_pastur_threshold
from . import boxsums, kernels
from .eigh import BatchedEigh, ProjectorFromVectors
from .upload import StagedSeries, Upload, round_bounds, switching_often, to_device
from .threshold import threshold_on_device
from .tridiagonal import MAX_ORDER as TRIDIAGONAL_MAX_ORDER, TridiagonalEigh

#: The eigensolvers ``denoise_gpu(eigensolver=...)`` takes ("auto": ``eigensolver_for``).
EIGENSOLVERS = ("auto", "tridiagonal", "xsyev", "torch")

#: How the Gram and reconstruction may be computed (``denoise_gpu(path=...)``).
PATHS = ("auto", "box", "fused", "gather")
#: Upper bound on windows per batch (beyond it XsyevBatched gains nothing and workspaces grow linearly).
MAX_BATCH = 16384
#: Share of the free device memory that one batch's buffers may take.
MEMORY_SHARE = 0.5
#: Smallest batch an out-of-memory retry goes down to (below it the GPU would gain nothing over the CPU).
MIN_BATCH = 64
#: How far (in float32 roundings of the largest eigenvalue) the eigenvalues may move before a window's rank
#: counts as unsettled in float32 and is redone in float64 (see ``unsettled_ranks``).
SETTLE_SLACK = 10.0
#: ``SETTLE_SLACK`` for the tridiagonal kernels' eigenvalues (part q of the suite, every window of the seed's
#: problem with voxel and with volume demeaning: errors a median 1.2 and at most 7.7 float32 roundings of the
#: largest on any eigenvalue, 0.6 on the smallest, against XsyevBatched's 4.3 and 12; at a slack of 0.5 no
#: window whose rank differs from float64's went unflagged; at 3, 3.4% / 0.6% of the windows are flagged,
#: at 10, 11.5% / 2.0%).
TRIDIAGONAL_SETTLE_SLACK = 3.0
#: Eigenvectors at each end of the spectrum whose Rayleigh-Ritz values in float64 replace a float32
#: eigensolve's eigenvalues (``ProjectorFromVectors.refine``): ``refine_block`` of them, at most this many.
REFINE_BLOCK = 64
#: Smallest matrix order the refinement serves (below, the blocks would leave too little room for the rank).
REFINE_MIN_ORDER = 64
#: A refined window whose rank reaches its block less ``REFINE_GUARD`` is decided outside the refined top
#: block: unsettled.
REFINE_GUARD = 8
#: ``SETTLE_SLACK`` for refined eigenvalues (their error is far below a float32 rounding of the largest).
REFINED_SETTLE_SLACK = 0.1
#: Undemeaned float32 runs (the mean taken apart): a window whose kept and dropped eigenvalues are closer
#: than float32 can separate, eps ||A|| / gap above this, is redone in float64 (the tridiagonal kernels'
#: projector errs by up to ~0.6 times that ratio, measured on undemeaned patches; a mixing of kept and
#: dropped noise-level vectors by 1e-2 moves a voxel by ~1e-2 of the noise). Part b of the suite, dwidenoise's
#: mode on 96x96x48x48: 4.8e-7 from float64 at 1e-2 and with no limit (3,263 windows settled for their rank
#: either way), 1.7e-7 at 1e-5 but with 88% of the windows redone.
PROJECTOR_GAP_LIMIT = 1e-2
#: The estimator and the settling test in one Triton kernel per batch (``threshold``) instead of ~125 torch
#: launches (20.6 ms of device time in dwidenoise's mode, fifth session's profile). Measured on the H200
#: (sixth session, suite part b): dwidenoise's mode 181 -> 160 ms host to host alone, 142 -> 123 ms with the
#: 16-lane projector launch; same ranks and settled windows. False: ``marchenko_pastur_threshold`` on torch
#: tensors (the reference; tests compare the two under the interpreter).
FUSED_THRESHOLD = True
#: Priority of the settling pass's stream beside the box sums' spread (``_settle_on_device``; lower is
#: higher, -1 or below the highest torch gives).
SETTLE_PRIORITY = -1
#: The box sums' first pass replayed as CUDA graphs, one per part of the series' upload, on the runs of a
#: geometry after its first (``_FirstPassGraphs``): each part is one launch for the host instead of ~30
#: torch operations and 6 Triton launches (the host's queueing was the first pass's critical path, eighth
#: session's timeline). Measured on the H200 (ninth session, suite part k, the seed's problem): the caller's
#: thread has queued the run at 7.0 ms instead of 14.2; end to end 11.6 vs 11.7 ms at 3 rounds (the device is
#: the limit then), 11.7 vs 15.1 at 6. False: every run queues its first pass itself.
GRAPHS = True
#: With the box sums and the settling pass on the device, each part of the first pass settled, reconstructed,
#: divided and downloaded on the side stream while the next part runs (``_PartFinishing``). False: the
#: settling pass of all the slab's windows after the first pass, then the reconstruction (the tenth session's
#: flow; for comparisons).
FINISH_BY_PART = True
#: The settling pass of each replayed part starts at the event its graph records once the part's verdicts are
#: known (an external event node), before the part's projectors and spread; False: after the whole part.
VERDICT_EVENTS_IN_GRAPHS = True
#: Geometries whose first-pass graphs, series on the device and box sums' scratch are kept between runs
#: (each holds the scratch of one slab: ~2 GiB at the seed's size; a dataset's runs mostly share one).
GRAPH_CACHE = 1


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
    if options.demean != "none" or path == "gather" or not kernels.fused_fits(n_voxels, n_volumes, torch.float32):
        return False
    if eigensolver == "auto":
        return torch.device(device).type == "cuda" and min(n_voxels, n_volumes) <= AUTO_TRIDIAGONAL_MAX_ORDER
    return eigensolver == "tridiagonal"


def _bytes_per_window(n_voxels, n_volumes, dtype, fused, workspace_per_window, refine=False):
    m = min(n_voxels, n_volumes)
    size = torch.empty((), dtype=dtype).element_size()
    per_window = m * m * (2 * size + 4) + 16 * m * 8 + 4 * n_volumes + workspace_per_window
    if refine:  # the float64 Gram, vectors and products beside the solver's copy; patches in float64
        per_window += m * m * (8 + 8 + 8 + size)
        size = 8
    if not fused:  # gathered patches (float32 and compute precision), restored, indices
        per_window += n_voxels * n_volumes * (4 + 2 * size) + n_voxels * 16
    return int(per_window)


#: Largest m for which "auto" takes the tridiagonal kernels (measured: 2-4x faster than XsyevBatched for
#: m <= 64 in float32, slower beyond, where the matrix fills 128 x 128 registers; docs/benchmarks.md).
AUTO_TRIDIAGONAL_MAX_ORDER = 64


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
    if name == "torch":
        return _TorchEigh(device)
    return BatchedEigh(device)


def batch_size(device, n_windows, n_voxels, n_volumes, dtype, fused, solver, max_batch=None, refine=False) -> int:
    """Windows per batch: what ``MEMORY_SHARE`` of the free device memory holds, at most ``MAX_BATCH``."""
    cap = min(max_batch or MAX_BATCH, max(n_windows, 1))
    if device.type != "cuda":
        return cap
    probe = 256
    workspace = solver.workspace_bytes(probe, min(n_voxels, n_volumes), dtype) / probe
    per_window = _bytes_per_window(n_voxels, n_volumes, dtype, fused, workspace, refine)
    free, _ = torch.cuda.mem_get_info(device)
    return int(max(1, min(cap, MEMORY_SHARE * free // per_window)))


def run_in_batches(n_items, step, run, *, min_batch=None, on_batch=None, on_retry=None):
    """``run(a, b)`` over consecutive ranges of ``n_items`` items, ``step`` at a time; returns the results in
    order, the last step used and the number of out-of-memory retries.

    A range that runs out of device memory is redone at half the step (the step stays small for the rest),
    after ``on_retry()`` (to drop caches) and torch's cached memory is handed back; at ``min_batch`` (default
    ``MIN_BATCH``) the error goes up. ``run`` must allocate all it needs before it changes anything, so that a range can be redone.
    ``on_batch(b)`` after each range.
    """
    from ..errors import is_out_of_memory

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


def slab_planes(device, plan, n_volumes: int) -> int:
    """x-planes of window corners per slab: all of them when the whole series and its sums take at most half
    of ``MEMORY_SHARE`` of the free device memory (the batches get the rest), else as many as fit there
    with the halo and the next slab's upload beside them."""
    nx, ny, nz = plan.spatial_shape
    if device.type != "cuda":
        return nx
    free, _ = torch.cuda.mem_get_info(device)
    budget = MEMORY_SHARE * free / 2
    whole = nx * ny * nz * (8 * n_volumes + 20)  # series + finite, image + weight/sigma/rank sums
    if whole <= budget:
        return nx
    per_plane = ny * nz * (12 * n_volumes + 24)  # and the next slab's series and finite rows
    return max(1, int(budget // per_plane) - (plan.extent[0] - 1))


#: Pieces along x in which the box sums' last step runs when nothing is added after it: each piece's rows
#: are divided and downloaded while the next one computes (the seed's 81 MB took 1.5 ms to download after
#: the reconstruction's 2 ms, sixth session's timeline).
FINAL_PIECES = 8


def _box_fits(device, plan, n_volumes, slab) -> bool:
    """Whether the box sums' scratch for ``slab`` fits in ``MEMORY_SHARE`` of the free device memory."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return boxsums.scratch_bytes(plan, n_volumes, slab.done - slab.first) <= MEMORY_SHARE * free


def _gather_gram(volume, finite, window_base, voxel_offsets, demean, dtype, time_side):
    """The non-fused path: patches gathered into (B, n, T), centred, and their Gram by a batched product.

    ``means`` is (B, n, 1) for voxel demeaning, (B, 1, T) for volume demeaning (over the finite voxels;
    left-out voxels stay rows of zeros), else None: X_hat = X_c P + means, as in ``cpu.fit_windows``.
    """
    voxels = window_base[:, None] + voxel_offsets[None, :].to(torch.int64)
    patches = volume[voxels].to(dtype)
    took_part = finite[voxels]
    means = None
    if demean == "voxel":
        means = patches.mean(dim=2, keepdim=True)
        patches = patches - means
    elif demean == "volume":  # in place: the gathered patches are this function's own copy
        took = took_part.to(dtype)[:, :, None]
        patches.mul_(took)
        means = patches.sum(dim=1, keepdim=True) / took.sum(dim=1, keepdim=True).clamp(min=1)
        patches.addcmul_(took, means, value=-1)
    gram = patches.mT @ patches if time_side else patches @ patches.mT
    return gram.contiguous(), patches, means, took_part, voxels


def refine_block(m: int) -> int:
    """Eigenvectors refined at each end of an m x m spectrum: ``REFINE_BLOCK``, or half the spectrum."""
    return min(REFINE_BLOCK, m // 2)


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


def unsettled_ranks(values, n_voxels, n_volumes, estimator, rank, delta):
    """Windows whose rank the eigenvalues' error ``delta`` ((B, 1): ``rounding_uncertainty``) leaves open:
    the rank changes when the eigenvalues move by ``delta`` (all up, all down, spread apart, drawn together).

    ``values`` (B, m) float64 (ascending), ``rank`` the estimator's answer for them. The threshold test is a
    comparison; a window whose margin is below float32's error on its Gram (~eps lambda_max) can land either
    side (about 1 window in 1000 on the test phantoms, each worth 1e-4 of rms difference on small ones).
    """
    ramp = torch.linspace(-1.0, 1.0, values.shape[1], dtype=values.dtype, device=values.device)[None, :]
    unsettled = torch.zeros(rank.shape, dtype=torch.bool, device=rank.device)
    for moved in (values + delta, values - delta, values + delta * ramp, values - delta * ramp):
        unsettled |= marchenko_pastur_threshold(moved, n_voxels, n_volumes, estimator)[0] != rank
    return unsettled


def ranks_and_settling(values, n_voxels, n_volumes, estimator, delta=None):
    """The estimator's (rank, sigma2) and, given the eigenvalues' error ``delta``, ``unsettled_ranks`` (else
    None): ``threshold.threshold_on_device``'s one kernel with ``FUSED_THRESHOLD``, else the CPU's own
    ``marchenko_pastur_threshold`` on torch tensors."""
    if FUSED_THRESHOLD:
        return threshold_on_device(values, n_voxels, n_volumes, estimator, delta)
    rank, sigma2 = marchenko_pastur_threshold(values, n_voxels, n_volumes, estimator)
    unsettled = None if delta is None else unsettled_ranks(values, n_voxels, n_volumes, estimator, rank, delta)
    return rank, sigma2, unsettled


def denoise_gpu(data, finite, plan, options, *, nprocs=None, progress=None, device=None, path="auto",
                eigensolver="auto", precision="auto", max_batch=None, normalize=True, settle=True, planes=None,
                timeline=False):
    """Run the plan on a CUDA device and return the per-voxel values (``engine.PatchSums``).

    With ``normalize`` (the default) the sums are divided by the weights on the device and come back
    ``normalized`` (the engine's host-side division of the (V, T) sums cost more than this whole backend);
    ``normalize=False`` returns the sums.

    A float32 run (voxel or volume demeaning) ends with a second pass in float64 over the windows whose rank
    float32 could not settle (``unsettled_ranks``: 2-11% of the windows of low-rank phantoms, 31-54% of a
    DWI-like T = 300 crop, on the H200) and those whose eigensolve failed; ``settle=False`` leaves it out
    (to measure float32 alone).

    A series whose data and sums do not fit the device runs in slabs along x (``slab_planes``, ``Slab``):
    each slab's rows are uploaded (the next slab's on a second stream while this one computes), its
    windows run, the rows no later window reaches are divided and downloaded, and the sums of the halo
    (the last extent - 1 planes) are carried into the next slab. One slab when everything fits.

    Parameters beyond ``cpu.denoise_cpu``'s (all optional; for tests and benchmarks):
    ``device`` (default "cuda"; "cpu" runs the same kernels under TRITON_INTERPRET=1), ``path``
    (one of ``PATHS``: how the first pass's Gram and reconstruction are computed; "auto": the box sums where
    ``boxsums.applies`` and their scratch fits, else the fused kernels where they fit, else gathered),
    ``eigensolver`` (one of ``EIGENSOLVERS``), ``precision`` ("auto", "float32", "float64": of the Gram and
    eigensolver), ``max_batch``, ``planes`` (x-planes of window corners per slab; default from the free memory),
    ``timeline`` (``info["timeline_ms"]``: where the host and the device were at each step; off by default, its
    CUDA events cost host time). ``nprocs`` is not used: the few windows whose eigensolve fails twice are redone in this process.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, not {path!r}")
    device = torch.device(device or "cuda")
    graphs = None
    if device.type == "cuda" and GRAPHS and _may_replay(plan, options, finite, data.shape[3], path, eigensolver,
                                                         precision, settle):
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        graphs = _FirstPassGraphs.taken((str(device), plan.spatial_shape, plan.extent, plan.stride, plan.n_windows,
                                         data.shape[3], options, path, eigensolver, precision, max_batch, settle,
                                         planes, normalize, _first_pass_settings()))
    try:
        # the upload's threads get the GIL when they need it, not after Python's default 5 ms
        with switching_often() if device.type == "cuda" else nullcontext():
            return _denoise_gpu(data, finite, plan, options, progress, device, path, eigensolver, precision,
                                max_batch, normalize, settle, planes, timeline, graphs)
    finally:
        if graphs is not None:
            graphs.lock.release()


def _denoise_gpu(data, finite, plan, options, progress, device, path, eigensolver, precision, max_batch, normalize,
                 settle, planes, timed, graphs=None):
    """``denoise_gpu``'s run; ``graphs``: the geometry's ``_FirstPassGraphs`` (taken), if it may use them."""
    from .. import PatchSums

    started = time.perf_counter()
    on_gpu = device.type == "cuda"
    timeline = _Timeline(device, timed)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    n_volumes = data.shape[3]
    host_volume = np.ascontiguousarray(data.reshape(-1, n_volumes), dtype=np.float32)
    slabs = plan_slabs(plan, planes or slab_planes(device, plan, n_volumes))
    # the series' copies on a stream of their own: the run's set-up work queued meanwhile does not wait for them
    copies = torch.cuda.Stream(device) if on_gpu else None
    plane = plan.spatial_shape[1] * plan.spatial_shape[2]
    series = StagedSeries(host_volume) if on_gpu else None
    if len(slabs) > 1:
        graphs = None  # (graphs serve a series that fits whole)

    def upload(slab):
        """Start the slab's series on its way to the device (on the copy stream)."""
        rows = slice(slab.first * plane, slab.stop * plane)
        if not on_gpu:
            return to_device(host_volume[rows], device)
        into = graphs.volume_for((rows.stop - rows.start, n_volumes), device) if graphs is not None else None
        with torch.cuda.stream(copies):
            return series.upload(rows, device, copies, into=into)

    uploads = {}  # slab number -> what ``upload`` returned
    every_voxel_finite = bool(finite.all())
    host_finite = None if every_voxel_finite else np.ascontiguousarray(finite.reshape(-1), dtype=np.float32)

    def rows_of(number):
        """Slab ``number``'s series (on a GPU: an ``upload.Upload`` whose parts the current stream is to wait
        for) and finite flags; called once the slab's tables are set up. The next slab's upload starts here,
        to run beside this one's work."""
        if number + 1 < len(slabs):
            uploads[number + 1] = upload(slabs[number + 1])
        slab = slabs[number]
        rows = slice(slab.first * plane, slab.stop * plane)
        if every_voxel_finite:  # filled on the device, no copy
            finite_rows = torch.ones(rows.stop - rows.start, dtype=torch.float32, device=device)
        else:
            finite_rows = to_device(host_finite[rows], device)
        return uploads.pop(number), finite_rows

    carried, done_windows = None, 0
    report = (lambda done: progress(done_windows + done, plan.n_windows)) if progress else None
    # the first thing: the helper threads stage and copy while this one sets the run up
    uploads[0] = upload(slabs[0])
    timeline.mark("upload started")
    run = _PlanRun(plan, options, device, path, precision, max_batch, settle, eigensolver, n_volumes)
    timeline.mark("plan's tables")
    outputs = [torch.empty(shape, dtype=torch.float32, pin_memory=on_gpu)
               for shape in ((len(host_volume), n_volumes),) + ((len(host_volume),),) * 3]
    downloads = torch.cuda.Stream(device) if on_gpu else None
    timeline.mark("set up")
    for number, slab in enumerate(slabs):
        if graphs is not None:  # (one slab) the sums the geometry's graphs add into
            sums = graphs.sums_for((slab.stop - slab.first) * plane, n_volumes, device)
        else:
            sums = _SlabSums((slab.stop - slab.first) * plane, n_volumes, device, carried)
        final = (slab.done - slab.first) * plane
        finisher = _Finisher(sums, outputs, slab.first * plane, final, normalize, downloads)
        timeline.mark("slab's sums")
        run.slab(slab, lambda: rows_of(number), sums, report, data, finite, finisher=finisher,
                 timeline=timeline, graphs=graphs)
        done_windows = slab.windows.stop
        finisher.up_to(final)
        carried = sums.tail(final)
    run.download_counts()
    timeline.mark("all queued")
    if on_gpu:
        downloaded = torch.cuda.Event()
        downloaded.record(downloads)
        torch.cuda.current_stream(device).wait_event(downloaded)
        torch.cuda.current_stream(device).synchronize()  # the run's one wait, unless a pass needed the host
        timeline.mark("done")
        for piece, at in sorted(series.queued_at.items()):  # (the uploader thread's)
            timeline.note(f"round {piece}'s copy queued", at)
        for piece, at in sorted(series.staged_at.items()):
            timeline.note(f"round {piece} staged", at)
        if series.started_at is not None:
            timeline.note("staging threads started", series.started_at)
        # (max_memory_allocated flattens every statistic into a dict in Python: 161 calls, seventh session)
        peak = torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["peak"]
        device_name = torch.cuda.get_device_name(device)
    else:
        peak, device_name = 0, "cpu (Triton interpreter)"
    image, weight, sigma, rank = (x.numpy() for x in outputs)
    return PatchSums(image, weight, sigma, rank, normalized=normalize,
                     info=dict(backend="gpu", device=device_name, eigensolver=run.solver.backend,
                               gram_precision=str(run.dtype).replace("torch.", ""),
                               gram_path=run.gram_path, batch=run.step,
                               out_of_memory_retries=run.retries, n_slabs=len(slabs),
                               n_settled_in_float64=run.settled(), n_redone_on_cpu=run.n_redone_on_cpu,
                               eigenvalues_refined=bool(run.refine), mean_taken_apart=run.mean_apart,
                               first_pass=run.first_pass,
                               gpu_peak_bytes=int(peak), seconds_engine=time.perf_counter() - started,
                               **(dict(timeline_ms=timeline.milliseconds()) if timed else {})))


class _SlabSums:
    """The per-voxel sums of one slab's rows on the device: image (rows, T), weight, sigma and rank (rows,),
    starting from the halo sums the previous slab ``carried`` into its first rows."""

    def __init__(self, n_rows, n_volumes, device, carried=None):
        self.image = torch.zeros((n_rows, n_volumes), dtype=torch.float32, device=device)
        self.weight, self.sigma, self.rank = (torch.zeros(n_rows, dtype=torch.float32, device=device)
                                              for _ in range(3))
        if carried is not None:
            for sums, values in zip(self.tensors(), carried):
                sums[:len(values)] = values

    def tensors(self):
        return self.image, self.weight, self.sigma, self.rank

    def zero_(self):
        for sums in self.tensors():
            sums.zero_()
        return self

    def tail(self, start):
        """The sums of rows ``start`` on (the halo a next slab goes on adding into), or None if there are none."""
        return tuple(x[start:].clone() for x in self.tensors()) if start < len(self.weight) else None

    def divide(self, rows: slice):
        """Values instead of sums in ``rows``: 0 where no patch served the voxel (its sums are 0)."""
        kernels.divide_rows(self.image, self.weight, self.sigma, self.rank, rows)

    def add(self, rows, image, weight, sigma, rank, replace=False):
        """Add host-computed values into rows (or, with ``replace``, write them: centre aggregation)."""
        index = to_device(rows, self.weight.device)
        for sums, values in zip(self.tensors(), (image, weight, sigma, rank)):
            values = to_device(np.asarray(values, dtype=np.float32), sums.device)
            if replace:
                sums[index] = values
            else:
                sums.index_add_(0, index, values)


class _Timeline:
    """Where a run's host and device are at its steps, if ``enabled``: ``mark(step)`` notes the host's time and,
    on a GPU, records an event on the device's current stream; ``milliseconds()`` (after the final
    synchronisation) gives [step, host ms, device ms] from the start, the device's being when it reached the
    step's event. Timings without a profiler (``info["timeline_ms"]``; the suite reads them); each mark costs
    the host an event's creation and record, so nothing is marked unless asked."""

    def __init__(self, device, enabled=True):
        self.device, self.enabled, self.started, self.steps = device, enabled, time.perf_counter(), []
        self.start_event = self._event() if enabled else None

    def _event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self, step, event=None):
        """``event``: instead of one recorded on the current stream now (another stream's, timing enabled)."""
        if self.enabled:
            self.steps.append((step, time.perf_counter(), event or self._event()))

    def note(self, step, at):
        """A step of the host alone (another thread's), at ``at`` (``time.perf_counter()``)."""
        if self.enabled:
            self.steps.append((step, at, None))

    def milliseconds(self):
        return [[step, round((at - self.started) * 1e3, 3),
                 round(self.start_event.elapsed_time(event), 3) if event is not None else None]
                for step, at, event in sorted(self.steps, key=lambda step: step[1])]


class _Finisher:
    """A slab's rows before ``final`` divided by their weights (with ``normalize``) and copied into the host
    ``outputs`` from row ``first`` on, as they get their last addition (``up_to``): on the GPU, divided on the
    current stream and downloaded on the ``downloads`` stream while the device goes on computing. The image's
    rows go as they are finished, the three maps' (1/T of the image each) when asked (``maps``) and with the
    last rows: fewer copies to queue (the host's queueing was the run's critical path there, eighth
    session's timeline). Without ``outputs``: divided only (as captured in a graph, ``_PartFinishing``)."""

    def __init__(self, sums, outputs, first, final, normalize, downloads):
        self.sums, self.outputs, self.first, self.final = sums, outputs, first, final
        self.normalize, self.downloads, self.done, self.maps_done = normalize, downloads, 0, 0
        if downloads is not None:
            for values in sums.tensors():  # read by the downloads: not reused before they are done
                values.record_stream(downloads)

    def divider(self):
        """A ``_Finisher`` of the same rows that divides them and copies nothing."""
        return _Finisher(self.sums, None, self.first, self.final, self.normalize, None)

    def up_to(self, stop, maps=False, divided=None):
        """Finish the rows from the last call's ``stop`` up to ``stop`` (at most ``final``); with ``maps`` (or
        at ``final``) download the maps' rows finished since they last went too. ``divided``: an event after
        the rows' division, done elsewhere (a replayed graph), instead of dividing them here."""
        stop = min(stop, self.final)
        rows = slice(self.done, stop)
        copies = []
        if rows.stop > rows.start:
            if self.normalize and divided is None:
                self.sums.divide(rows)
            copies.append((0, rows))
            self.done = stop
        if (maps or stop == self.final) and stop > self.maps_done:
            copies += [(k, slice(self.maps_done, stop)) for k in (1, 2, 3)]
            self.maps_done = stop
        if not copies or self.outputs is None:
            return
        tensors = self.sums.tensors()
        if self.downloads is None:
            for k, part in copies:
                self.outputs[k][self.first + part.start:self.first + part.stop].copy_(tensors[k][part])
            return
        if divided is None:
            divided = torch.cuda.Event()
            divided.record(torch.cuda.current_stream(self.downloads.device))
        self.downloads.wait_event(divided)
        with torch.cuda.stream(self.downloads):
            for k, part in copies:
                self.outputs[k][self.first + part.start:self.first + part.stop].copy_(tensors[k][part],
                                                                                      non_blocking=True)


class _PlanRun:
    """What stays the same across the slabs and batches of one run: the plan, options, precision, path and
    eigensolver, the patch geometry on the device; and what the run learns (batch size, retries, counts)."""

    def __init__(self, plan, options, device, path, precision, max_batch, settle, eigensolver, n_volumes):
        self.plan, self.options, self.device, self.path, self.max_batch = plan, options, device, path, max_batch
        self.demean, self.center = options.demean, options.aggregation == "center"
        self.dtype = gram_precision(options, precision, takes_mean_apart(options, device, path, eigensolver,
                                                                         plan.patch_size, n_volumes))
        self.solver = eigensolver_for(eigensolver, device, min(plan.patch_size, n_volumes), self.dtype)
        self.settle = settle and self.dtype == torch.float32
        self.settle_slack = TRIDIAGONAL_SETTLE_SLACK if isinstance(self.solver, TridiagonalEigh) else SETTLE_SLACK
        self.mean_apart = False  # set with the Gram path: float32 first pass of an undemeaned run, fused, tridiagonal
        self.refine = 0  # block size of the refinement, set with the Gram path (0: no refinement)
        self.window_base = plan.window_base()
        self.voxel_offsets = to_device(plan.voxel_offsets.astype(np.int32), device)
        self.step, self.retries, self.n_settled, self.n_redone_on_cpu = 0, 0, 0, 0
        self.settled_on_device = []  # per slab settled on the device: how many windows it redid (device scalars)
        self._settled_counts = None  # their copies on the host (``download_counts``)
        self.fused = None
        self.takes_box_sums = None  # whether the first pass may take ``boxsums``, set with the Gram path
        self.n_box_slabs = 0
        self.first_pass = "queued"  # or "captured" / "replayed" as CUDA graphs (``_FirstPassGraphs``)
        # the settling pass's stream beside the box sums' spread (``_settle_on_device``): of high priority, so
        # that its short chain of small launches is not queued behind the spread's many programs
        self.side = torch.cuda.Stream(device, priority=SETTLE_PRIORITY) if device.type == "cuda" else None

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

    def settles_on_device(self, n_voxels, n_volumes) -> bool:
        """Whether the settling pass can run with no synchronisation (``_settle_on_device``): a float32 first
        pass settled by the fused kernels in float64 and the tridiagonal kernels (which cannot fail, so
        nothing is left for the CPU), weighted or uniform aggregation (centre rows are chosen on the host)."""
        return (self.settle and not self.refine and not self.center and self.path != "gather"
                and isinstance(self.solver, TridiagonalEigh)
                and kernels.fused_fits(n_voxels, n_volumes, torch.float64))

    @property
    def gram_path(self):
        """How the first pass's Gram matrices were computed: "box" (in some slab), "fused" or "gather"."""
        return "box" if self.n_box_slabs else "fused" if self.fused else "gather"

    def slab(self, slab, arrive, sums, report, data, finite_host, finisher=None, timeline=None, graphs=None):
        """All the windows of one slab: a first pass in the Gram precision, then (float32) the windows it
        could not settle and those whose eigensolve failed in float64, then what failed again on the CPU.
        ``arrive()`` gives the slab's series and finite flags on the device; it is called once the slab's
        tables are set up (their upload runs meanwhile). Queued without waiting for the device where
        ``settles_on_device``; else one synchronisation after the first pass. With the box sums and the
        settling pass on the device, ``finisher.up_to(stop)`` (``_Finisher``) is called as the slab's rows
        before ``stop`` get their last addition (else the caller finishes them after). ``timeline``
        (``_Timeline``) marks the steps.
        ``graphs`` (``_FirstPassGraphs``, taken): with the box sums and the settling pass on the device, the
        geometry's first pass is captured on its second run and replayed from then on."""
        plan, n_volumes, n_voxels = self.plan, sums.image.shape[1], self.plan.patch_size
        mark = timeline.mark if timeline is not None else lambda step: None
        on_final = finisher.up_to if finisher is not None else None
        if self.fused is None:
            self.fused = self.path in ("fused", "box") or (self.path == "auto"
                                                  and kernels.fused_fits(n_voxels, n_volumes, self.dtype))
            if self.fused and not kernels.fused_fits(n_voxels, n_volumes, self.dtype):
                raise ValueError(f"the fused kernels do not take n={n_voxels}, T={n_volumes} in {self.dtype}")
            m = min(n_voxels, n_volumes)
            refines = (self.settle and not self.fused and isinstance(self.solver, ProjectorFromVectors)
                       and m >= REFINE_MIN_ORDER)
            self.refine = refine_block(m) if refines else 0
            self.mean_apart = (self.fused and self.demean == "none" and self.dtype == torch.float32
                               and isinstance(self.solver, TridiagonalEigh))
            self.takes_box_sums = (self.path in ("auto", "box") and boxsums.applies(
                plan, self.options, finite_host, n_volumes, self.dtype, self.fused))
            if self.path == "box" and not self.takes_box_sums:
                raise ValueError("the box sums take voxel demeaning, weighted or uniform aggregation, a float32 "
                                 f"first pass, T <= {boxsums.MAX_VOLUMES}, stride > 1 with every window active "
                                 "and every voxel finite")
        w0, w1 = slab.windows.start, slab.windows.stop
        if w1 == w0:
            series, _ = arrive()
            if isinstance(series, Upload):  # its copies done before its memory can be reused
                series.wait(torch.cuda.current_stream(self.device))
            return
        row0 = slab.first * plan.spatial_shape[1] * plan.spatial_shape[2]
        if not (graphs is not None and self.takes_box_sums and self.settles_on_device(n_voxels, n_volumes)):
            graphs = None
        arrived = None
        if graphs is not None and graphs.parts is not None:
            arrived = arrive()
            if not graphs.replays(arrived[0]):
                graphs.parts = None  # (captured for other arrivals: captured again on the next run)
        if graphs is not None and graphs.parts is not None:  # captured: replayed
            context = graphs.context
            context.renew(sums)
            self.n_box_slabs += 1
            self.step, self.first_pass = graphs.step, "replayed"
            finishing = self._part_finishing(context, finisher, timeline)
            if finishing is not None:  # (the captured settling passes' counts)
                self.settled_on_device += graphs.settled_counts
            verdicts = graphs.replay(arrived[0], report, finishing)
            mark("first pass replayed")
        else:
            box = None
            if self.takes_box_sums and (self.path == "box" or _box_fits(self.device, plan, n_volumes, slab)):
                box = boxsums.BoxSums(plan, slab, n_volumes, self.device)
                self.n_box_slabs += 1
                mark("box sums' tables")
            context = _SlabContext(self, slab, sums, row0, box)
            finishing = self._part_finishing(context, finisher, timeline)
            mark("slab set up")
            step = self.step or batch_size(self.device, w1 - w0, n_voxels, n_volumes, self.dtype, self.fused,
                                           self.solver, self.max_batch, self.refine)
            series, finite_rows = arrived or arrive()
            verdicts = None
            if graphs is not None and box is not None and graphs.eager_runs:  # (its kernels are built)
                verdicts = graphs.capture(context, series, finite_rows, step, report, finishing)
                if verdicts is not None:
                    self.first_pass = "captured"
                    mark("first pass captured and replayed")
                else:  # the series is there (the capture waited for it)
                    series = series.tensor if isinstance(series, Upload) else series
            if verdicts is None:
                verdicts, step = self._first_pass(context, series, finite_rows, step, report, mark,
                                                  finishing and finishing.part)
                if graphs is not None and box is not None:
                    graphs.eager_runs += 1
            self.step = step
        context.box_gram = None  # the first pass is done with it

        if finishing is not None:  # each part settled and finished on the side stream as it was queued
            finishing.close()
            mark("reconstruction queued")
            return
        if self.settles_on_device(n_voxels, n_volumes):
            settled = self._settle_on_device(context, verdicts, timed=timeline is not None and timeline.enabled)
            mark("settling pass queued")
            if settled is not None:
                mark("settling pass done (its stream)", settled)
            context.accumulate_box(on_final)
            mark("reconstruction queued")
            return
        redo = torch.cat([info for info, _ in verdicts]) != 0
        if self.settle:
            redo |= torch.cat([left for _, left in verdicts])
        # one look at the verdicts, after all the work is queued
        redo = torch.nonzero(redo).reshape(-1).cpu().numpy()
        failed = redo
        if self.settle and len(redo):
            self.n_settled += len(redo)
            fused64 = self.path != "gather" and kernels.fused_fits(n_voxels, n_volumes, torch.float64)
            step64 = batch_size(self.device, len(redo), n_voxels, n_volumes, torch.float64, fused64,
                                self.solver, self.max_batch)
            verdicts, _, retries = run_in_batches(
                len(redo), step64, lambda a, b: context.batch(redo[a:b], torch.float64, fused64, False),
                on_retry=self.solver.release_workspaces)
            self.retries += retries
            failed = redo[torch.nonzero(torch.cat([info for info, _ in verdicts]) != 0).reshape(-1).cpu().numpy()]
        context.accumulate_box()
        if len(failed):
            self.n_redone_on_cpu += len(failed)
            rows, values, replace = _cpu_contributions(data, finite_host, plan, self.options, failed + w0)
            sums.add(rows - row0, *values, replace=replace)

    def _first_pass(self, context, series, finite_rows, step, report, mark, on_part=None):
        """The slab's first pass queued by this thread, in parts as the rows arrive; returns its verdicts
        (per batch: the solver's ``info`` and the windows left unsettled) and the batch size it ended with.
        ``on_part(ready, verdicts, verdicts_ready)`` after each part (``_PartFinishing.part``)."""
        verdicts, first = [], 0
        for ready in context.start(series, finite_rows):  # windows first..ready can run: their rows are there
            part, step, retries = run_in_batches(
                ready - first, step, lambda a, b, first=first: context.batch(
                    slice(first + a, first + b), self.dtype, self.fused, self.settle, self.refine),
                on_batch=(lambda stop, first=first: report(first + stop)) if report else None,
                on_retry=self.solver.release_workspaces)
            verdicts += part
            self.retries += retries
            context.spread_final_planes(ready)
            if on_part is not None:
                on_part(ready, part, context.verdicts_ready)
            first = ready
            mark(f"first pass to window {ready} queued")
        return verdicts, step

    def _part_finishing(self, context, finisher, timeline):
        """A ``_PartFinishing`` for the slab's first pass where it takes the box sums and the settling pass
        runs on the device, else None."""
        if (not FINISH_BY_PART or context.box is None
                or not self.settles_on_device(self.plan.patch_size, context.n_volumes)):
            return None
        return _PartFinishing(self, context, finisher, timeline)

    def _queue_settling(self, context, verdicts, first=0, step=None):
        """Queue, on the current stream, the settling pass of the slab's windows ``first`` on that the
        first pass's ``verdicts`` cover (a failed eigensolve or an unsettled rank): those to redo compacted
        first (``kernels.choose_windows``), their number left on the device, and float64 batches over all those
        places whose kernels return at once past that number (each launch sized for every window, the work
        for the few redone); they add their windows with the fused reconstruction (atomics). ``step``: windows
        per batch (default: from the free memory)."""
        info, left = verdicts[0] if len(verdicts) == 1 else (torch.cat([info for info, _ in verdicts]),
                                                             torch.cat([left for _, left in verdicts]))
        base, multiplicity, asked, count = kernels.choose_windows(info, left, context.base, context.multiplicity, first)
        self.settled_on_device.append(count)
        n_windows = len(info)
        step = step or self._settling_step(n_windows, context.n_volumes)
        _, _, retries = run_in_batches(
            n_windows, step, lambda a, b: context.batch(
                _Chosen(base[a:b], multiplicity[a:b], asked[a:b],
                        count if (a, b) == (0, n_windows) else (count - a).clamp(0, b - a)),
                torch.float64, True, False),
            on_retry=self.solver.release_workspaces)
        self.retries += retries

    def _settling_step(self, n_windows, n_volumes):
        """Windows per batch of a settling pass over ``n_windows`` windows (float64, fused kernels)."""
        return batch_size(self.device, n_windows, self.plan.patch_size, n_volumes, torch.float64, True, self.solver,
                          self.max_batch)

    def _settle_on_device(self, context, verdicts, timed=False):
        """The settling pass without the host (``_queue_settling``) after the whole first pass (the fused
        kernels' first pass; the box sums' with ``FINISH_BY_PART`` off).

        On a GPU the pass runs on a stream of its own (``self.side``, of high priority), from the moment the
        first pass's verdicts are known (``_SlabContext.verdicts_ready``: before its projectors), beside the
        rest of the first pass (its few hundred windows leave most of the device idle; they had weight 0 in
        the first pass), and the current stream waits for it. Every tensor it reads that the current
        stream allocated stays referenced until that wait is queued (so no block it reads is handed to the
        current stream's later work before it is done). Returns the event the current stream waits for (with
        ``timed``, one that times), or None without a stream of its own."""
        if self.side is not None and context.verdicts_ready is None:  # (a replayed first pass)
            context.verdicts_ready = torch.cuda.Event()
            context.verdicts_ready.record(torch.cuda.current_stream(self.device))
        if context.box is not None:  # (``FINISH_BY_PART`` off) the spread queued before, to run beside it
            context.box.spread()
        with torch.cuda.stream(self.side) if self.side is not None else nullcontext():
            if self.side is not None:
                self.side.wait_event(context.verdicts_ready)
            self._queue_settling(context, verdicts)
        if self.side is None:
            return None
        settled = torch.cuda.Event(enable_timing=timed)
        settled.record(self.side)
        torch.cuda.current_stream(self.device).wait_event(settled)
        return settled


class _PartFinishing:
    """With the box sums and the settling pass on the device, each part of a slab's first pass finished as
    soon as it is queued, on the run's side stream (``_PlanRun.side``; on the CPU in turn): its windows'
    settling pass (``_PlanRun._queue_settling``: they had weight 0 in the first pass) from the moment its
    verdicts are known, then, once its spread is done, the x-planes no later window holds
    (``BoxSums.final_planes``) reconstructed (``BoxSums.apply``) in pieces, each divided and downloaded beside
    the rest (``_Finisher``). So only the last part's settling pass, reconstruction and download follow the
    first pass, not the whole slab's. ``part`` queues a part's work; with the first pass's graphs, ``capture``
    captures it as two graphs per part (the settling pass, the reconstruction and division), which
    ``replay`` launches (the host queued ~1.5 ms a part otherwise, and became the run's critical path).

    Nothing here races: the side stream does the settling passes and the reconstruction in order; a part's
    settled windows start at its first corner along x, past the planes every earlier part's reconstruction
    wrote, and the planes a part reconstructs were spread (by the first pass's stream) before it; the first
    pass never writes the sums. ``close()`` makes the current stream wait for the side stream's last work."""

    def __init__(self, run, context, finisher, timeline=None):
        self.run, self.context, self.finisher, self.timeline = run, context, finisher, timeline
        self.stream, self.windows_done, self.planes_done = run.side, 0, 0
        self.planes_per_piece = -(-context.box.shape[0] // FINAL_PIECES)
        self.settling_step = run._settling_step(len(context.base), context.n_volumes)

    def _settle(self, ready, verdicts):
        """Queue the settling pass of the windows from where the last part left off up to ``ready``."""
        self.run._queue_settling(self.context, verdicts, self.windows_done, self.settling_step)
        self.windows_done = ready

    def _apply(self, ready, on_final):
        """Queue the reconstruction of the planes the windows up to ``ready`` leave final, from where the last
        part left off, with ``on_final(stop)`` after each piece and once more for the maps."""
        box = self.context.box
        stop = box.final_planes(ready)
        box.apply(self.context.volume, *self.context.sums.tensors(), self.planes_done, stop, self.planes_per_piece,
                  on_final)
        if on_final is not None:
            on_final(stop * box.shape[1] * box.shape[2], maps=True)
        self.planes_done = stop

    def part(self, ready, verdicts, verdicts_ready=None):
        """The first pass is queued up to window ``ready``: ``verdicts`` those of its windows from the last
        part's ``ready`` on, ``verdicts_ready`` an event after them on the current stream (None: after all the
        part). Queues the part's finishing."""
        on_final = self.finisher.up_to if self.finisher is not None else None
        if self.stream is None:
            self._settle(ready, verdicts)
            self._apply(ready, on_final)
            return
        spread = self._record(torch.cuda.current_stream(self.run.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(verdicts_ready if verdicts_ready is not None else spread)
            self._settle(ready, verdicts)
            self._reconstruct(ready, spread, lambda: self._apply(ready, on_final))

    def _reconstruct(self, ready, spread, queue):
        """(On the side stream, after the part's settling pass) ``queue()`` the part's reconstruction once the
        first pass's ``spread`` is done."""
        self._mark(f"windows to {ready} settled (side stream)")
        self.stream.wait_event(spread)
        queue()
        self._mark(f"planes to {self.context.box.final_planes(ready)} reconstructed (side stream)")

    def capture(self, ready, verdicts, pool, divider):
        """Capture the part's finishing: (settling graph, reconstruction graph, pieces), in the graph pool
        ``pool`` (they run one after the other on the side stream), the second dividing its rows (``divider``:
        ``_Finisher.divider()``, shared by the parts) and recording after each piece an event of its own;
        pieces: (stop, maps, event) for the run's ``_Finisher.up_to``."""
        pieces = []

        def divided(stop, maps=False):
            if divider is not None:
                divider.up_to(stop)
            event = torch.cuda.Event(external=True)
            event.record(torch.cuda.current_stream(self.run.device))
            pieces.append((stop, maps, event))

        graphs = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        queued = (lambda: self._settle(ready, verdicts), lambda: self._apply(ready, divided))
        with torch.cuda.stream(self.stream):
            for graph, queue in zip(graphs, queued):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    queue()
                finally:
                    graph.capture_end()
        return graphs + (pieces,)

    def replay(self, ready, captured, verdicts_ready=None):
        """Launch a part's captured finishing (``capture``) after the current stream's first pass up to
        window ``ready`` and queue its downloads."""
        settling, reconstruction, pieces = captured
        spread = self._record(torch.cuda.current_stream(self.run.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(verdicts_ready if verdicts_ready is not None else spread)
            settling.replay()
            self._reconstruct(ready, spread, reconstruction.replay)
        if self.finisher is not None:
            for stop, maps, event in pieces:
                self.finisher.up_to(stop, maps, divided=event)

    def reset(self):
        """For a first pass from its first window again (after ``capture``)."""
        self.windows_done = self.planes_done = 0

    @staticmethod
    def _record(stream, timed=False):
        event = torch.cuda.Event(enable_timing=timed)
        event.record(stream)
        return event

    def _mark(self, step):
        if self.timeline is not None and self.timeline.enabled:
            self.timeline.mark(step, self._record(self.stream, timed=True))

    def close(self):
        """The current stream waits for the side stream's work (after the last part)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.run.device).wait_stream(self.stream)


def _may_replay(plan, options, finite, n_volumes, path, eigensolver, precision, settle) -> bool:
    """Whether a run may take the box sums with the settling pass on the device, as ``_FirstPassGraphs``
    need (``_PlanRun.slab`` decides; this keeps other runs from holding a geometry's buffers)."""
    return (path in ("auto", "box") and eigensolver in ("auto", "tridiagonal") and precision in ("auto", "float32")
            and settle and boxsums.applies(plan, options, finite, n_volumes, torch.float32, True))


def _first_pass_settings():
    """The module settings a captured first pass depends on (part of its graphs' key)."""
    from . import tridiagonal

    return (FUSED_THRESHOLD, FINISH_BY_PART, FINAL_PIECES, SETTLE_SLACK, TRIDIAGONAL_SETTLE_SLACK,
            tridiagonal.PROJECTOR_LANES,
            tridiagonal.INVERSE_ITERATIONS, tridiagonal.MULTISECTION, tridiagonal.SHRINKING_BLOCKS,
            tuple(sorted((str(dtype), shifts) for dtype, shifts in tridiagonal.SHIFTS_PER_COUNT.items())),
            tridiagonal.COUNTED_VALUES_LAUNCH, tridiagonal.COUNTED_LAUNCH_LIMIT, tridiagonal.APPROXIMATE_RECIPROCAL,
            tuple(sorted(boxsums.DOT_PRECISION.items())))


class _FirstPassGraphs:
    """The box sums' first pass of one geometry as CUDA graphs, kept between runs (``GRAPHS``).

    A geometry's first run queues its first pass itself (its kernels are built then); the next captures it,
    one graph per part of the series' upload (each part: the Gram sums of the rows there, then the batches
    of the windows they complete, up to the projectors the box holds and the spread of its final planes),
    and with ``FINISH_BY_PART`` each part's finishing too (``_PartFinishing.capture``: its settling pass, and
    its final planes' reconstruction and division, in a graph pool of their own since they run beside the
    first pass), and replays the graphs; later runs replay them, each part's after the stream waits for its
    rows. What the graphs read and write stays where it was at the capture: the series' rows on the device
    (every run's upload goes there, ``volume_for``), the slab's sums (``sums_for``, zeroed per run) and finite
    flags, the box sums' scratch and the slab's tables (in the kept ``context``), the verdicts and the
    settling passes' counts. The downloads are queued per run (into that run's page-locked outputs).

    ``taken(key)`` gives the geometry's entry with its lock held (the caller releases ``lock``), or None
    while another thread's run holds it; ``GRAPH_CACHE`` geometries are kept."""

    _kept = {}
    _kept_lock = threading.Lock()

    def __init__(self):
        self.lock = threading.Lock()
        self.volume = None  # the series' rows on the device, where every run's upload goes
        self.eager_runs = 0  # runs whose first pass was queued by the host (the first builds the kernels)
        # once captured, per part: (graph, arrivals it follows, windows ready after it, the event after its
        # verdicts, its finishing's graphs or None)
        self.parts = None
        self.failed = False  # a capture failed: the geometry's runs queue their first pass themselves
        self.context = self.verdicts = self.step = self.stops = None
        self.sums = self.finite = None  # the sums the graphs add into, the finite flags they read (all ones)
        self.settled_counts = []  # the captured settling passes' counts of windows redone (their tensors)

    @classmethod
    def taken(cls, key):
        with cls._kept_lock:
            entry = cls._kept.get(key)
            if entry is None:
                while len(cls._kept) >= GRAPH_CACHE:
                    cls._kept.pop(next(iter(cls._kept)))
                entry = cls._kept[key] = cls()
        if entry.failed or not entry.lock.acquire(blocking=False):
            return None
        return entry

    def sums_for(self, n_rows, n_volumes, device):
        """The slab's sums (``_SlabSums``) the graphs add into, zeroed (on the current stream)."""
        if self.sums is None or tuple(self.sums.image.shape) != (n_rows, n_volumes):
            self.sums, self.parts = _SlabSums(n_rows, n_volumes, device), None
            return self.sums
        return self.sums.zero_()

    def volume_for(self, shape, device):
        if self.volume is None or tuple(self.volume.shape) != tuple(shape):
            self.volume, self.parts = torch.empty(shape, dtype=torch.float32, device=device), None
        return self.volume

    def capture(self, context, series, finite_rows, step, report, finishing=None):
        """Capture the slab's first pass (``context``: set up, with the box sums) and, with ``finishing``
        (``_PartFinishing``), each part's finishing, and replay them (``replay``); returns the verdicts, or
        None if the capture failed (nothing of it ran; the series has arrived)."""
        run = context.run
        stream = torch.cuda.current_stream(run.device)
        stops = series.row_stops() if isinstance(series, Upload) else []
        volume = series.wait(stream) if isinstance(series, Upload) else series
        self.stops = stops
        if volume is not self.volume:
            return None
        context.volume, context.finite = volume, finite_rows
        consumed = [0]  # arrivals the box sums have taken when a part is complete

        def counted():
            for stop in stops:
                consumed[0] += 1
                yield stop

        parts_of = context.box.gram_in_parts(volume, counted())
        parts, verdicts, first, pool = [], [], 0, torch.cuda.graph_pool_handle()
        # the finishing's graphs run beside the first pass's: a pool of their own (one graph's freed blocks
        # are another's to reuse only among graphs that run one after the other)
        finishing_pool = torch.cuda.graph_pool_handle()
        divider = finishing.finisher.divider() if finishing is not None and finishing.finisher is not None else None
        counted_before = len(run.settled_on_device)
        # captured on a stream of its own (nothing runs there) with the graph API itself: ``torch.cuda.graph``
        # would also synchronise and hand torch's cached memory back, so that the next runs allocate anew
        # (measured: the first replay after it took 56 ms)
        capturing_on = torch.cuda.Stream(run.device)
        context.capturing = True
        try:
            with torch.cuda.stream(capturing_on):
                while first < len(context.base):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        ready = next(parts_of)
                        context.box_gram = context.box.grams
                        part = [context.batch(slice(a, min(a + step, ready)), run.dtype, run.fused, run.settle,
                                              run.refine) for a in range(first, ready, step)]
                        context.spread_final_planes(ready)
                    finally:
                        graph.capture_end()
                    # (the part's verdicts, and the event its graph records after them: ``_SlabContext.batch``)
                    finished = (finishing.capture(ready, part, finishing_pool, divider) if finishing is not None
                                else None)
                    parts.append((graph, consumed[0], ready, context.verdicts_ready, finished))
                    context.verdicts_ready = None
                    verdicts += part
                    first = ready
        except Exception:  # noqa: BLE001 - e.g. out of memory while capturing: the run queues it itself
            self.failed = True
            torch.cuda.synchronize(run.device)
            context.box.planes_spread = 0  # (nothing of it ran)
            del run.settled_on_device[counted_before:]
            if finishing is not None:
                finishing.reset()
            return None
        finally:
            context.capturing = False
        if finishing is not None:
            finishing.reset()
        self.parts, self.context, self.verdicts, self.step = parts, context, verdicts, step
        self.finite, self.settled_counts = finite_rows, run.settled_on_device[counted_before:]
        return self.replay(volume, report, finishing)  # (the series is there: nothing to wait for)

    def replays(self, series) -> bool:
        """Whether the captured parts can replay on ``series``: uploaded into ``volume`` in the same parts."""
        if isinstance(series, Upload):
            return series.tensor is self.volume and series.row_stops() == self.stops
        return series is self.volume

    def replay(self, series, report, finishing=None):
        """The captured first pass on this run's series (uploaded into ``volume``): each part's graph once
        the current stream waits for the rows it reads, then with ``finishing`` (``_PartFinishing``) the
        part's finishing (its graphs, if captured). Returns the verdicts (the graphs' own tensors)."""
        context = self.context
        stream = torch.cuda.current_stream(context.run.device)
        context.finite = self.finite
        context.box.planes_spread = context.box.shape[0]  # (the graphs spread every plane)
        arrivals = series.arrivals(stream) if isinstance(series, Upload) else iter(())
        waited = 0
        for graph, follows, ready, verdicts_ready, finished in self.parts:
            while waited < follows and next(arrivals, None) is not None:
                waited += 1
            graph.replay()
            if finishing is not None:  # (captured with its finishing: ``FINISH_BY_PART`` is in the key)
                finishing.replay(ready, finished, verdicts_ready if VERDICT_EVENTS_IN_GRAPHS else None)
            if report:
                report(ready)
        for _ in arrivals:
            pass
        return self.verdicts


@dataclass(frozen=True)
class _Chosen:
    """A batch of a slab's windows chosen on the device (``kernels.choose_windows``): their ``base`` rows and
    ``multiplicity`` (B,), of which the first ``count`` (a device integer; ``asked`` (B,): the places before
    it) are to be run; the kernels skip the rest."""

    base: torch.Tensor
    multiplicity: torch.Tensor
    asked: torch.Tensor
    count: torch.Tensor


class _SlabContext:
    """One slab's windows on the device: their corner rows within the slab, multiplicities, centres; and with
    ``box`` (``boxsums.BoxSums``) the first pass's Gram matrices of all of them, and its projectors (with a
    settling pass chosen on the host, that pass's too) until ``accumulate_box`` reconstructs them all at once."""

    def __init__(self, run, slab, sums, row0, box=None):
        device, plan = run.device, run.plan
        self.run, self.sums, self.box, self.n_volumes = run, sums, box, sums.image.shape[1]
        self.volume = self.finite = self.box_gram = None  # once the slab's rows are there (``start``)
        self.verdicts_ready = None  # an event after the first pass's last verdicts (on a GPU, with ``run.side``)
        self.capturing = False  # while the first pass is captured as graphs (``_FirstPassGraphs.capture``)
        self.box_kept = box  # (``renew``: the box of a context kept with its graphs)
        windows = slab.windows
        self.base = to_device(run.window_base[windows] - row0, device)
        self.multiplicity = to_device(plan.multiplicity[windows].astype(np.float64), device)
        if run.center:
            a, b = np.searchsorted(plan.centre_window, [windows.start, windows.stop])
            self.centre_window_host = plan.centre_window[a:b] - windows.start
            self.centre_voxel = to_device((plan.centre_voxel[a:b] - row0).astype(np.int64), device)
            self.centre_window = to_device(self.centre_window_host.astype(np.int32), device)
            self.centre_position = to_device(plan.centre_position[a:b].astype(np.int64), device)

    def renew(self, sums):
        """For another run of a context kept with its first pass's graphs: that run's ``sums`` and the box."""
        self.sums, self.box, self.verdicts_ready = sums, self.box_kept, None

    def start(self, volume, finite):
        """The slab's series (rows, T) and finite flags (rows,) on the device, the series arriving
        (``upload.Upload``) or there. Yields how many of the slab's windows (in order) the first pass may run
        so far; once exhausted, the current stream has waited for the whole series. With the box sums, the
        Gram matrices of the windows whose rows are there are queued as each part of the series arrives, so
        that the first pass runs on them while the rest arrives."""
        self.finite, n_windows = finite, len(self.base)
        arrivals = ()
        if isinstance(volume, Upload):
            arrivals = volume.arrivals(torch.cuda.current_stream(self.run.device))
            volume = volume.tensor  # (its rows are read by work queued after their arrival only)
        elif self.box is not None:  # there at once (the CPU): the parts the upload's rounds would give
            arrivals = iter(int(stop) // volume.shape[1] for stop in round_bounds(volume.numel())[1:])
        self.volume, ready = volume, 0
        if self.box is not None:
            for ready in self.box.gram_in_parts(volume, arrivals):
                self.box_gram = self.box.grams
                yield ready
        for _ in arrivals:  # (without the box sums: all of them before any window runs)
            pass
        if ready < n_windows:
            yield n_windows

    def spread_final_planes(self, ready):
        """With the settling pass on the device (its windows had weight 0 here and are added apart, by the
        fused reconstruction), the box's projectors of the first ``ready`` windows are final once queued:
        the x-planes no later window holds are spread back (``BoxSums.spread``) while the first pass goes on."""
        run = self.run
        if self.box is not None and run.settles_on_device(run.plan.patch_size, self.n_volumes):
            self.box.spread(ready)

    def accumulate_box(self, on_final=None):
        """The box sums' reconstruction of every window they hold at once (after the settling pass: its
        windows are in the box, or already added by the fused reconstruction), in ``FINAL_PIECES`` pieces
        along x with ``on_final(stop)`` after each when given (not with ``_PartFinishing``)."""
        if self.box is not None:
            planes = -(-self.box.shape[0] // FINAL_PIECES) if on_final is not None else None
            self.box.accumulate(self.volume, *self.sums.tensors(), planes_per_piece=planes, on_final=on_final)
            self.box = None

    def batch(self, windows, dtype, fused, settle, refine=0):
        """Gram -> eigensolver -> threshold -> reconstruction of a batch of the slab's windows: a slice
        (first pass), a sorted array of their indices (second pass) or ``_Chosen`` ones (second pass chosen on
        the device: fused kernels, tridiagonal eigensolver, no centre rows). Returns the solver's ``info`` and, with
        ``settle``, the windows left unsettled (given weight 0 here); all on the device, no synchronisation.
        With ``refine`` (a block size: gathered path, a solver with all eigenvectors, m >= ``REFINE_MIN_ORDER``)
        the patches and the Gram are float64, the eigensolver runs on the Gram rounded to ``dtype``, and the
        eigenvalues at both ends of the spectrum are refined in float64 (``ProjectorFromVectors.refine``):
        their far smaller error leaves far fewer windows unsettled on long series.
        Everything is allocated before anything is added into the sums (an out-of-memory retry is safe)."""
        run, device, volume, finite, sums = self.run, self.run.device, self.volume, self.finite, self.sums
        options, demean, n_volumes = run.options, run.demean, volume.shape[1]
        count = asked = None  # the windows run: all, or the first ``count`` of ``_Chosen`` ones (``asked``)
        if isinstance(windows, _Chosen):
            base, batch_multiplicity, asked, count = windows.base, windows.multiplicity, windows.asked, windows.count
        elif isinstance(windows, slice):
            base, batch_multiplicity = self.base[windows], self.multiplicity[windows]
            if run.center:
                a, b = np.searchsorted(self.centre_window_host, [windows.start, windows.stop])
                centres = (self.centre_voxel[a:b], self.centre_window[a:b] - windows.start,
                           self.centre_position[a:b])
        else:
            index = to_device(windows, device)
            base, batch_multiplicity = self.base[index], self.multiplicity[index]
            if run.center:
                chosen = np.flatnonzero(np.isin(self.centre_window_host, windows))
                own = np.searchsorted(windows, self.centre_window_host[chosen]).astype(np.int32)
                chosen = to_device(chosen, device)
                centres = (self.centre_voxel[chosen], to_device(own, device),
                           self.centre_position[chosen])
        n_voxels = run.voxel_offsets.numel()
        time_side = n_voxels >= n_volumes
        # no demeaning in float32 with the tridiagonal kernels: the Gram of the undemeaned patch is
        # n mu mu^T + (the volume-demeaned Gram), exactly; the kernels take the second and the rank-one term
        # apart (``TridiagonalEigh.values(rank_one=...)``), so the patch's mean costs no precision
        rank_one = run.mean_apart and dtype == torch.float32
        if self.box_gram is not None and isinstance(windows, slice) and dtype == torch.float32:  # first pass
            gram = self.box_gram[windows].clone()  # the solver overwrites it; a retried batch needs it whole
            n_took_part = torch.full((len(gram),), n_voxels, dtype=torch.int32, device=device)
            volume_mean = None
        elif fused:
            gram, n_took_part, volume_mean = kernels.gram(volume, finite, base, run.voxel_offsets,
                                                          demean="volume" if rank_one else demean, dtype=dtype,
                                                          count=count)
        else:
            gram, patches, means, took_part, voxels = _gather_gram(
                volume, finite, base, run.voxel_offsets, demean, torch.float64 if refine else dtype, time_side)
            n_took_part = took_part.sum(dim=1).to(torch.int32)
            volume_mean = None  # the gathered path keeps its means in ``means``
        values, info, scale = _eigenvalues_of(run.solver, gram, dtype, refine, rank_one, n_took_part, volume_mean,
                                              count)
        # removing a mean costs one degree of freedom: along time (voxel) or along the voxels (volume)
        usable_voxels = n_took_part - 1 if demean == "volume" else n_took_part
        usable_volumes = n_volumes - int(demean == "voxel")
        delta = (rounding_uncertainty(values, REFINED_SETTLE_SLACK if refine else run.settle_slack, scale)
                 if settle else None)
        patch_rank, sigma2, unsettled = ranks_and_settling(values, usable_voxels, usable_volumes,
                                                           options.estimator, delta)
        keep = info == 0
        if asked is not None:  # the places past the count hold no window (their numbers are left unwritten)
            keep &= asked
        if settle:
            if refine:
                unsettled |= patch_rank >= refine - REFINE_GUARD
            if rank_one:
                unsettled |= unresolved_projectors(values, patch_rank, scale)
            keep &= ~unsettled
            if run.side is not None and run.settles_on_device(n_voxels, n_volumes):
                # the verdicts are known: the settling pass on the side stream may start (an event of the
                # graph's own while captured: each replay records it there)
                self.verdicts_ready = torch.cuda.Event(external=self.capturing)
                self.verdicts_ready.record(torch.cuda.current_stream(device))
        projector = run.solver.projector(patch_rank)
        if run.center:
            patch_weight = keep.to(torch.float32)
        else:  # where, not a product: a place left unwritten may hold any number
            patch_weight = torch.where(keep, aggregation_weights(patch_rank, options.demeaned, options.aggregation)
                                       * batch_multiplicity, 0.0).to(torch.float32)
        patch_sigma = torch.sqrt(sigma2).to(torch.float32)
        patch_rank = patch_rank.to(torch.float32)

        if self.box is not None and not isinstance(windows, _Chosen):
            # the first pass, and a settling pass chosen on the host: its windows replace their projectors
            self.box.add_windows(windows if isinstance(windows, slice) else index, projector.to(torch.float32),
                                 patch_weight, patch_sigma, patch_rank)
        elif fused:  # (a settling pass chosen on the device adds its windows here with the box sums too)
            # (float64 read as it is: a launch sized for every window would convert them all)
            projector = projector.contiguous()
            if run.center:
                kernels.reconstruct_centres(volume, centres[0], centres[1], projector.to(torch.float32),
                                            patch_weight, patch_sigma, patch_rank, *sums.tensors(), demean=demean,
                                            volume_mean=None if rank_one else volume_mean)
            else:
                kernels.reconstruct_accumulate(volume, finite, base, run.voxel_offsets, projector, patch_weight,
                                               patch_sigma, patch_rank, *sums.tensors(), demean=demean,
                                               volume_mean=None if rank_one else volume_mean)
        else:
            projector = projector.to(patches.dtype)
            restored = patches @ projector if time_side else projector @ patches
            if means is not None:
                restored = restored + means
            if run.center:
                rows, own_window, own_position = centres
                w = patch_weight[own_window]
                values = (restored[own_window, own_position].to(torch.float32) * w[:, None], w,
                          w * patch_sigma[own_window], w * patch_rank[own_window])
                for target, value in zip(sums.tensors(), values):
                    target[rows] = value
            else:  # every addend made before the first is added
                voxel_weight = patch_weight[:, None] * took_part
                addends = ((restored * voxel_weight[:, :, None]).reshape(-1, n_volumes).to(torch.float32),
                           voxel_weight.reshape(-1), (voxel_weight * patch_sigma[:, None]).reshape(-1),
                           (voxel_weight * patch_rank[:, None]).reshape(-1))
                flat = voxels.reshape(-1)
                for target, addend in zip(sums.tensors(), addends):
                    target.index_add_(0, flat, addend)
        return info, unsettled


def _eigenvalues_of(solver, gram, dtype, refine, rank_one, n_took_part, volume_mean, count=None):
    """The eigen step's first half for ``_SlabContext.batch``: eigenvalues (B, m) float64 ascending, ``info``
    and the scale of their float32 error (None: the largest eigenvalue). ``refine`` (a block size): the
    float64 ``gram`` solved rounded to ``dtype``, both ends refined in float64. ``rank_one``: ``gram`` is
    the volume-demeaned Gram and n mu mu^T (``volume_mean`` mu, ``n_took_part`` n) is added as a rank-one
    term; the error scale is then the demeaned Gram's norm. ``count``: only the first ``count`` are solved
    (the tridiagonal kernels; ``_Chosen`` batches)."""
    if refine:
        values, info = solver.values(gram.to(dtype))
        values, refine_info = solver.refine(gram, refine)
        return values, info | refine_info, None
    if rank_one:
        scale = torch.linalg.matrix_norm(gram).to(torch.float64)  # before the solver overwrites it
        mean = volume_mean.to(torch.float64)
        norm2 = (mean * mean).sum(dim=1)
        direction = mean / norm2.sqrt().clamp(min=torch.finfo(torch.float64).tiny)[:, None]
        values, info = solver.values(gram, rank_one=(direction, n_took_part.to(torch.float64) * norm2))
        return values.to(torch.float64), info, scale
    values, info = solver.values(gram) if count is None else solver.values(gram, count=count)
    return values.to(torch.float64), info, None


class _TorchEigh(ProjectorFromVectors):
    """``torch.linalg.eigh`` with BatchedEigh's interface (for comparisons: the seed ladder's second step)."""

    backend = "torch.linalg.eigh"

    def __init__(self, device):
        self.device = device

    def workspace_bytes(self, batch, m, dtype):
        return 0

    def release_workspaces(self):
        pass

    def __call__(self, matrices):
        values, vectors = torch.linalg.eigh(matrices)
        return values, vectors, torch.zeros(len(matrices), dtype=torch.int32, device=matrices.device)


def _cpu_contributions(data, finite, plan, options, windows):
    """What the windows whose eigensolve failed on the device give, computed by the CPU backend's functions:
    ``(rows, (image, weight, sigma, rank), replace)``: values to add into those rows, or for centre
    aggregation to write there (``replace``)."""
    from ..cpu import fit_windows

    n_volumes = data.shape[3]
    fit = fit_windows(data.reshape(-1, n_volumes), finite.reshape(-1), plan, options, windows)
    restored = fit.reconstruct()
    if options.aggregation == "center":
        centres = np.flatnonzero(np.isin(plan.centre_window, windows))
        own = np.searchsorted(windows, plan.centre_window[centres])
        rows = plan.centre_voxel[centres]
        values = (restored[own, plan.centre_position[centres]], np.ones(len(rows)),
                  np.sqrt(fit.sigma2[own]), fit.rank[own])
        return rows, values, True
    w = aggregation_weights(fit.rank, options.demeaned, options.aggregation) * plan.multiplicity[windows]
    voxel_weight = w[:, None] * fit.took_part
    values = ((restored * voxel_weight[:, :, None]).reshape(-1, n_volumes), voxel_weight.ravel(),
              (voxel_weight * np.sqrt(fit.sigma2)[:, None]).ravel(), (voxel_weight * fit.rank[:, None]).ravel())
    return fit.voxels.ravel(), values, False
