"""The caller's series on the device: staged through page-locked memory by a few threads, in rounds.

An asynchronous host-to-device copy needs page-locked host memory, and the caller's series is pageable (a
pageable copy runs at ~8 GB/s on the H200's host: 10.5 ms for the seed's 81 MB). Page-locking the series in
place (``cudaHostRegister``) would take ~2.3 ms for the 81 MB and unlocking it ~1.5 ms, and while either runs
every other CUDA call of the process waits; the unlocking also waits for the device to be idle. A host copy
instead scales with threads (15.6 / 7.4 / 4.7 / 3.1 / 2.2 ms for the 81 MB on 1 / 2 / 4 / 8 / 16).

A series that is on the device already (a step before the engine left it there: ``denoise`` takes a torch
tensor) is not staged: ``DeviceSeries`` copies its rows on the device, with ``StagedSeries``' interface.

``StagedSeries`` copies the rows into page-locked staging memory (torch's caching host allocator, reused
from run to run) on ``stage_threads()`` threads in ``STAGE_ROUNDS`` rounds, and the uploader thread queues
each round's copy to the device as soon as it is staged, while the next round is copied and the first pass
runs on the windows whose rows are there (``boxsums.BoxSums.gram_in_parts``). Nothing the driver serialises
runs beside the caller's set-up, and nothing is left to undo after the run. A helper thread that needs the
GIL while the caller's thread runs Python waits up to the interpreter's switch interval (5 ms by default):
``switching_often`` shortens it during a run.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
import sys
import threading
import time

import numpy as np
import torch

from ..backend import available_cpus
from ..layout import is_volume_major, rows_of_planes


#: Threads that copy the caller's series into page-locked staging memory (``StagedSeries``): at most this
#: many, and no more than the process may run on. More leave the caller's thread too few cores to set the
#: run up (the seed's problem: 13.0-13.6 ms end to end with 8, 13.8-15.4 with 16).
STAGE_THREADS = 8
#: Rounds the staging runs in, of equal shares of the rows: each round's copy to the device is queued as soon
#: as it is staged, and runs while the next round is copied (and the box sums' first pass runs on the windows
#: whose rows are there). With the first pass replayed as CUDA graphs the device, not the host, is the limit;
#: 3 rounds keep each part of the first pass large.
STAGE_ROUNDS = 3
#: The interpreter's thread switch interval (seconds) while a run's helper threads work
#: (``switching_often``). At Python's default of 5 ms, a helper that needs the GIL while the caller's
#: thread runs Python waits up to 5 ms each time.
SWITCH_INTERVAL = 2e-5

_uploader = None
_copiers = (None, 0)  # the copying threads' pool and its size
_uploader_lock = threading.Lock()
_switching = dict(depth=0, saved=None)


@contextmanager
def switching_often():
    """Within: the interpreter hands the GIL to a waiting thread every ``SWITCH_INTERVAL`` seconds (if that
    is shorter than what is set); restored after the last of overlapping uses."""
    with _uploader_lock:
        if _switching["depth"] == 0:
            _switching["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_switching["saved"], SWITCH_INTERVAL))
        _switching["depth"] += 1
    try:
        yield
    finally:
        with _uploader_lock:
            _switching["depth"] -= 1
            if _switching["depth"] == 0:
                sys.setswitchinterval(_switching["saved"])


def _thread() -> ThreadPoolExecutor:
    global _uploader
    with _uploader_lock:
        if _uploader is None:
            _uploader = ThreadPoolExecutor(1, thread_name_prefix="mppca-upload")
        return _uploader


def stage_threads() -> int:
    """``STAGE_THREADS``, at most the CPUs this process may use."""
    return max(1, min(STAGE_THREADS, available_cpus()))


def _copy_threads() -> ThreadPoolExecutor:
    global _copiers
    with _uploader_lock:
        pool, size = _copiers
        if pool is None or size != stage_threads():  # (the CPUs this process may use can change)
            if pool is not None:
                pool.shutdown(wait=False)
            _copiers = ThreadPoolExecutor(stage_threads(), thread_name_prefix="mppca-stage"), stage_threads()
        return _copiers[0]


def to_device(array, device) -> torch.Tensor:
    """A small host array (a table of the plan's) on ``device``, copied without waiting: through page-locked
    memory (torch's cached host allocator), asynchronously. A copy from pageable memory instead waits for
    everything queued on its stream."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    device = torch.device(device)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class Upload:
    """Rows of the series on their way to the device, in parts (``queued``: futures of the event after each
    part's copy; ``stops``: where each part ends, in elements from the first row): ``arrivals(stream)``
    makes ``stream`` wait for each part in turn as its copy is queued and yields the whole rows there so
    far; ``wait(stream)`` waits for all and returns the device tensor. A thread's error is raised there."""

    def __init__(self, queued, stops, tensor):
        self._queued, self._stops, self.tensor = list(queued), list(stops), tensor

    def row_stops(self) -> list[int]:
        """The whole rows there after each part still to arrive (what ``arrivals`` will yield)."""
        return [int(stop) // self.tensor.shape[1] for stop in self._stops]

    def arrivals(self, stream):
        while self._queued:
            stream.wait_event(self._queued.pop(0).result())
            yield int(self._stops.pop(0)) // self.tensor.shape[1]
        self.tensor.record_stream(stream)

    def wait(self, stream) -> torch.Tensor:
        for _ in self.arrivals(stream):
            pass
        return self.tensor

    @property
    def queued(self) -> list:
        """The futures of the parts' copies still to arrive (each gives the event after its copy)."""
        return list(self._queued)


class _Countdown:
    """Set once ``count`` parts are done (``done()``), or at the first part's error (``failed(error)``);
    ``wait()`` raises that error."""

    def __init__(self, count):
        self.left, self.error, self.lock, self.event = count, None, threading.Lock(), threading.Event()

    def done(self):
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.event.set()

    def failed(self, error):
        self.error = error
        self.event.set()

    def wait(self):
        self.event.wait()
        if self.error is not None:
            raise self.error


def round_bounds(n_elements) -> np.ndarray:
    """Where the ``STAGE_ROUNDS`` equal rounds of an upload of ``n_elements`` begin and end (in elements)."""
    return np.linspace(0, n_elements, max(1, STAGE_ROUNDS) + 1).astype(np.int64)


def _upload_target(shape, device, into=None) -> torch.Tensor:
    """The (rows, T) float32 tensor an upload of ``shape`` writes: ``into``, checked, else a new one on
    ``device`` (allocated on the caller's current stream)."""
    tensor = torch.empty(shape, dtype=torch.float32, device=device) if into is None else into
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError(f"an upload goes into a contiguous {tuple(shape)} float32 tensor")
    return tensor


class StagedSeries:
    """The caller's contiguous (X, Y, Z, T) float32 series, uploaded by ranges of whole x-planes' rows
    (``upload``) through page-locked staging memory (torch's caching host allocator: reused from call to
    call), as (rows, T) on the device. The rows go up in ``STAGE_ROUNDS`` consecutive rounds: in each,
    ``stage_threads()`` threads copy a part of the round with NumPy (no CUDA call, so nothing the driver
    serialises; one GIL hand-over per thread and round), and the uploader thread queues the round's copy to
    the device as soon as its parts are staged, while the next round is copied. A volume-major series (as
    nibabel reads a file) is reordered into rows by this staging copy (``layout.rows_of_planes``, in blocks;
    its rounds are whole x-planes and each thread copies some z-planes of them): no other copy of it is made.
    Nothing of the caller's memory is locked, so nothing is left to undo; the staging memory goes back to
    torch's cache of page-locked memory once its copies are done, and stays there for the next run (as much
    as the largest slab's series, rounded up to a power of two)."""

    def __init__(self, series: np.ndarray):
        self.series, self.n_volumes = series, series.shape[3]
        self.plane = series.shape[1] * series.shape[2]
        self.volume_major = is_volume_major(series)
        self.flat = None if self.volume_major else series.reshape(-1)
        self.queued_at = {}  # round -> perf_counter() when its copy was queued (for a run's timeline)
        self.staged_at = {}  # round -> when the uploader thread found it staged
        self.started_at = None  # when the first copying thread started

    def upload(self, rows: slice, device, stream, into=None) -> Upload:
        """Start staging and copying rows ``rows`` to ``device`` on ``stream``, into the (rows, T) float32
        tensor ``into`` if given (else one allocated on the caller's current stream)."""
        shape = (rows.stop - rows.start, self.n_volumes)
        tensor = _upload_target(shape, device, into)
        tensor.record_stream(stream)  # written there: its memory is not reused before the copies are done
        first, stop = rows.start * self.n_volumes, rows.stop * self.n_volumes
        staging = torch.empty(stop - first, dtype=torch.float32, pin_memory=True)
        staged, flat_out = staging.numpy(), tensor.reshape(-1)
        threads = stage_threads()
        if self.volume_major:  # rounds of whole x-planes, each thread some z-planes of each
            first_plane = rows.start // self.plane
            plane_bounds = np.unique(round_bounds(rows.stop // self.plane - first_plane))
            rounds = plane_bounds * self.plane * self.n_volumes
            z_bounds = np.linspace(0, self.series.shape[2], threads + 1).astype(int)
        else:
            rounds = round_bounds(stop - first)
        staged_rounds = [_Countdown(threads) for _ in rounds[1:]]

        def copy_part(thread, a, b):
            if self.volume_major:
                planes = slice(first_plane + (a // (self.plane * self.n_volumes)),
                               first_plane + (b // (self.plane * self.n_volumes)))
                rows_of_planes(self.series, planes, staged[a:b],
                               z_planes=slice(z_bounds[thread], z_bounds[thread + 1]))
            else:
                low, high = a + (b - a) * thread // threads, a + (b - a) * (thread + 1) // threads
                np.copyto(staged[low:high], self.flat[first + low:first + high])

        def copy_parts(thread):
            """(On a copying thread) this thread's part of every round, in order."""
            if self.started_at is None:
                self.started_at = time.perf_counter()
            for number, (a, b) in enumerate(zip(rounds[:-1], rounds[1:])):
                try:
                    copy_part(thread, a, b)
                except BaseException as error:  # noqa: BLE001 - handed to the waiting uploader thread
                    staged_rounds[number].failed(error)
                    return
                staged_rounds[number].done()

        def queue(number):
            """(On the uploader thread) the round's copy to the device, once it is staged."""
            staged_rounds[number].wait()
            self.staged_at[number] = time.perf_counter()
            a, b = int(rounds[number]), int(rounds[number + 1])
            with torch.cuda.stream(stream):
                flat_out[a:b].copy_(staging[a:b], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            self.queued_at[number] = time.perf_counter()
            return copied

        for thread in range(threads):
            _copy_threads().submit(copy_parts, thread)
        return Upload([_thread().submit(queue, number) for number in range(len(staged_rounds))], rounds[1:], tensor)


def series_layout(series: torch.Tensor) -> str:
    """"C" for a contiguous (X, Y, Z, T) tensor (voxel after voxel), "F" for a volume-major one (volume after
    volume: the layout of a NumPy series in Fortran order); ValueError for any other."""
    if series.is_contiguous():
        return "C"
    if series.permute(3, 2, 1, 0).is_contiguous():
        return "F"
    raise ValueError("a series on the device must be contiguous, voxel after voxel or volume after volume")


def empty_series(shape, layout: str, device) -> torch.Tensor:
    """An uninitialised float32 (X, Y, Z, T) tensor on ``device`` in ``layout`` ("C" or "F": ``series_layout``)."""
    if layout == "F":
        return torch.empty(tuple(shape)[::-1], dtype=torch.float32, device=device).permute(3, 2, 1, 0)
    return torch.empty(tuple(shape), dtype=torch.float32, device=device)


def padded_on_device(series: torch.Tensor, padding: int) -> torch.Tensor:
    """``layout.padded_series``' series for a tensor: zeros ``padding`` voxels deep around the three spatial
    axes, in the series' own layout, on its device."""
    if not padding:
        return series
    shape = tuple(s + 2 * padding for s in series.shape[:3]) + tuple(series.shape[3:])
    padded = empty_series(shape, series_layout(series), series.device).zero_()
    padded[padding:-padding, padding:-padding, padding:-padding] = series
    return padded


class DeviceSeries:
    """A float32 (X, Y, Z, T) series that is on the device already (``series_layout``: either order), with
    ``StagedSeries``' interface: ``upload`` copies whole x-planes' rows into a (rows, T) tensor on the device,
    on its ``stream`` after the work queued on the current stream before this object was made (a step that
    wrote the series)."""

    def __init__(self, series: torch.Tensor):
        series_layout(series)  # (checked)
        self.series, self.n_volumes = series, series.shape[3]
        self.plane = series.shape[1] * series.shape[2]
        self.queued_at, self.staged_at, self.started_at = {}, {}, None  # (nothing staged: no timeline notes)
        self.written = None
        if series.is_cuda:
            self.written = torch.cuda.Event()
            self.written.record(torch.cuda.current_stream(series.device))

    def rows(self, rows: slice, into: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (whole x-planes) copied into ``into`` (rows, T), on the current stream."""
        planes = self.series[rows.start // self.plane:rows.stop // self.plane]
        into.view(planes.shape).copy_(planes)
        return into

    def upload(self, rows: slice, device, stream, into=None) -> Upload:
        shape = (rows.stop - rows.start, self.n_volumes)
        tensor = _upload_target(shape, device, into)
        stream.wait_event(self.written)
        for written in (tensor, self.series):
            written.record_stream(stream)  # neither's memory is reused before the copy is done
        with torch.cuda.stream(stream):
            self.rows(rows, tensor)
            copied = torch.cuda.Event()
            copied.record(stream)
        done = Future()
        done.set_result(copied)
        return Upload([done], [shape[0] * shape[1]], tensor)
