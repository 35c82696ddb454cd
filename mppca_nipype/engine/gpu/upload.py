"""The caller's series on the device: page-locked in place piece by piece, on a thread of this module's own.

An asynchronous host-to-device copy needs page-locked host memory, and the caller's series is pageable (a
pageable copy ran at ~8 GB/s on the H200's host: 10.5 ms for the seed's 81 MB). Measured there (seventh
session, suite part h): page-locking the series in place costs ~0.27 ms per 10 MB piece and unlocking the
81 MB ~1.5 ms; the upload locked in 8 pieces, each piece's copy queued as soon as it is locked, is done
~2.5 ms after it starts. Staging through page-locked buffers instead (8 threads copying 4 MB chunks with
NumPy, no locking) took 4.9 ms: that host's copies ran at 17 GB/s, below its page-locking.

``PageLockedSeries`` locks the pieces and queues their copies on the uploader thread, so that the caller's
thread sets its run up meanwhile and waits (``Upload.wait``) only before it queues work that reads the
rows. One thread: locking 8 pieces on 1/2/4/8 threads at once took 2.27/2.93/3.23/3.42 ms (the driver
serialises it; part h). ``release`` queues the unlocking on the same thread, after the copies are done, and
returns at once: ``cudaHostUnregister`` waits until the device is idle (sixth session's timeline), and once
the run is over its ~1.5 ms need not hold up the caller's result. The task keeps a reference to the series
until it is unlocked; the thread takes its tasks in order, so a later series is locked after it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import threading

import numpy as np
import torch

#: Pieces the caller's series is page-locked in, each just before its rows are copied.
PIN_PIECES = 8
#: Page size for the pieces' bounds (a page-locked range must not share a page with another).
PAGE_BYTES = 4096

_uploader = None
_uploader_lock = threading.Lock()


def _thread() -> ThreadPoolExecutor:
    global _uploader
    with _uploader_lock:
        if _uploader is None:
            _uploader = ThreadPoolExecutor(1, thread_name_prefix="mppca-upload")
        return _uploader


def _pin(address, nbytes) -> bool:
    """Page-lock host memory in place (``cudaHostRegister``); True if that worked."""
    try:
        code = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        return int(getattr(code, "value", code)) == 0
    except Exception:  # noqa: BLE001 - pageable copies still work, only slower
        return False


def to_device(array, device) -> torch.Tensor:
    """A small host array (a table of the plan's) on ``device``, copied without waiting: through page-locked
    memory (torch's cached host allocator), asynchronously. A copy from pageable memory instead waits for
    everything queued on its stream."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    device = torch.device(device)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def piece_bounds(series: np.ndarray, pieces: int = PIN_PIECES) -> list[int]:
    """Element bounds of the pieces of the C-contiguous ``series`` (flattened): inner bounds on page
    boundaries, so that no two pieces share a page; one piece if the series is not aligned to its items."""
    start, size, bounds = series.ctypes.data, series.itemsize, [0]
    if start % size == 0:
        for k in range(1, pieces):
            aligned = -(-(start + series.nbytes * k // pieces) // PAGE_BYTES) * PAGE_BYTES
            element = (aligned - start) // size
            if bounds[-1] < element < series.size:
                bounds.append(element)
    return bounds + [series.size]


class Upload:
    """Rows of the series on their way to the device: ``wait(stream)`` returns the device tensor once every
    piece's copy is queued, and makes ``stream`` wait for those copies (not for later ones on the upload's
    stream); it raises a thread's error."""

    def __init__(self, queued, tensor):
        self._queued, self.tensor = queued, tensor

    def wait(self, stream) -> torch.Tensor:
        for piece in self._queued:
            stream.wait_event(piece.result())
        self.tensor.record_stream(stream)
        return self.tensor


class PageLockedSeries:
    """The caller's contiguous (V, T) float32 series, uploaded by row ranges (``upload``) from its own
    memory, page-locked piece by piece (``piece_bounds``) on the uploader thread; ``release()`` unlocks it
    there once the copies are done. Pieces that cannot be locked (an unaligned series, or the driver
    refuses) are copied from pageable memory, each waiting for its stream."""

    def __init__(self, series: np.ndarray):
        self.series, self.flat, self.n_volumes = series, series.reshape(-1), series.shape[1]
        self.bounds = piece_bounds(series)
        self.locked = [None] * (len(self.bounds) - 1)  # per piece: None (not tried yet), True, False (failed)
        self._copied = []  # an event after each piece's copy

    def upload(self, rows: slice, device, stream) -> Upload:
        """Start copying rows ``rows`` to ``device`` on ``stream`` (the tensor is allocated on the caller's
        current stream)."""
        tensor = torch.empty((rows.stop - rows.start, self.n_volumes), dtype=torch.float32, device=device)
        first, stop = rows.start * self.n_volumes, rows.stop * self.n_volumes
        pieces = [piece for piece in range(len(self.locked))
                  if max(first, self.bounds[piece]) < min(stop, self.bounds[piece + 1])]
        return Upload([_thread().submit(self._copy, piece, first, stop, tensor.reshape(-1), stream)
                       for piece in pieces], tensor)

    def _copy(self, piece, first, stop, flat_out, stream):
        """(On the uploader thread) lock ``piece`` if it is not yet, and queue the copy of its part of the
        rows ``first:stop`` (flat elements); returns the event after the copy."""
        low, high = max(first, self.bounds[piece]), min(stop, self.bounds[piece + 1])
        if self.locked[piece] is None:
            part = self.flat[self.bounds[piece]:self.bounds[piece + 1]]
            self.locked[piece] = _pin(part.ctypes.data, part.nbytes)
        with torch.cuda.stream(stream):
            flat_out[low - first:high - first].copy_(torch.from_numpy(self.flat[low:high]),
                                                     non_blocking=self.locked[piece])
            copied = torch.cuda.Event()
            copied.record(stream)
        self._copied.append(copied)
        return copied

    def release(self):
        """Queue the unlocking of the locked pieces, after every copy queued so far (returns a future)."""
        return _thread().submit(self._unlock)

    def _unlock(self):
        for copied in self._copied:
            copied.synchronize()
        for piece, locked in enumerate(self.locked):
            if locked:
                torch.cuda.cudart().cudaHostUnregister(self.flat[self.bounds[piece]:].ctypes.data)
                self.locked[piece] = None
