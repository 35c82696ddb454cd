"""The CPU backend: NumPy/OpenBLAS and LAPACK, batched over patches, spread over worker processes.

Work is cut into *units*: consecutive rows of active windows whose corner lies on one x position, about
``UNIT_WINDOWS`` windows each, handed to the workers in unit order (``work_units``, ``UnitCounter``). A unit
runs its windows in stacked batches (batched gather, batched Gram, every eigenvalue and the kept
eigenvectors only (``lapack``), projection onto those) into a private slab of the ``extent[0]`` x-planes and
the y rows it touches, which is then added into the sums, which all processes share, one (x, y) row of z
voxels at a time in that row's turn (``RowTurns``): every row takes its units' slabs in unit order, so the
result does not depend on how many processes ran the units (it is bit-identical for any ``nprocs``) and
nothing is left for the parent to add. A worker whose slab's turn has not come keeps it and runs its next
unit, adding it when its turn comes (``KeptSlabs``): it waits only when its slabs would outgrow one whole
x-plane slab's memory (``KEPT_PLANES``), or at its end.

Workers share the input volume through ``multiprocessing.shared_memory`` (one copy, whatever their
number, in the (V, T) rows they gather patches from: a volume-major series is reordered into it in blocks,
``layout``) and each limits its BLAS to one thread: on matrices of 48 x 48, one thread per process is faster
than a multithreaded BLAS fighting over the same cores. ``PROFILE`` times every phase (``PhaseClock``).

Precision (``first_pass_dtype``): with voxel or volume demeaning, the hard threshold and the noise
estimated, the windows run in float32 first (gather, Gram, LAPACK's reduction and eigenvalues,
projection; the threshold in float64), 1.2-1.3x faster than float64 on the defaults' windows. A window
whose rank float32's error could change (``SETTLE_SLACK``) is redone in float64 (``fit_windows``), so ranks
are float64's. Without demeaning (dwidenoise's mode) the patch's mean would drown the noise eigenvalues in
float32's rounding, and everything runs in float64.
"""

from __future__ import annotations

import ast
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
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
                         marchenko_pastur_edge, marchenko_pastur_threshold)
from .layout import is_volume_major, rows_of_planes
from .patches import flat_offsets

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


#: Windows per unit, about: each corner x-plane's windows are cut, between corner-y rows, into units of about
#: this many, so that there are enough units to keep every worker busy to the end (the defaults' 18,259
#: windows make 310 units, 19 per worker at 16), while the y halo each unit's slab carries (``extent[1] -
#: stride`` rows) keeps the slabs' zeroing and adding small: on the defaults the slabs cover 1.4 times the
#: rows that one unit per x-plane would.
UNIT_WINDOWS = 64

#: A worker's slabs, the finished ones it keeps while their turns have not come (``KeptSlabs``) and its next
#: unit's, cover at most this many times Y rows in all: at 1, the memory of one slab of whole x-planes
#: (``extent[0]`` by Y rows), which the memory model counts per worker (``workflows.node_resources``). On the
#: defaults a worker keeps up to 80 rows (5 or 6 slabs of 13 or 16) before it waits.
KEPT_PLANES = 1


@dataclass
class Unit:
    """Windows ``start:stop`` of the plan: consecutive corner-y rows of windows whose corner lies on x-plane
    ``x0``. Its slab covers x-planes ``x0 .. x0 + extent[0] - 1`` and y rows ``y0 .. y0 + rows - 1`` (every
    row its windows touch). ``turns`` (extent[0], rows): how many units before this one add into each (x, y)
    row of the slab (its place in that row's order of additions)."""

    start: int
    stop: int
    x0: int
    y0: int
    rows: int
    turns: np.ndarray

    @property
    def region(self):
        """The (x, y) rows of the sums the unit's slab covers, as slices."""
        return slice(self.x0, self.x0 + self.turns.shape[0]), slice(self.y0, self.y0 + self.rows)


def work_units(plan) -> list[Unit]:
    """Split the plan's windows (sorted by corner x, then y, then z) into units, in order: each corner x-plane's
    windows cut between corner-y rows into ``ceil(windows / UNIT_WINDOWS)`` units of about as many windows
    each. The units depend on the plan alone, never on the number of processes, so every (x, y) row of the
    sums takes the same additions in the same order (unit order) however many run them."""
    corner = plan.window_corner
    ex, ey, _ = plan.extent
    key = corner[:, 0] * plan.spatial_shape[1] + corner[:, 1]  # one value per corner (x, y) row of windows
    row_start = np.flatnonzero(np.diff(key, prepend=-1))
    row_stop = np.append(row_start[1:], len(key))
    plane_of_row = corner[row_start, 0]
    plane_start = np.flatnonzero(np.diff(plane_of_row, prepend=-1))
    plane_stop = np.append(plane_start[1:], len(row_start))
    added = np.zeros(plan.spatial_shape[:2], dtype=np.int64)  # units so far that add into each (x, y) row
    units = []
    for first, last in zip(plane_start, plane_stop):  # the plane's rows of windows: first .. last - 1
        counts = np.cumsum(row_stop[first:last] - row_start[first:last])
        parts = -(-int(counts[-1]) // UNIT_WINDOWS)
        # cut after the row whose running count of windows is nearest to each k / parts of the plane's
        targets = counts[-1] * np.arange(1, parts) / parts
        cuts = np.abs(counts[:, None] - targets[None, :]).argmin(axis=0) + 1
        bounds = np.unique(np.concatenate([[0], cuts, [last - first]]))
        for a, b in zip(bounds[:-1], bounds[1:]):
            start, stop = int(row_start[first + a]), int(row_stop[first + b - 1])
            x0, y0 = int(corner[start, 0]), int(corner[start, 1])
            rows = int(corner[row_start[first + b - 1], 1]) + ey - y0
            covered = added[x0:x0 + ex, y0:y0 + rows]
            units.append(Unit(start, stop, x0, y0, rows, covered.copy()))
            covered += 1
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
    (``estimators.marchenko_pastur_threshold``'s uncertainty: every estimator, the hard threshold, the
    noise estimated); float64 elsewhere."""
    if options.demean in ("voxel", "volume") and options.filter == "hard" and not options.noise_given:
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
    """Put the float64 rank, noise level and lambda_+ of ``exact`` (a ``WindowFit`` or ``WindowSpectra`` of
    the windows at ``where``, (B,) bool) in place of ``windows``' own."""
    windows.rank[where] = exact.rank
    windows.sigma2[where] = exact.sigma2
    if windows.lambda_plus is not None:
        windows.lambda_plus[where] = exact.lambda_plus


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
    unsettled = None
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
    if options.filter != "hard":  # the noise level as known: the filter's weights decide what is kept
        weights = component_weights(values, n_voxels, n_volumes, sigma2, options.filter)
        rank = np.count_nonzero(weights, axis=1).astype(np.int64)
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


class RowTurns:
    """The order in which units add into each (x, y) row of the sums: unit order, whichever process runs them.

    ``added`` (X, Y) int64, shared by the processes: how many units have added into each row. A unit adds
    into row (x, y) once ``added[x, y]`` equals its turn there, so every row's float32 sums are the same
    additions in the same order for any number of processes, with no reduction left to the parent.
    ``condition`` (a multiprocessing or threading Condition) guards ``added`` and orders the writes to the
    sums before it."""

    def __init__(self, added, condition):
        self.added, self.condition = added, condition

    def ready(self, unit: Unit, pending: np.ndarray, wait=False) -> np.ndarray:
        """Those of the unit's ``pending`` rows ((extent[0], rows) bool) whose turn it is; with ``wait``, waits
        until there is one."""
        with self.condition:
            while True:
                ready = pending & (self.added[unit.region] == unit.turns)
                if not wait or ready.any():
                    return ready
                self.condition.wait()

    def done(self, unit: Unit, rows: np.ndarray):
        """The unit has added into its ``rows`` ((extent[0], rows) bool): their next unit's turn."""
        with self.condition:
            region = self.added[unit.region]
            region[rows] += 1
            self.condition.notify_all()


class UnitCounter:
    """Hands the units out in unit order to whichever process asks (``take``) and counts those run
    (``finish``, read by the caller for its progress). ``counts`` (2,) int64, shared: the next unit's number
    and the number run; ``lock`` guards it. ``stop`` hands nothing more out (after an error)."""

    def __init__(self, counts, lock, n_units):
        self.counts, self.lock, self.n_units = counts, lock, n_units

    def take(self) -> int | None:
        with self.lock:
            index = int(self.counts[0])
            if index >= self.n_units:
                return None
            self.counts[0] = index + 1
            return index

    def finish(self) -> int:
        with self.lock:
            self.counts[1] += 1
            return int(self.counts[1])

    def stop(self):
        with self.lock:
            self.counts[0] = self.n_units

    @property
    def finished(self) -> int:
        return int(self.counts[1])


class KeptSlabs:
    """A process's finished slabs (``run_unit``'s: image, weight, sigma, rank[, lambda_plus] over its unit's
    rows, image None for the noise map alone) that have rows left to add into the sums, in unit order, each
    with those rows ((extent[0], rows) bool).

    A slab whose turn has not come is kept, and the process runs its next unit instead of waiting; ``settle``
    adds every row whose turn has come, and waits only while the kept slabs outgrow their room. No deadlock:
    units are handed out in unit order (``UnitCounter``), so every unit before one that is kept has been
    taken by a running process, and of all the units with rows left to add, the earliest has its turn in
    every row (the units before it in those rows have added). Its process adds it at its next ``settle``, or
    at once if waiting, since a waiting process waits for its earliest slab, which is that one. So the
    earliest always gets added, then the next, and so on."""

    def __init__(self, plan, sums, turns):
        self.plan, self.sums, self.turns = plan, sums, turns
        self.kept = []  # [unit, slab, rows left to add]

    def keep(self, unit: Unit, slab):
        self.kept.append([unit, slab, np.ones(unit.turns.shape, dtype=bool)])

    @property
    def rows(self) -> int:
        """The y rows the kept slabs cover, in all."""
        return sum(entry[0].rows for entry in self.kept)

    def settle(self, clock, room: int):
        """Add the rows whose turn has come of every kept slab, in unit order (the newest kept one's as
        ``deposit``, older ones' as ``deposit, deferred``); then, while the kept slabs cover more than
        ``room`` y rows, wait for the earliest one's turns and add it."""
        newest = self.kept[-1][0] if self.kept else None
        for entry in list(self.kept):
            self._add_ready(entry, clock, wait=False, phase="deposit" if entry[0] is newest else
                            "deposit, deferred")
        while self.rows > room:
            self._add_ready(self.kept[0], clock, wait=True, phase="deposit, deferred")

    def release(self, failed: Unit | None):
        """After an error: pass every kept slab's remaining turns, then ``failed``'s (the unit that raised,
        after every kept one), adding nothing, so that the units after them do not wait for ever."""
        for entry in self.kept:
            entry[1] = None
        if failed is not None:
            self.keep(failed, None)
        self.settle(NO_CLOCK, 0)

    def _add_ready(self, entry, clock, wait, phase):
        unit, slab, pending = entry
        ready = self.turns.ready(unit, pending, wait)
        clock.lap("turn wait")
        if ready.any():
            if slab is not None:
                add_rows(unit, self.plan, self.sums, slab, ready)
            self.turns.done(unit, ready)
            pending &= ~ready
            clock.lap(phase)
        if not pending.any():
            self.kept.remove(entry)


def add_rows(unit, plan, sums, slab, rows):
    """Add a unit's ``slab`` sums (image, weight, sigma, rank[, lambda_plus] over its rows; image None for
    the noise map alone) at ``rows`` ((extent[0], rows) bool) into ``sums``: one slice per run of rows."""
    _, ny, nz = plan.spatial_shape
    for i in np.flatnonzero(rows.any(axis=1)):
        edges = np.flatnonzero(np.diff(rows[i].astype(np.int8), prepend=0, append=0))
        for a, b in zip(edges[::2], edges[1::2]):  # rows a .. b - 1 of x-plane x0 + i
            first = ((unit.x0 + i) * ny + unit.y0) * nz
            into = slice(first + a * nz, first + b * nz)
            mine = slice((i * unit.rows + a) * nz, (i * unit.rows + b) * nz)
            for total, part in zip((sums.image, sums.weight, sums.sigma, sums.rank, sums.lambda_plus), slab):
                if part is not None:
                    total[into] += part[mine]


def run_unit(volume, finite, plan, options, unit: Unit, sums: PatchSums, clock=NO_CLOCK):
    """Denoise one unit: its slab (``unit_slab``), to be added into ``sums`` (flat (V, T) and (V,) arrays) in
    its rows' turns (``KeptSlabs``); or None for ``center``, which writes into ``sums`` itself: each voxel
    takes the row of its own window, which lies in one unit, so no order is needed."""
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
        return None

    n_volumes = volume.shape[1]
    slab = unit_slab(unit, plan, n_volumes, image=True, lambda_plus=sums.lambda_plus is not None)
    image, *maps = slab
    ex, ey, ez = plan.extent
    block_of_rows = image.reshape(ex, unit.rows, plan.spatial_shape[2], n_volumes)
    for start in range(unit.start, unit.stop, step):
        stop = min(start + step, unit.stop)
        fit = fit_windows(volume, finite, plan, options, slice(start, stop), clock, dtype)
        restored = fit.reconstruct()
        voxel_weight = window_voxel_weights(fit, options, plan, start, stop)
        restored *= voxel_weight[:, :, None]
        clock.lap("reconstruction")
        # each window adds its block into the slab: one slice per window, windows in plan order
        block = (ex, ey, ez, n_volumes)
        for b, (_, y0, z0) in enumerate(plan.window_corner[start:stop]):
            block_of_rows[:, y0 - unit.y0:y0 - unit.y0 + ey, z0:z0 + ez] += restored[b].reshape(block)
        add_window_maps(maps, fit, voxel_weight, slab_voxels(plan, unit, slice(start, stop)))
        clock.lap("accumulation")
    return slab


def unit_slab(unit, plan, n_volumes, image, lambda_plus):
    """Zeros for a unit's sums over its rows (``extent[0]`` x-planes by ``unit.rows`` y rows, every z):
    image ((voxels, T) float32, or None), weight, sigma, rank and, with ``lambda_plus``, lambda_+."""
    voxels = plan.extent[0] * unit.rows * plan.spatial_shape[2]
    return ((np.zeros((voxels, n_volumes), dtype=np.float32) if image else None, np.zeros(voxels),
             np.zeros(voxels), np.zeros(voxels)) + ((np.zeros(voxels),) if lambda_plus else ()))


def slab_voxels(plan, unit, windows) -> np.ndarray:
    """(B, n): the voxels of the plan's windows ``windows`` (a slice of the unit's) as rows of the unit's
    slab."""
    cx, cy, cz = plan.window_corner[windows].T
    nz = plan.spatial_shape[2]
    base = ((cx - unit.x0) * unit.rows + (cy - unit.y0)) * nz + cz
    return base[:, None] + flat_offsets(plan.extent, (0, unit.rows, nz))[None, :]


def window_voxel_weights(windows, options, plan, start, stop):
    """(B, n): each voxel's weight in the aggregation of windows ``start:stop`` (``WindowFit`` or
    ``WindowSpectra``): the window's aggregation weight times its multiplicity; voxels left out get none."""
    w = aggregation_weights(windows.rank, options.mean_parameters, options.aggregation) * plan.multiplicity[start:stop]
    return w[:, None] * windows.took_part


def add_window_maps(maps, windows, voxel_weight, voxels):
    """Add the windows' weighted sums of weight, noise (sigma) and rank, and of lambda_+ when ``maps`` has a
    fourth, into a slab's ``maps`` (flat arrays over the slab's voxels; ``voxels`` (B, n) the windows'
    voxels there, ``slab_voxels``)."""
    weight, sigma, rank, *lambda_plus = maps
    flat = voxels.ravel()
    weight += np.bincount(flat, voxel_weight.ravel(), len(weight))
    sigma += np.bincount(flat, (voxel_weight * np.sqrt(windows.sigma2)[:, None]).ravel(), len(sigma))
    rank += np.bincount(flat, (voxel_weight * windows.rank[:, None]).ravel(), len(rank))
    for edge in lambda_plus:
        edge += np.bincount(flat, (voxel_weight * windows.lambda_plus[:, None]).ravel(), len(edge))


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


def run_in_turn(work, units, counter, volume, finite, plan, options, sums, turns, profile=None,
                progress=None) -> list[dict]:
    """Run the units ``counter`` hands out (in unit order) until none is left, in this process.

    ``work(volume, finite, plan, options, unit, sums, clock)`` gives each unit's slab, added into ``sums`` in
    its rows' turns (``KeptSlabs``): one whose turn has not come is kept while the next unit runs, as long as
    the kept slabs and the largest unit's cover ``KEPT_PLANES`` times Y rows at most, and the last unit waits
    until every kept one is added. ``center`` writes into the sums in ``work`` and takes no turns. An error
    stops the handing out and passes the turns this process holds (``KeptSlabs.release``) before it
    propagates. ``profile`` (what every report carries, or None) asks for a
    report per unit: its index, process, start and end (``time.perf_counter``, one clock for every process
    on a machine), its CPU seconds (less than its span when the process waited or others took its CPU) and
    seconds per phase (``PhaseClock``), the kept slabs added after it included. ``progress(done, total)``
    after each unit."""
    ordered = options.aggregation != "center"
    kept = KeptSlabs(plan, sums, turns)
    room = KEPT_PLANES * plan.spatial_shape[1] - max((unit.rows for unit in units), default=0)
    reports = []
    index = counter.take()
    while index is not None:
        unit = units[index]
        started, cpu = time.perf_counter(), time.process_time()
        clock = PhaseClock() if profile is not None else NO_CLOCK
        try:
            slab = work(volume, finite, plan, options, unit, sums, clock)
            if ordered:
                kept.keep(unit, slab)
            unit = None  # its turns are the kept slab's now
            kept.settle(clock, room)
            following = counter.take()
            if following is None:
                kept.settle(clock, 0)
        except BaseException:
            counter.stop()
            kept.release(unit if ordered else None)
            raise
        done = counter.finish()
        if profile is not None:
            reports.append(dict(profile, unit=index, pid=os.getpid(), start=started, stop=time.perf_counter(),
                                cpu=time.process_time() - cpu, seconds=clock.seconds))
        if progress:
            progress(done, len(units))
        index = following
    return reports


def _one_thread():
    """Limit BLAS/OpenMP (NumPy's and SciPy's LAPACK) to one thread; returns an undo."""
    return threadpool_limits(limits=1).restore_original_limits


def _attach(work, units, counter, volume_name, volume_shape, finite_name, plan, options, outputs, turns, profile):
    """Worker initializer: map the shared input, the shared sums, the turns and the unit counter; limit BLAS
    to one thread. Ctrl-C is the parent's to handle: workers ignore SIGINT, so an interrupt prints one
    message, not a traceback per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    volume_shm = shared_memory.SharedMemory(name=volume_name)
    finite_shm = shared_memory.SharedMemory(name=finite_name)
    _WORKER.update(
        volume=np.ndarray(volume_shape, dtype=np.float32, buffer=volume_shm.buf),
        finite=np.ndarray(volume_shape[:1], dtype=bool, buffer=finite_shm.buf),
        plan=plan, options=options, handles=(volume_shm, finite_shm), profile=None, work=work, units=units,
        counter=UnitCounter(_shared_view(*counter[0]), counter[1], len(units)),
        sums=_patch_sums([None if output is None else _shared_view(*output) for output in outputs]),
        turns=RowTurns(_shared_view(*turns[0]), turns[1]),
    )
    _one_thread()
    if profile:
        _WORKER.update(profile=dict(ready=time.perf_counter(), process=process_threads()))


def _run_in_worker(_):
    """A worker's share of the run (``run_in_turn``): its units' profile reports, or [] when not profiling."""
    w = _WORKER
    return run_in_turn(w["work"], w["units"], w["counter"], w["volume"], w["finite"], w["plan"], w["options"],
                       w["sums"], w["turns"], w["profile"])


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
    """Run ``work(volume, finite_flat, plan, options, unit, sums, clock)`` (a module-level function:
    ``run_unit``, or the noise map's ``noise.noise_unit``) for every unit of the plan, in this process or in
    worker processes that share the input and the sums, and return the sums (``image`` False: no image, None).
    Each process takes the units in unit order and adds their slabs into the sums itself, every (x, y) row
    in unit order (``run_in_turn``)."""
    started = time.perf_counter()
    profile = PROFILE
    clock = PhaseClock() if profile else NO_CLOCK
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
        turns = RowTurns(np.zeros(plan.spatial_shape[:2], dtype=np.int64), threading.Condition())
        counter = UnitCounter(np.zeros(2, dtype=np.int64), threading.Lock(), len(units))
        undo = _one_thread()
        mine = dict(ready=started, process=process_threads()) if profile else None
        clock.lap("outputs")
        try:
            reports = run_in_turn(work, units, counter, volume, finite_flat, plan, options, sums, turns, mine,
                                  progress)
        finally:
            undo()
        if reports:
            clock.last = reports[-1]["stop"]
    else:
        outputs = [None if shape is None else _shared_zeros(*shape, context) for shape in output_shapes]
        added = _shared_zeros(plan.spatial_shape[:2], np.int64, context)
        counts = _shared_zeros((2,), np.int64, context)
        counter = UnitCounter(_shared_view(*counts), context.Lock(), len(units))
        sums = _patch_sums([None if output is None else _shared_view(*output) for output in outputs])
        clock.lap("outputs")
        volume_shm, finite_shm = None, _shared_copy(finite_flat)
        try:
            volume_shm = _shared_memory(n_voxels * n_volumes * 4)
            _voxel_major(data, lambda shape, dtype: np.ndarray(shape, dtype, buffer=volume_shm.buf))
            clock.lap("shared copy")
            with ProcessPoolExecutor(nprocs, mp_context=context, initializer=_attach,
                                     initargs=(work, units, (counts, counter.lock), volume_shm.name,
                                               (n_voxels, n_volumes), finite_shm.name, plan, options, outputs,
                                               (added, context.Condition()), profile)) as pool:
                try:
                    shares = [pool.submit(_run_in_worker, n) for n in range(nprocs)]
                    clock.lap("pool start")
                    _follow(shares, counter, progress)
                    for share in shares:
                        reports.extend(share.result())
                except BaseException:  # an error or an interrupt: the workers end after their current unit
                    counter.stop()
                    raise
                clock.lap("waiting")
        finally:
            for shm in (volume_shm, finite_shm):
                if shm is not None:
                    shm.close()
                    shm.unlink()
            clock.lap("pool stop")

    seconds = time.perf_counter() - started
    sums.info = dict(backend="cpu", device="cpu", nprocs=nprocs, n_units=len(units), seconds_engine=seconds)
    if profile:
        sums.info["profile"] = profile_summary(reports, clock.seconds, started, seconds, len(units))
    return sums


def _follow(shares, counter, progress):
    """Wait for the workers' ``shares`` (futures), reporting ``progress(done, total)`` as their units finish;
    returns at the first error (``result()`` raises it) or when all are done."""
    shown = 0
    while True:
        done, running = wait(shares, timeout=0.05, return_when=FIRST_EXCEPTION)
        finished = counter.finished
        if progress and finished > shown:
            shown = finished
            progress(finished, counter.n_units)
        if not running or any(share.exception() is not None for share in done):
            return


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
