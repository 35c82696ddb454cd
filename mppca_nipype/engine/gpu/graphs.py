"""The box sums' first pass as CUDA graphs, captured on a geometry's second run and replayed from then on.

Queued by the host, each part of the first pass is ~30 torch operations and 6 Triton launches, and the
host's queueing becomes the run's critical path; replayed, it is one launch a part. The graphs are kept
between runs of one geometry (shape, extent, stride, options and settings) in the process: a dataset's runs
mostly share one. ``MPPCA_GPU_GRAPHS=0`` in the environment turns them off (each run then queues its first
pass itself, and keeps no device memory for them between runs). A capture holds the module constants it
was captured with (the settling slacks among them): a geometry's later runs replay them.
"""

from __future__ import annotations

import os
import threading

import torch

from . import boxsums
from .sums import SlabSums
from .upload import Upload

#: Geometries whose first-pass graphs, series on the device and box sums' scratch are kept between runs
#: (each holds the scratch of one slab: ~2 GiB at the seed's size; a dataset's runs mostly share one).
GRAPH_CACHE = 1


def enabled() -> bool:
    """Whether runs may keep and replay their first pass as CUDA graphs (``MPPCA_GPU_GRAPHS``, default on);
    never in a run whose launches only compile (``warmup.compile_ahead``: it is not a geometry's first run)."""
    from .warmup import compiling_only

    return (os.environ.get("MPPCA_GPU_GRAPHS", "1").strip().lower() not in ("0", "false", "no", "off")
            and not compiling_only())


def may_replay(plan, options, finite, n_volumes, settings) -> bool:
    """Whether a run may take the box sums with the settling pass on the device, as the graphs need
    (``pipeline.run_slab`` decides; this keeps other runs from holding a geometry's buffers)."""
    return (enabled() and settings.path in ("auto", "box") and settings.eigensolver in ("auto", "tridiagonal")
            and settings.precision in ("auto", "float32") and settings.settle
            and not options.noise_given  # (a given map is the run's own: a graph would read another run's)
            and not options.lambda_plus  # (its sums are added apart from the captured kernels)
            and boxsums.applies(plan, options, finite, n_volumes, torch.float32, True))


class FirstPassGraphs:
    """The box sums' first pass of one geometry as CUDA graphs, kept between runs.

    A geometry's first run queues its first pass itself (its kernels are built then); the next captures it,
    one graph per part of the series' upload (each part: the Gram sums of the rows there, then the batches
    of the windows they complete, up to the projectors the box holds and the spread of its final planes),
    and each part's finishing (``settling.PartFinishing.capture``: its settling pass, and its final planes'
    reconstruction and division, in a graph pool of their own since they run beside the first pass), and
    replays the graphs; later runs replay them, each part's after the stream waits for its
    rows. What the graphs read and write stays where it was at the capture: the series' rows on the device
    (every run's upload goes there, ``volume_for``), the slab's sums (``sums_for``, zeroed per run) and finite
    flags, the box sums' scratch and the slab's tables (in the kept ``windows``), the verdicts and the
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
        # verdicts, its finishing's graphs)
        self.parts = None
        self.failed = False  # a capture failed: the geometry's runs queue their first pass themselves
        self.windows = self.verdicts = self.step = self.stops = None
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
        """The slab's sums (``sums.SlabSums``) the graphs add into, zeroed (on the current stream)."""
        if self.sums is None or tuple(self.sums.image.shape) != (n_rows, n_volumes):
            self.sums, self.parts = SlabSums(n_rows, n_volumes, device), None
            return self.sums
        return self.sums.zero_()

    def volume_for(self, shape, device):
        if self.volume is None or tuple(self.volume.shape) != tuple(shape):
            self.volume, self.parts = torch.empty(shape, dtype=torch.float32, device=device), None
        return self.volume

    def capture(self, windows, series, finite_rows, step, report, finishing):
        """Capture the slab's first pass (``windows``: set up, with the box sums) and each part's finishing
        (``finishing``: the slab's ``settling.PartFinishing``), and replay them (``replay``); returns the
        verdicts, or None if the capture failed (nothing of it ran; the series has arrived)."""
        run = windows.run
        stream = torch.cuda.current_stream(run.device)
        stops = series.row_stops() if isinstance(series, Upload) else []
        volume = series.wait(stream) if isinstance(series, Upload) else series
        self.stops = stops
        if volume is not self.volume:
            return None
        windows.volume, windows.finite = volume, finite_rows
        consumed = [0]  # arrivals the box sums have taken when a part is complete

        def counted():
            for stop in stops:
                consumed[0] += 1
                yield stop

        parts_of = windows.box.gram_in_parts(volume, counted())
        parts, verdicts, first, pool = [], [], 0, torch.cuda.graph_pool_handle()
        # the finishing's graphs run beside the first pass's: a pool of their own (one graph's freed blocks
        # are another's to reuse only among graphs that run one after the other)
        finishing_pool = torch.cuda.graph_pool_handle()
        divider = finishing.finisher.divider()
        counted_before = len(run.settled_on_device)
        # captured on a stream of its own (nothing runs there) with the graph API itself: ``torch.cuda.graph``
        # would also synchronise and hand torch's cached memory back, so that the next runs allocate anew
        # (measured: the first replay after it took 56 ms)
        capturing_on = torch.cuda.Stream(run.device)
        windows.capturing = True
        try:
            with torch.cuda.stream(capturing_on):
                while first < len(windows.base):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        ready = next(parts_of)
                        windows.box_gram = windows.box.grams
                        part = [windows.batch(slice(a, min(a + step, ready)), run.dtype, run.fused, run.settle,
                                              run.refine) for a in range(first, ready, step)]
                        windows.spread_final_planes(ready)
                    finally:
                        graph.capture_end()
                    # (the part's verdicts, and the event its graph records after them: ``SlabWindows.batch``)
                    finished = finishing.capture(ready, part, finishing_pool, divider)
                    parts.append((graph, consumed[0], ready, windows.verdicts_ready, finished))
                    windows.verdicts_ready = None
                    verdicts += part
                    first = ready
        except Exception:  # noqa: BLE001 - e.g. out of memory while capturing: the run queues it itself
            self.failed = True
            torch.cuda.synchronize(run.device)
            windows.box.planes_spread = 0  # (nothing of it ran)
            del run.settled_on_device[counted_before:]
            finishing.reset()
            return None
        finally:
            windows.capturing = False
        finishing.reset()
        self.parts, self.windows, self.verdicts, self.step = parts, windows, verdicts, step
        self.finite, self.settled_counts = finite_rows, run.settled_on_device[counted_before:]
        return self.replay(volume, report, finishing)  # (the series is there: nothing to wait for)

    def replays(self, series) -> bool:
        """Whether the captured parts can replay on ``series``: uploaded into ``volume`` in the same parts."""
        if isinstance(series, Upload):
            return series.tensor is self.volume and series.row_stops() == self.stops
        return series is self.volume

    def replay(self, series, report, finishing):
        """The captured first pass on this run's series (uploaded into ``volume``): each part's graph once
        the current stream waits for the rows it reads, then the part's finishing's graphs (``finishing``:
        this run's ``settling.PartFinishing``). Returns the verdicts (the graphs' own tensors)."""
        windows = self.windows
        stream = torch.cuda.current_stream(windows.run.device)
        windows.finite = self.finite
        windows.box.planes_spread = windows.box.shape[0]  # (the graphs spread every plane)
        arrivals = series.arrivals(stream) if isinstance(series, Upload) else iter(())
        waited = 0
        for graph, follows, ready, verdicts_ready, finished in self.parts:
            while waited < follows and next(arrivals, None) is not None:
                waited += 1
            graph.replay()
            finishing.replay(ready, finished, verdicts_ready)
            if report:
                report(ready)
        for _ in arrivals:
            pass
        return self.verdicts
