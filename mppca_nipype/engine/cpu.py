"""The CPU backend: NumPy/OpenBLAS and LAPACK, batched over patches, spread over worker processes.

Work is cut into *units*: all active windows whose corner lies on one x position, taken by the workers in
unit order. A unit runs its windows in stacked batches (batched gather, batched Gram, every eigenvalue and
the kept eigenvectors only (``lapack``), projection onto those) into a private slab of the ``extent[0]``
x-planes it touches, then adds the slab into the sums, which all processes share, plane by plane in each
plane's turn (``PlaneTurns``): every plane takes its units' slabs in unit order, so the result does not
depend on how many processes ran the units (it is bit-identical for any ``nprocs``) and nothing is left for
the parent to add.

Workers share the input volume through ``multiprocessing.shared_memory`` (one copy, whatever their
number, in the (V, T) rows they gather patches from: a volume-major series is reordered into it in blocks,
``layout``) and each limits its BLAS to one thread: on matrices of 48 x 48, one thread per process is faster
than a multithreaded BLAS fighting over the same cores. ``PROFILE`` times every phase (``PhaseClock``).

Precision (``first_pass_dtype``): with voxel or volume demeaning and the noise estimated, the windows run in
float32 first (gather, Gram, LAPACK's reduction and eigenvalues, projection; the threshold and a filter's
weights in float64), 1.2-1.3x faster than float64 on the defaults' windows. A window whose rank float32's
error could change (``SETTLE_SLACK``), or with a filter whose kept and dropped eigenvalues float32 cannot
separate (``estimators.unresolved_projectors``), is redone in float64 (``fit_windows``), so ranks are
float64's. Without demeaning (dwidenoise's mode) the patch's mean would drown the noise eigenvalues in
float32's rounding, and everything runs in float64.
"""

from __future__ import annotations

import ast
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
import mmap
import multiprocessing
from multiprocessing import shared_memory
import os
from pathlib import Path
import signal
import sys
import threading
import time
import warnings

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from . import lapack
from .backend import PatchSums, available_cpus
from .errors import MPPCAWarning
from .estimators import (aggregation_weights, component_weights, given_noise_threshold,
                         marchenko_pastur_edge, marchenko_pastur_threshold, unresolved_projectors)
from .layout import is_volume_major, padded_series, rows_of_planes

#: Memory one batch may use for its patch matrices (float64), per process. Small enough that NumPy's
#: temporaries come back from the allocator's heap instead of fresh pages from the kernel (48 MB batches took
#: 200,000 page faults and 10% more time on one worker; docs/benchmarks.md, "The CPU engine on a node").
BATCH_BYTES = 12 * 2**20

#: How far (in float32 roundings of the largest eigenvalue) LAPACK's float32 eigenvalues may be from the true
#: ones before a window's rank counts as unsettled and is redone in float64. On five phantoms' windows the
#: errors were a median of 0.8-1.2 roundings; at 2, 4.9% of the windows are redone (the four estimators) and
#: none whose rank differs from float64's is missed (docs/benchmarks.md, "The CPU's float32 first pass").
SETTLE_SLACK = 2.0

#: When true, ``denoise_cpu`` times each phase of the work in the workers and the parent and reports it in
#: ``info["profile"]`` (``PhaseClock``); when false the phases are not timed.
PROFILE = False


class PhaseClock:
    """Seconds spent in each phase, summed over calls: ``lap(phase)`` charges the time since the previous lap
    to ``phase``. ``NO_CLOCK`` stands in when nothing is timed: its ``lap`` does nothing."""

    def __init__(self):
        self.seconds = {}
        self.last = time.perf_counter()

    def lap(self, phase):
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (now - self.last)
        self.last = now


class _Stopped:
    def lap(self, phase):
        pass


NO_CLOCK = _Stopped()


@dataclass
class Unit:
    """Windows ``start:stop`` of the plan; they all have their corner on x-plane ``x0``. ``turns[i]``: how many
    units before this one add into x-plane ``x0 + i`` (its place in that plane's order of additions)."""

    start: int
    stop: int
    x0: int
    turns: np.ndarray


def work_units(plan) -> list[Unit]:
    """Split the plan's windows (sorted by corner x) into one unit per corner x-plane, in order."""
    cx = plan.window_corner[:, 0]
    bounds = np.flatnonzero(np.diff(cx)) + 1
    starts = np.concatenate([[0], bounds]).astype(int)
    stops = np.concatenate([bounds, [len(cx)]]).astype(int)
    added = np.zeros(plan.spatial_shape[0], dtype=np.int64)  # units so far that add into each x-plane
    units = []
    for a, b in zip(starts, stops):
        if b > a:
            x0 = int(cx[a])
            planes = slice(x0, x0 + plan.extent[0])
            units.append(Unit(int(a), int(b), x0, added[planes].copy()))
            added[planes] += 1
    return units


def batch_size(n_voxels: int, n_volumes: int) -> int:
    """Windows per batch: patch matrix, Gram, its tridiagonal form, eigenvectors, projector and reconstruction
    within BATCH_BYTES."""
    m = min(n_voxels, n_volumes)
    per_window = 8 * (3 * n_voxels * n_volumes + 4 * m * m)
    return int(max(1, min(4096, BATCH_BYTES // per_window)))


@dataclass
class WindowFit:
    """MP-PCA of a batch of windows: what the aggregation needs.

    ``patches`` (B, n, T) float64, centred when demeaning (``means``: (B, n, 1) per voxel or (B, 1, T) per
    volume, else None); ``eigenvectors`` (B, m, m) of the Gram on the smaller side (``time_side``: m = T,
    else m = n), ascending, of which only each window's ``rank`` leading ones (its last columns) are
    computed (``lapack.leading_eigenvectors``; the others are 0); ``rank`` and ``sigma2`` (B,); ``voxels``
    (B, n) flat indices and ``took_part`` (B, n) (finite voxels); ``weights`` (B, m): each component's weight
    (``estimators.component_weights``), or None for the ``hard`` filter (the ``rank`` leading ones whole);
    ``lambda_plus`` (B,): each window's Marchenko-Pastur upper edge when the options ask for it, else None.
    """

    patches: np.ndarray
    means: np.ndarray | None
    eigenvectors: np.ndarray
    time_side: bool
    rank: np.ndarray
    sigma2: np.ndarray
    voxels: np.ndarray
    took_part: np.ndarray
    weights: np.ndarray | None = None
    lambda_plus: np.ndarray | None = None

    def signal_components(self, windows=slice(None)):
        """(B, m) weight of each component in each window's reconstruction: ``weights``, else the mask of its
        ``rank`` leading eigenvectors."""
        if self.weights is not None:
            return self.weights[windows]
        m = self.eigenvectors.shape[-1]
        return np.arange(m)[None, :] >= (m - self.rank[windows])[:, None]

    def reconstruct(self):
        """X_hat = ((X V_P) diag(w)) V_P^T (time side) or U_P (diag(w) (U_P^T X)) (voxel side), plus the means:
        (B, n, T); w = 1 for ``hard``.

        V_P: the batch's largest rank of leading eigenvectors, which are 0 beyond each window's own rank, so
        that the two thin products give each window its projection (an m x m projector V_P V_P^T would cost
        m / P times as much to form and to apply)."""
        m = self.eigenvectors.shape[-1]
        kept = int(self.rank.max(initial=0))
        leading = self.eigenvectors[:, :, m - kept:]  # (B, m, P)
        coefficients = np.matmul(self.patches, leading) if self.time_side else np.matmul(
            leading.transpose(0, 2, 1), self.patches)
        if self.weights is not None:  # scaled on the P components' side: (B, n, P) or (B, P, T)
            w = self.weights[:, m - kept:]
            coefficients *= w[:, None, :] if self.time_side else w[:, :, None]
        if self.time_side:
            restored = np.matmul(coefficients, leading.transpose(0, 2, 1))
        else:
            restored = np.matmul(leading, coefficients)
        if self.means is not None:
            restored += self.means
        return restored

    def reconstruct_rows(self, window, position):
        """Row ``position`` of window ``window``'s X_hat, for arrays of pairs: (V, T). Cheaper than
        ``reconstruct`` when only each patch's centre row is wanted."""
        vectors = self.eigenvectors[window]
        keep = self.signal_components(window)
        if self.time_side:  # x V_P diag(w) V_P^T: coefficients on the kept components, then back
            row = self.patches[window, position]
            coefficients = np.matmul(row[:, None, :], vectors)[:, 0] * keep
            restored = np.matmul(vectors, coefficients[:, :, None])[:, :, 0]
        else:  # (U_P diag(w) U_P^T)[c] X
            own = vectors[np.arange(len(window)), position] * keep
            mixing = np.matmul(vectors, own[:, :, None])[:, :, 0]
            restored = np.matmul(mixing[:, None, :], self.patches[window])[:, 0]
        if self.means is not None:
            restored += np.broadcast_to(self.means, self.patches.shape)[window, position]
        return restored


@dataclass
class WindowSpectra:
    """The eigenvalues of a batch of windows and what the threshold made of them: ``forms`` (``lapack``, the
    eigenvalues and what ``leading_eigenvectors`` continues from), ``rank`` and ``sigma2`` (B,), and the
    centred ``patches``, ``means``, ``time_side``, ``voxels``, ``took_part``, ``weights`` and ``lambda_plus``
    as in ``WindowFit``."""

    patches: np.ndarray
    means: np.ndarray | None
    forms: lapack.TridiagonalForms
    time_side: bool
    rank: np.ndarray
    sigma2: np.ndarray
    voxels: np.ndarray
    took_part: np.ndarray
    weights: np.ndarray | None = None
    lambda_plus: np.ndarray | None = None
    unsettled: np.ndarray | None = None


def first_pass_dtype(options):
    """float32 where the patches are demeaned and the rank's settling test exists
    (``estimators.marchenko_pastur_threshold``'s uncertainty: every estimator and filter, the noise
    estimated); float64 elsewhere."""
    if options.demean in ("voxel", "volume") and not options.noise_given:
        return np.float32
    return np.float64


def fit_windows(volume, finite, plan, options, windows, clock=NO_CLOCK, dtype=np.float64) -> WindowFit:
    """Gather the windows ``windows`` (a slice or sorted indices) of the plan from the volume and run MP-PCA on
    each: Gram matrix, all its eigenvalues, the threshold (``window_spectra``), then the kept eigenvectors
    (``lapack``). ``clock`` is charged with each step (``PhaseClock``). In ``dtype`` float32, the windows
    float32 cannot settle are fitted again in float64 (``take_exact``)."""
    spectra = window_spectra(volume, finite, plan, options, windows, clock, dtype)
    eigenvectors = lapack.leading_eigenvectors(spectra.forms, spectra.rank)
    clock.lap("eigenvectors")
    fit = WindowFit(spectra.patches, spectra.means, eigenvectors, spectra.time_side, spectra.rank,
                    spectra.sigma2, spectra.voxels, spectra.took_part, spectra.weights, spectra.lambda_plus)
    if spectra.unsettled is not None and spectra.unsettled.any():
        exact = fit_windows(volume, finite, plan, options, _numbers(windows)[spectra.unsettled])
        take_exact(fit, spectra.unsettled, exact)
        fit.eigenvectors[spectra.unsettled] = exact.eigenvectors
        clock.lap("float64 redo")
    return fit


def settled_spectra(volume, finite, plan, options, windows, clock=NO_CLOCK, dtype=np.float64) -> WindowSpectra:
    """``window_spectra`` in ``dtype``, with the windows float32 cannot settle thresholded again in float64
    (``take_exact``): the ranks and noise levels ``fit_windows`` gives."""
    spectra = window_spectra(volume, finite, plan, options, windows, clock, dtype)
    if spectra.unsettled is not None and spectra.unsettled.any():
        exact = window_spectra(volume, finite, plan, options, _numbers(windows)[spectra.unsettled])
        take_exact(spectra, spectra.unsettled, exact)
        clock.lap("float64 redo")
    return spectra


def take_exact(windows, where, exact):
    """Put the float64 rank, noise level, lambda_+ and filter weights of ``exact`` (a ``WindowFit`` or
    ``WindowSpectra`` of the windows at ``where``, (B,) bool) in place of ``windows``' own."""
    windows.rank[where] = exact.rank
    windows.sigma2[where] = exact.sigma2
    if windows.lambda_plus is not None:
        windows.lambda_plus[where] = exact.lambda_plus
    if windows.weights is not None:
        windows.weights[where] = exact.weights


def _numbers(windows):
    """The plan's window numbers of ``windows`` (a slice or sorted indices) as an array."""
    return np.arange(windows.start, windows.stop) if isinstance(windows, slice) else np.asarray(windows)


def window_spectra(volume, finite, plan, options, windows, clock=NO_CLOCK, dtype=np.float64) -> WindowSpectra:
    """Gather the windows ``windows`` (a slice or sorted indices) of the plan from the volume and threshold
    each: Gram matrix, all its eigenvalues (``lapack``), the Marchenko-Pastur rank and noise (or the given
    noise's rank), and for a filter other than ``hard`` each component's weight, the rank then being the number
    of weights above 0. No eigenvector is computed. In ``dtype`` float32 (``first_pass_dtype``'s cases) the
    result's ``unsettled`` marks the windows float32 cannot settle."""
    base = plan.window_base(windows)
    voxels = base[:, None] + plan.voxel_offsets[None, :]
    patches = volume[voxels].astype(dtype, copy=False)  # (B, n, T); left-out voxels are rows of zeros
    took_part = finite[voxels]
    n_voxels = took_part.sum(axis=1)
    n_volumes = patches.shape[2]
    clock.lap("gather")
    means = None
    if options.demean == "voxel":  # each voxel's mean over time: one degree of freedom less along time
        means = patches.mean(axis=2, keepdims=True, dtype=np.float64).astype(dtype, copy=False)
        patches -= means
        n_volumes -= 1
    elif options.demean == "volume":  # the patch's mean time course: one less along the voxels
        means = (patches.sum(axis=1, keepdims=True, dtype=np.float64)
                 / np.maximum(n_voxels, 1)[:, None, None]).astype(dtype, copy=False)
        if took_part.all():
            patches -= means
        else:
            patches -= means * took_part[:, :, None]  # left-out voxels stay rows of zeros
        n_voxels = n_voxels - 1
    clock.lap("demean")
    time_side = plan.patch_size >= patches.shape[2]
    if time_side:
        gram = np.matmul(patches.transpose(0, 2, 1), patches)
    else:
        gram = np.matmul(patches, patches.transpose(0, 2, 1))
    clock.lap("Gram")
    forms = lapack.eigenvalues(gram)
    clock.lap("eigenvalues")
    values = forms.eigenvalues.astype(np.float64, copy=False)
    unsettled = uncertainty = None
    if options.noise_given:
        sigma2 = given_noise_variance(options.noise_variance, voxels, took_part)
        rank = given_noise_threshold(values, n_voxels, n_volumes, sigma2)
    elif dtype == np.float32:
        uncertainty = SETTLE_SLACK * np.finfo(np.float32).eps * np.maximum(values[:, -1], 0.0)
        rank, sigma2, unsettled = marchenko_pastur_threshold(values, n_voxels, n_volumes, options.estimator,
                                                             uncertainty)
    else:
        rank, sigma2 = marchenko_pastur_threshold(values, n_voxels, n_volumes, options.estimator)
    lambda_plus = None
    if options.lambda_plus:  # the edge the threshold placed, at its own P (before a filter recounts the rank)
        lambda_plus = marchenko_pastur_edge(sigma2, rank, n_voxels, n_volumes,
                                            None if options.noise_given else options.estimator)
    weights = None
    if options.filter != "hard" and uncertainty is None:  # the noise level as known: the weights decide
        weights = component_weights(values, n_voxels, n_volumes, sigma2, options.filter)
        rank = np.count_nonzero(weights, axis=1).astype(np.int64)
    elif options.filter != "hard":  # in float32 as the GPU settles: the filter's cut, and its projector
        weights, near_cut = component_weights(values, n_voxels, n_volumes, sigma2, options.filter, uncertainty)
        rank = np.count_nonzero(weights, axis=1).astype(np.int64)
        unsettled |= near_cut | unresolved_projectors(values, rank, np.maximum(values[:, -1], 0.0))
    clock.lap("threshold")
    return WindowSpectra(patches, means, forms, time_side, rank, sigma2, voxels, took_part, weights, lambda_plus,
                         unsettled)


def given_noise_variance(noise_variance, voxels, took_part) -> np.ndarray:
    """Each window's given sigma^2: the number, or the mean of the map's sigma^2 over the window's voxels that
    took part and have a value (the map is 0 where a voxel outside the mask had none). Every window that runs
    holds a finite voxel of the mask, which has one."""
    if np.ndim(noise_variance) == 0:
        return np.full(len(voxels), float(noise_variance))
    values = noise_variance[voxels]  # (B, n)
    counted = took_part & (values > 0)
    return np.where(counted, values, 0.0).sum(axis=1) / np.maximum(counted.sum(axis=1), 1)


class PlaneTurns:
    """The order in which units add into each x-plane of the sums: unit order, whichever process runs them.

    ``added`` (X,) int64, shared by the processes: how many units have added into each plane. A unit adds into
    plane ``x0 + i`` once ``added[x0 + i] == turns[i]``, so every plane's float32 sum is the same additions
    in the same order for any number of processes, with no reduction left to the parent. Units start in
    unit order, so the units a plane waits for are running or done: no deadlock. ``condition`` (a
    multiprocessing or threading Condition) guards ``added`` and orders the writes to the sums before it.
    """

    def __init__(self, added, condition):
        self.added, self.condition = added, condition

    def ready(self, unit: Unit, pending: list[int]) -> list[int]:
        """Those of the unit's planes ``pending`` (offsets from ``x0``) whose turn it is; waits for one."""
        with self.condition:
            while True:
                ready = [i for i in pending if self.added[unit.x0 + i] == unit.turns[i]]
                if ready:
                    return ready
                self.condition.wait()

    def done(self, unit: Unit, planes: list[int]):
        with self.condition:
            self.added[[unit.x0 + i for i in planes]] += 1
            self.condition.notify_all()


def run_unit(volume, finite, plan, options, unit: Unit, sums: PatchSums, turns: PlaneTurns, clock=NO_CLOCK):
    """Denoise one unit and add its contribution into ``sums`` (flat (V, T) and (V,) arrays).

    ``center``: each voxel takes the row of its own window, which lies in one unit: written, no order needed.
    Else the unit's windows add into a slab of its ``extent[0]`` x-planes, in plan order, and the slab is
    added into the sums plane by plane in the planes' turns (``PlaneTurns``)."""
    step = batch_size(plan.patch_size, volume.shape[1])
    dtype = first_pass_dtype(options)
    clock.lap("setup")
    if options.aggregation == "center":
        for start in range(unit.start, unit.stop, step):
            stop = min(start + step, unit.stop)
            a, b = np.searchsorted(plan.centre_window, [start, stop])
            fit = fit_windows(volume, finite, plan, options, slice(start, stop), clock, dtype)
            window = plan.centre_window[a:b] - start
            rows = fit.reconstruct_rows(window, plan.centre_position[a:b])
            clock.lap("reconstruction")
            voxel = plan.centre_voxel[a:b]
            sums.image[voxel] = rows
            sums.weight[voxel] = 1.0
            sums.sigma[voxel] = np.sqrt(fit.sigma2[window])
            sums.rank[voxel] = fit.rank[window]
            if sums.lambda_plus is not None:
                sums.lambda_plus[voxel] = fit.lambda_plus[window]
            clock.lap("accumulation")
        return

    with slab_turns(unit, plan, turns) as pending:
        _add_slab(volume, finite, plan, options, unit, sums, turns, clock, step, pending, dtype)


@contextmanager
def slab_turns(unit, plan, turns):
    """Within: ``pending``, the unit's x-planes (offsets from ``x0``) it has still to add into (``deposit``
    removes them). On the way out, after an error, the unit's remaining turns are passed in order (adding
    nothing): the units after it must not wait for ever, and the run fails with the error."""
    pending = list(range(plan.extent[0]))
    try:
        yield pending
    finally:
        while pending:
            ready = turns.ready(unit, pending)
            turns.done(unit, ready)
            pending[:] = [i for i in pending if i not in ready]


def _add_slab(volume, finite, plan, options, unit, sums, turns, clock, step, pending, dtype):
    """``run_unit``'s weighted and uniform aggregation; removes from ``pending`` each plane it has added into."""
    n_volumes = volume.shape[1]
    plane = plan.spatial_shape[1] * plan.spatial_shape[2]
    slab_start = unit.x0 * plane
    slab_voxels = plan.extent[0] * plane
    image = np.zeros((slab_voxels, n_volumes), dtype=np.float32)
    ex, ey, ez = plan.extent
    slab = image.reshape(ex, *plan.spatial_shape[1:], n_volumes)
    weight = np.zeros(slab_voxels)
    sigma = np.zeros(slab_voxels)
    rank = np.zeros(slab_voxels)
    maps = (weight, sigma, rank) + ((np.zeros(slab_voxels),) if sums.lambda_plus is not None else ())
    for start in range(unit.start, unit.stop, step):
        stop = min(start + step, unit.stop)
        fit = fit_windows(volume, finite, plan, options, slice(start, stop), clock, dtype)
        restored = fit.reconstruct()
        voxel_weight = window_voxel_weights(fit, options, plan, slice(start, stop))
        restored *= voxel_weight[:, :, None]
        if plan.sphere:  # a sphere's rows in its bounding cube, zeros elsewhere
            cube = np.zeros((len(restored), ex * ey * ez, n_volumes), dtype=restored.dtype)
            cube[:, plan.patch_in_window] = restored
            restored = cube
        clock.lap("reconstruction")
        # each window adds its block into the slab: one slice per window, windows in plan order
        block = (ex, ey, ez, n_volumes)
        for b, (_, y0, z0) in enumerate(plan.window_corner[start:stop]):
            slab[:, y0:y0 + ey, z0:z0 + ez] += restored[b].reshape(block)
        add_window_maps(maps, fit, voxel_weight, slab_start)
        clock.lap("accumulation")

    deposit(unit, plan, sums, (image,) + maps, turns, clock, pending)


def window_voxel_weights(windows, options, plan, numbers):
    """(B, n): each voxel's weight in the aggregation of the plan's windows ``numbers`` (a slice or indices;
    ``windows`` their ``WindowFit`` or ``WindowSpectra``): the window's aggregation weight times its
    multiplicity, times the voxel's own factor (``PatchPlan.voxel_weights``); voxels left out get none."""
    w = aggregation_weights(windows.rank, options.mean_parameters, options.aggregation) * plan.multiplicity[numbers]
    voxel_weight = w[:, None] * windows.took_part
    scale = plan.voxel_weights(options.aggregation)
    return voxel_weight if scale is None else voxel_weight * scale


def add_window_maps(maps, windows, voxel_weight, slab_start):
    """Add the windows' weighted sums of weight, noise (sigma) and rank, and of lambda_+ when ``maps`` has a
    fourth, into a slab's ``maps`` (flat arrays over the slab's voxels, from row ``slab_start``)."""
    weight, sigma, rank, *lambda_plus = maps
    flat = (windows.voxels - slab_start).ravel()
    weight += np.bincount(flat, voxel_weight.ravel(), len(weight))
    sigma += np.bincount(flat, (voxel_weight * np.sqrt(windows.sigma2)[:, None]).ravel(), len(sigma))
    rank += np.bincount(flat, (voxel_weight * windows.rank[:, None]).ravel(), len(rank))
    for edge in lambda_plus:
        edge += np.bincount(flat, (voxel_weight * windows.lambda_plus[:, None]).ravel(), len(edge))


def deposit(unit, plan, sums, slab, turns, clock, pending):
    """Add a unit's ``slab`` sums ((image, weight, sigma, rank[, lambda_plus]) over its ``extent[0]`` x-planes;
    image None for the noise map alone) into ``sums``, plane by plane in the planes' turns; removes each plane
    from ``pending`` once added."""
    plane = plan.spatial_shape[1] * plan.spatial_shape[2]
    slab_start = unit.x0 * plane
    while pending:
        ready = turns.ready(unit, pending)
        clock.lap("turn wait")
        for i in ready:
            into = slice(slab_start + i * plane, slab_start + (i + 1) * plane)
            mine = slice(i * plane, (i + 1) * plane)
            for total, part in zip((sums.image, sums.weight, sums.sigma, sums.rank, sums.lambda_plus), slab):
                if part is not None:
                    total[into] += part[mine]
        turns.done(unit, ready)
        pending[:] = [i for i in pending if i not in ready]
        clock.lap("deposit")


# -- worker processes ------------------------------------------------------------------------------------

_WORKER = {}


def process_threads() -> dict:
    """This process's id, its number of threads (the names of those Python knows), and the thread pools
    threadpoolctl finds in it with their sizes (BLAS and OpenMP should each hold one thread in a worker)."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux
        threads = None
    pools = [dict(api=pool["user_api"], library=pool["internal_api"], threads=pool["num_threads"])
             for pool in threadpool_info()]
    return dict(pid=os.getpid(), threads=threads, python_threads=[t.name for t in threading.enumerate()],
                threadpools=pools)


def timed_unit(run, unit_index, *args):
    """``run(*args, clock)`` with a ``PhaseClock``; returns its result and the unit's report: index, process,
    start and end (``time.perf_counter``, the same clock in every process on one machine), the process's CPU
    seconds in it (less than its span when the process waited or others took its CPU) and seconds per phase."""
    clock = PhaseClock()
    started, cpu = clock.last, time.process_time()
    result = run(*args, clock)
    return result, dict(unit=unit_index, pid=os.getpid(), start=started, stop=time.perf_counter(),
                        cpu=time.process_time() - cpu, seconds=clock.seconds)


def _one_thread():
    """Limit BLAS/OpenMP (NumPy's and SciPy's LAPACK) to one thread; returns an undo."""
    return threadpool_limits(limits=1).restore_original_limits


def _attach(work, volume_name, volume_shape, finite_name, plan, options, outputs, turns, profile):
    """Worker initializer: map the shared input and the shared sums, limit BLAS to one thread. Ctrl-C is the
    parent's to handle: workers ignore SIGINT, so an interrupt prints one message, not a traceback per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    volume_shm = shared_memory.SharedMemory(name=volume_name)
    finite_shm = shared_memory.SharedMemory(name=finite_name)
    _WORKER.update(
        volume=np.ndarray(volume_shape, dtype=np.float32, buffer=volume_shm.buf),
        finite=np.ndarray(volume_shape[:1], dtype=bool, buffer=finite_shm.buf),
        plan=plan, options=options, handles=(volume_shm, finite_shm), profile=profile, work=work,
        sums=_patch_sums([None if output is None else _shared_view(*output) for output in outputs]),
        turns=PlaneTurns(_shared_view(*turns[0]), turns[1]),
    )
    _one_thread()
    if profile:
        _WORKER.update(ready=time.perf_counter(), process=process_threads())


def _run_unit_in_worker(numbered):
    """Run one unit in a worker; returns its profile report, or None when not profiling."""
    index, unit = numbered
    w = _WORKER
    args = (w["volume"], w["finite"], w["plan"], w["options"], unit, w["sums"], w["turns"])
    if not w["profile"]:
        w["work"](*args)
        return None
    _, report = timed_unit(w["work"], index, *args)
    return dict(report, ready=w["ready"], process=w["process"])


def _shared_zeros(shape, dtype, context):
    """Zeros in memory that ``context``'s workers share, as (buffer, dtype, shape) for ``_shared_view``: an
    anonymous shared mapping, which forked workers inherit (its pages are zero until written, by whichever
    process touches them first), else a ``RawArray``, handed to forkserver workers as a file descriptor."""
    nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
    if context.get_start_method() == "fork":
        buffer = mmap.mmap(-1, nbytes)
    else:
        buffer = context.RawArray("b", nbytes)
    return buffer, np.dtype(dtype).str, tuple(shape)


def _shared_view(buffer, dtype, shape):
    return np.frombuffer(buffer, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


def _shared_memory(nbytes):
    return shared_memory.SharedMemory(create=True, size=max(nbytes, 1))


def _shared_copy(array):
    shm = _shared_memory(array.nbytes)
    np.ndarray(array.shape, dtype=array.dtype, buffer=shm.buf)[...] = array
    return shm


def _voxel_major(data, allocate):
    """The series as (V, T) rows, the order the workers gather patches from: ``data``'s own rows where it is
    voxel-major and ``allocate`` is ``np.empty`` (no copy), else copied into ``allocate(shape, dtype)`` (from a
    volume-major series in blocks, ``layout.rows_of_planes``: never a whole-array transpose)."""
    shape = (int(np.prod(data.shape[:3])), data.shape[3])
    if allocate is np.empty and not is_volume_major(data):
        return data.reshape(shape)
    return rows_of_planes(data, slice(None), allocate(shape, np.float32))


def _process_context(nprocs: int):
    """How to start ``nprocs`` workers, or None to run in this process.

    fork where it is safe (Linux, no CUDA context in this process): fast, and it does not re-import the
    caller's script. Else forkserver, whose workers import the main module again: a script that called
    ``denoise`` from its top level, outside an ``if __name__ == "__main__":`` block, would call it again in
    each worker, which multiprocessing refuses there, and the pool would break (BrokenProcessPool). Such a
    call runs in this process, with a warning (``_rerun_by_workers``).
    """
    if nprocs == 1:
        return None
    torch = sys.modules.get("torch")
    cuda_live = torch is not None and torch.cuda.is_initialized()
    if sys.platform.startswith("linux") and not cuda_live:
        return multiprocessing.get_context("fork")
    script = _rerun_by_workers()
    if script is not None:
        why = "with a CUDA context live in this process," if cuda_live else "on this system,"
        warnings.warn(f"denoise() runs in 1 process instead of {nprocs}: {why} worker processes cannot be "
                      f"forked and would run {script} again, which calls denoise() outside an 'if __name__ == "
                      f"\"__main__\":' block; put the call inside one to use {nprocs}", MPPCAWarning, stacklevel=4)
        return None
    return multiprocessing.get_context("forkserver")


def _rerun_by_workers() -> str | None:
    """The main script (or module), when this call comes from its top-level code outside an
    ``if __name__ == "__main__":`` block (workers started by spawn or forkserver import it again and would
    make the call again); else None (the guarded block, an interactive session, ``python -c``)."""
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) is None:  # nothing a worker would import again
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:  # called after the main module's top level ran (from a thread, a callback...)
        return None
    filename, line = frame.f_code.co_filename, frame.f_lineno
    try:
        tree = ast.parse(Path(filename).read_text(), filename)
    except (OSError, SyntaxError, ValueError):  # source unreadable: a worker's import might run the call
        return filename
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _tests_main_name(node.test) and node.body[0].lineno <= line <= (
                node.body[-1].end_lineno):
            return None
    return filename


def _tests_main_name(test) -> bool:
    """Whether an ``if`` test is ``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return ({type(side) for side in sides} == {ast.Name, ast.Constant}
            and {getattr(side, "id", None) for side in sides} >= {"__name__"}
            and {getattr(side, "value", None) for side in sides} >= {"__main__"})


def denoise_cpu(data, finite, plan, options, *, nprocs=None, progress=None):
    """Run the plan on the CPU and return the per-voxel sums (``engine.PatchSums``). With ``PROFILE`` set,
    ``info["profile"]`` says where the time went (``profile_summary``)."""
    sums = run_units(run_unit, data, finite, plan, options, nprocs=nprocs, progress=progress)
    sums.info.update(eigensolver="LAPACK sytrd/sterf/stein", gram_precision=np.dtype(first_pass_dtype(options)).name)
    return sums


def run_units(work, data, finite, plan, options, *, nprocs=None, progress=None, image=True) -> PatchSums:
    """Run ``work(volume, finite_flat, plan, options, unit, sums, turns, clock)`` (a module-level function:
    ``run_unit``, or the noise map's ``noise.noise_unit``) for every unit of the plan, in this process or in
    worker processes that share the input and the sums, and return the sums (``image`` False: no image, None).
    Each unit adds into the sums itself, plane by plane in unit order (``PlaneTurns``)."""
    started = time.perf_counter()
    profile = PROFILE
    clock = PhaseClock() if profile else NO_CLOCK
    data, finite = padded_series(data, finite, plan.padding)  # (spheres: the plan's grid is padded)
    n_voxels = int(np.prod(data.shape[:3]))
    n_volumes = data.shape[3]
    finite_flat = finite.reshape(n_voxels)
    units = work_units(plan)
    nprocs = min(nprocs or available_cpus(), max(len(units), 1))
    context = _process_context(nprocs)
    if context is None:
        nprocs = 1
    # image, weight, sigma, rank, and lambda_+ when asked for
    output_shapes = ([((n_voxels, n_volumes), np.float32) if image else None]
                     + [((n_voxels,), np.float64)] * (4 if options.lambda_plus else 3))
    reports = []
    clock.lap("setup")

    if nprocs == 1:
        volume = _voxel_major(data, np.empty)
        sums = _patch_sums([None if shape is None else np.zeros(*shape) for shape in output_shapes])
        turns = PlaneTurns(np.zeros(plan.spatial_shape[0], dtype=np.int64), threading.Condition())
        undo = _one_thread()
        process = process_threads() if profile else None
        clock.lap("outputs")
        try:
            for done, unit in enumerate(units, 1):
                args = (volume, finite_flat, plan, options, unit, sums, turns)
                if profile:
                    _, report = timed_unit(work, done - 1, *args)
                    reports.append(dict(report, ready=started, process=process))
                    clock.last = report["stop"]
                else:
                    work(*args)
                if progress:
                    progress(done, len(units))
        finally:
            undo()
    else:
        outputs = [None if shape is None else _shared_zeros(*shape, context) for shape in output_shapes]
        added = _shared_zeros((plan.spatial_shape[0],), np.int64, context)
        sums = _patch_sums([None if output is None else _shared_view(*output) for output in outputs])
        clock.lap("outputs")
        volume_shm, finite_shm = None, _shared_copy(finite_flat)
        try:
            volume_shm = _shared_memory(n_voxels * n_volumes * 4)
            _voxel_major(data, lambda shape, dtype: np.ndarray(shape, dtype, buffer=volume_shm.buf))
            clock.lap("shared copy")
            with ProcessPoolExecutor(nprocs, mp_context=context, initializer=_attach,
                                     initargs=(work, volume_shm.name, (n_voxels, n_volumes),
                                               finite_shm.name, plan, options, outputs,
                                               (added, context.Condition()), profile)) as pool:
                finished = pool.map(_run_unit_in_worker, enumerate(units))
                clock.lap("pool start")
                for done, report in enumerate(finished, 1):
                    if profile:
                        reports.append(report)
                    if progress:
                        progress(done, len(units))
                clock.lap("waiting")
        finally:
            for shm in (volume_shm, finite_shm):
                if shm is not None:
                    shm.close()
                    shm.unlink()
            clock.lap("pool stop")

    sums = sums.cropped(plan.spatial_shape, plan.padding)
    seconds = time.perf_counter() - started
    sums.info = dict(backend="cpu", device="cpu", nprocs=nprocs, seconds_engine=seconds)
    if profile:
        sums.info["profile"] = profile_summary(reports, clock.seconds, started, seconds, len(units))
    return sums


def _patch_sums(arrays) -> PatchSums:
    """The ``PatchSums`` of ``run_units``'s outputs: image, weight, sigma, rank and, if there, lambda_plus."""
    image, weight, sigma, rank, *lambda_plus = arrays
    return PatchSums(image, weight, sigma, rank, lambda_plus=lambda_plus[0] if lambda_plus else None)


def profile_summary(reports, parent_seconds, started, wall, n_units) -> dict:
    """``info["profile"]``: ``wall`` (the engine's seconds), ``n_units``, ``parent`` (seconds per phase of the
    calling process: setup, outputs (allocating the sums), shared copy (of the input), pool start, waiting
    (for the workers), pool stop), ``workers`` (per process: its ``units``, seconds per ``phases`` summed over
    them, ``busy`` (in units), ``cpu`` (its CPU seconds in units), ``span`` (its first unit's start to its
    last unit's end), ``ready`` (seconds from the start to its start-up done), ``threads``,
    ``python_threads`` and ``threadpools`` (``process_threads``)), and ``units`` (index, pid, start and end
    in seconds from the start)."""
    workers = {}
    for report in reports:
        worker = workers.setdefault(report["pid"], dict(
            pid=report["pid"], units=0, phases={}, busy=0.0, first=report["start"], last=report["stop"],
            ready=report["ready"] - started, threads=report["process"]["threads"],
            python_threads=report["process"]["python_threads"], threadpools=report["process"]["threadpools"]))
        worker["units"] += 1
        worker["busy"] += report["stop"] - report["start"]
        worker["cpu"] = worker.get("cpu", 0.0) + report["cpu"]
        worker["first"] = min(worker["first"], report["start"])
        worker["last"] = max(worker["last"], report["stop"])
        for phase, value in report["seconds"].items():
            worker["phases"][phase] = worker["phases"].get(phase, 0.0) + value
    for worker in workers.values():
        worker["span"] = worker.pop("last") - worker.pop("first")
    units = [dict(unit=r["unit"], pid=r["pid"], start=r["start"] - started, stop=r["stop"] - started)
             for r in reports]
    return dict(wall=wall, n_units=n_units, parent=dict(parent_seconds), workers=list(workers.values()),
                units=units)
