"""The GPU backend's run: the series up to the device, slab by slab through the first pass and the settling
pass, the results down to page-locked host memory. Same contract and same function as ``cpu.denoise_cpu``.

The data walks one way through the modules:

* ``plan``: the run's choices (precision, eigensolver, paths) and the sizes that fit the device.
* ``upload``: the series staged through page-locked memory and copied up in rounds, while the run is set up
  (a series on the device already, a torch tensor, is copied there: its result stays on the device too).
* for each slab (one when everything fits; else slabs along x with the halo's sums carried on):
  ``batch``: batches of windows through Gram (``gram``, ``boxsums``) -> eigenvalues (``tridiagonal``,
  ``cusolver``) -> threshold (``threshold``) -> reconstruction (``reconstruction``, ``boxsums``), with no
  host synchronisation; with the box sums the first pass runs on the windows whose rows have arrived while
  the rest of the series arrives, and from a geometry's second run it is replayed as CUDA graphs (``graphs``);
  ``settling``: the windows float32 could not settle redone in float64 (on the device, beside the first pass,
  where it can; else after one look at the verdicts), what fails again on the CPU;
* ``sums``: the slab's sums divided by their weights on the device and downloaded as rows become final.

Device memory: the slabs and batches are planned inside the run's budget (``plan.DeviceMemory``: one asked
for, ``gpu_memory``, or all the device can give this process). The memory can still run out: another
process takes some meanwhile, or a workspace outgrows the estimate. A batch that runs out is redone at
half the size (``plan.run_in_batches``), down to ``plan.MIN_BATCH`` windows; a run that runs out beyond that
(or while setting a slab up) is redone from the start in slabs of half as many x-planes, down to one;
then the error goes up (``denoise(device="auto")`` then runs on the CPU, with a warning). A batch's retry
is safe because it allocates everything it needs before it adds anything into the sums; a run's retry
starts over with new sums.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
import dataclasses
import time

import numpy as np
import torch

from ..backend import PatchSums
from ..errors import is_out_of_memory
from ..layout import is_volume_major, padded_series, rows_of_planes
from . import boxsums, graphs
from .batch import SlabWindows
from .plan import DeviceMemory, GPURun, GPUSettings, box_fits, plan_slabs, run_in_batches, slab_planes
from .settling import PartFinishing, settle_on_device, settle_on_host
from .sums import Finisher, SlabSums, download_volume_major
from .timeline import Timeline
from .upload import (DeviceSeries, StagedSeries, Upload, empty_series, padded_on_device, series_layout, switching_often,
                     to_device)


def denoise_gpu(data, finite, plan, options, *, nprocs=None, progress=None, device=None, gpu_memory=None,
                **settings):
    """Run the plan on a CUDA device and return the per-voxel values (``engine.backend.PatchSums``).

    With ``normalize`` (the default) the sums are divided by the weights on the device and come back
    ``normalized`` (the host-side division of the (V, T) sums would cost more than this whole backend).

    A float32 run ends with a settling pass in float64 over the windows whose rank float32 could not settle
    (``threshold``) and those whose eigensolve failed; ``settle=False`` leaves it out (to measure float32
    alone). A series whose data and sums do not fit the device runs in slabs along x (``plan.slab_planes``):
    each slab's rows are uploaded (the next slab's on a second stream while this one computes), its windows
    run, the rows no later window reaches are divided and downloaded, and the sums of the halo (the last
    extent - 1 planes) are carried into the next slab.

    ``device``: default "cuda"; "cpu" runs the same kernels under TRITON_INTERPRET=1. ``gpu_memory``
    (``backend.GPUMemory``): the budget asked for (``plan.DeviceMemory``). ``settings``: the fields of
    ``plan.GPUSettings`` (path, eigensolver, precision, max_batch, planes, normalize, settle, timeline).
    ``nprocs`` is not used: the few windows whose eigensolve fails twice are redone in this process. A plan of
    spheres runs on the series padded by their radius (``layout.padded_series``), its sums cropped after.

    ``info["series_finite"]``: whether every value of ``data`` is finite, checked on the device as each slab's
    series is there and read once the run has waited for the device (``engine.denoise`` takes the series as
    finite with no host pass over it, and redoes the run the host's way where it is not).

    ``data`` may be a float32 torch tensor (``upload.series_layout``: either order), which runs on its own
    device (``device`` None or that one): its slabs are copied on the device, and the image of the sums comes
    back as an (X, Y, Z, T) tensor there, in its order (the maps as NumPy).
    """
    settings = GPUSettings(**settings)
    if isinstance(data, torch.Tensor):  # (spheres: the plan's grid is padded)
        asked = torch.device(device or data.device)
        if asked.type != data.device.type or asked.index not in (None, data.device.index):
            raise ValueError(f"a series on {data.device} runs there, not on {device}")
        device = data.device
        data, finite = padded_on_device(data, plan.padding), np.pad(finite, plan.padding)
    else:
        data, finite = padded_series(data, finite, plan.padding)
    device = torch.device(device or "cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kept = None
    if device.type == "cuda" and graphs.may_replay(plan, options, finite, data.shape[3], settings):
        kept = graphs.FirstPassGraphs.taken((str(device), plan.spatial_shape, plan.extent, plan.stride,
                                             plan.n_windows, data.shape[3], options,
                                             dataclasses.replace(settings, timeline=False)))
    memory = DeviceMemory(device, gpu_memory)
    planes = settings.planes or slab_planes(memory, plan, data.shape[3], options.lambda_plus)
    try:
        # the upload's threads get the GIL when they need it, not after Python's default 5 ms
        with switching_often() if device.type == "cuda" else nullcontext(), memory.enforced():
            retries = 0
            while True:
                run = _GPURunOfSlabs(data, finite, plan, options, device, settings, progress, kept, memory,
                                     planes)
                try:
                    sums = run.run()
                except Exception as err:  # noqa: BLE001 - only out of memory is recovered from
                    if not is_out_of_memory(err) or planes <= 1:
                        raise
                    run.abandon()
                    planes, retries = max(1, min(planes, plan.spatial_shape[0]) // 2), retries + 1
                    continue
                sums.info.update(slab_retries=retries, **memory.describe())
                return sums.cropped(plan.spatial_shape, plan.padding)
    finally:
        if kept is not None:
            kept.lock.release()


class _GPURunOfSlabs:
    """One call of ``denoise_gpu``: the upload, the slab loop and the outputs (the run's state between them)."""

    def __init__(self, data, finite, plan, options, device, settings, progress, kept_graphs, memory, planes):
        self.started = time.perf_counter()
        self.data, self.finite_host, self.plan, self.device, self.memory = data, finite, plan, device, memory
        self.settings, self.progress, self.on_gpu = settings, progress, device.type == "cuda"
        self.timeline = Timeline(device, settings.timeline)
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        self.n_volumes = data.shape[3]
        self.n_rows = int(np.prod(data.shape[:3]))
        self.planes = min(planes, plan.spatial_shape[0])
        self.slabs = plan_slabs(plan, self.planes)
        self.kept_graphs = kept_graphs if len(self.slabs) == 1 else None  # (graphs serve a series that fits whole)
        self.plane = plan.spatial_shape[1] * plan.spatial_shape[2]
        # the series' copies on a stream of their own: the run's set-up work queued meanwhile does not wait for them
        self.copies = torch.cuda.Stream(device) if self.on_gpu else None
        self.resident = isinstance(data, torch.Tensor)  # (the series and the result stay on the device)
        self.volume_major = series_layout(data) == "F" if self.resident else is_volume_major(data)
        self.series = DeviceSeries(data) if self.resident else StagedSeries(data) if self.on_gpu else None
        self.every_voxel_finite = bool(finite.all())
        self.host_finite = (None if self.every_voxel_finite
                            else np.ascontiguousarray(finite.reshape(-1), dtype=np.float32))
        self.uploads = {}  # slab number -> what ``_upload`` returned, until its slab takes it
        self.arrived = None  # the slab's series on the device, once ``_rows_of`` gave it (``_check_finite``)
        self.series_finite = None  # (device bool) whether every value uploaded so far is finite
        self.copies_queued = []  # every upload's futures (``abandon`` waits for them; they hold no tensor)
        self.options = options

    def run(self) -> PatchSums:
        timeline = self.timeline
        # the first thing: the helper threads stage and copy while this one sets the run up
        self.uploads[0] = self._upload(self.slabs[0])
        timeline.mark("upload started")
        # a volume-major series that fits whole comes back in its order, transposed on the device at the end
        volume_major = (self.on_gpu and self.settings.normalize and len(self.slabs) == 1 and self.volume_major)
        image_shape = ((self.n_volumes,) + self.data.shape[2::-1] if volume_major
                       else (self.n_rows, self.n_volumes))
        n_maps = 4 if self.options.lambda_plus else 3  # weight, sigma, rank (, lambda_plus)
        shapes = (image_shape,) + ((self.n_rows,),) * n_maps
        # the outputs' page-locked memory is allocated on a thread (0.6 s for a 663 MB series on the H200
        # machine, in torch outside the GIL) while this one sets the run up (nvmath's import, the plan's tables)
        with ThreadPoolExecutor(1, thread_name_prefix="mppca-outputs") as allocator:
            allocated = allocator.submit(lambda: [
                torch.empty(shape, dtype=torch.float32, device=self.device) if number == 0 and self.resident
                else torch.empty(shape, dtype=torch.float32, pin_memory=self.on_gpu)
                for number, shape in enumerate(shapes)])
            run = GPURun(self.plan, self.options, self.device, self.settings, self.n_volumes, self.memory)
            timeline.mark("plan's tables")
            outputs = allocated.result()
        downloads = torch.cuda.Stream(self.device) if self.on_gpu else None
        timeline.mark("set up")
        carried, done_windows = None, 0
        self.series_finite = torch.ones((), dtype=torch.bool, device=self.device)
        for number, slab in enumerate(self.slabs):
            n_rows = (slab.stop - slab.first) * self.plane
            if self.kept_graphs is not None:  # (one slab) the sums the geometry's graphs add into
                sums = self.kept_graphs.sums_for(n_rows, self.n_volumes, self.device)
            else:
                sums = SlabSums(n_rows, self.n_volumes, self.device, carried, self.options.lambda_plus)
            final = (slab.done - slab.first) * self.plane
            finisher = Finisher(sums, [None] + outputs[1:] if volume_major else outputs, slab.first * self.plane,
                                final, self.settings.normalize, downloads)
            timeline.mark("slab's sums")
            report = ((lambda done, before=done_windows: self.progress(before + done, self.plan.n_windows))
                      if self.progress else None)
            run_slab(run, slab, lambda number=number: self._rows_of(number), sums, report, self.data,
                     self.finite_host, finisher, timeline, self.kept_graphs)
            done_windows = slab.windows.stop
            finisher.up_to(final)
            carried = sums.tail(final)
            self._check_finite()  # (after the slab's downloads are queued: they need not wait for it)
        if volume_major:
            download_volume_major(sums.image, outputs[0], downloads)
        run.download_counts()
        # the flag comes down beside the outputs, read after the run's one wait (a read of the device's would
        # be a second)
        series_finite = torch.empty((), dtype=torch.bool, pin_memory=self.on_gpu)
        series_finite.copy_(self.series_finite, non_blocking=True)
        timeline.mark("all queued")
        peak, device_name = self._wait_for_the_device(downloads)
        image, weight, sigma, rank, *lambda_plus = (x if number == 0 and self.resident else x.numpy()
                                                    for number, x in enumerate(outputs))
        if volume_major:
            image = image.permute(3, 2, 1, 0) if self.resident else image.transpose(3, 2, 1, 0)  # (X, Y, Z, T)
        elif self.resident:  # (X, Y, Z, T) in the series' own layout, as a series on the device comes back
            image = image.view(*self.data.shape[:3], self.n_volumes)
            if self.volume_major:
                image = empty_series(image.shape, "F", self.device).copy_(image)
        return PatchSums(image, weight, sigma, rank, normalized=self.settings.normalize,
                         lambda_plus=lambda_plus[0] if lambda_plus else None,
                         info=dict(backend="gpu", device=device_name, eigensolver=run.solver.backend,
                                   gram_precision=str(run.dtype).replace("torch.", ""),
                                   gram_path=run.gram_path, batch=run.step,
                                   out_of_memory_retries=run.retries, n_slabs=len(self.slabs),
                                   slab_planes=self.planes,
                                   n_settled_in_float64=run.settled(), n_redone_on_cpu=run.n_redone_on_cpu,
                                   eigenvalues_refined=bool(run.refine) and not run.leading,
                                   leading_eigenpairs=run.leading, mean_taken_apart=run.mean_apart,
                                   first_pass=run.first_pass, gpu_peak_bytes=int(peak),
                                   series_finite=bool(series_finite),
                                   seconds_engine=time.perf_counter() - self.started,
                                   **(dict(timeline_ms=timeline.milliseconds()) if timeline.enabled else {})))

    def abandon(self):
        """After an error: wait for the uploads still under way (their threads write into memory the next
        run may reuse) and the device, and hand torch's cached device memory back."""
        for queued in self.copies_queued:
            queued.exception()  # (waits; an upload's own error is of no interest here)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _check_finite(self):
        """Fold whether every value of the slab's series is finite into ``series_finite``, on the device and
        after the slab's work (the current stream has waited for the whole series by then): the caller may
        have taken the series as finite with no pass of its own over it (``engine.denoise``). Its min and max
        are NaN or infinite exactly where some value is, and need no temporary the size of the series."""
        lowest, highest = torch.aminmax(self.arrived)
        self.series_finite &= torch.isfinite(lowest) & torch.isfinite(highest)
        self.arrived = None

    def _upload(self, slab):
        """Start the slab's series on its way to the device (on the copy stream)."""
        rows = slice(slab.first * self.plane, slab.stop * self.plane)
        if not self.on_gpu:
            if self.resident:
                into = torch.empty((rows.stop - rows.start, self.n_volumes), dtype=torch.float32, device=self.device)
                return self.series.rows(rows, into)
            slab_rows = np.empty((rows.stop - rows.start, self.n_volumes), dtype=np.float32)
            return to_device(rows_of_planes(self.data, slice(slab.first, slab.stop), slab_rows), self.device)
        into = (self.kept_graphs.volume_for((rows.stop - rows.start, self.n_volumes), self.device)
                if self.kept_graphs is not None else None)
        with torch.cuda.stream(self.copies):
            upload = self.series.upload(rows, self.device, self.copies, into=into)
        self.copies_queued += upload.queued
        return upload

    def _rows_of(self, number):
        """Slab ``number``'s series (on a GPU: an ``upload.Upload`` whose parts the current stream is to wait
        for) and finite flags; called once the slab's tables are set up. The next slab's upload starts here,
        to run beside this one's work."""
        if number + 1 < len(self.slabs):
            self.uploads[number + 1] = self._upload(self.slabs[number + 1])
        slab = self.slabs[number]
        rows = slice(slab.first * self.plane, slab.stop * self.plane)
        if self.every_voxel_finite:  # filled on the device, no copy
            finite_rows = torch.ones(rows.stop - rows.start, dtype=torch.float32, device=self.device)
        else:
            finite_rows = to_device(self.host_finite[rows], self.device)
        series = self.uploads.pop(number)
        self.arrived = series.tensor if isinstance(series, Upload) else series
        return series, finite_rows

    def _wait_for_the_device(self, downloads):
        """The run's one wait (unless a pass needed the host), after the last download; returns the peak of
        device memory and the device's name, and notes the upload threads' steps in the timeline."""
        if not self.on_gpu:
            return 0, "cpu (Triton interpreter)"
        timeline = self.timeline
        downloaded = torch.cuda.Event()
        downloaded.record(downloads)
        torch.cuda.current_stream(self.device).wait_event(downloaded)
        torch.cuda.current_stream(self.device).synchronize()
        timeline.mark("done")
        for piece, at in sorted(self.series.queued_at.items()):  # (the uploader thread's)
            timeline.note(f"round {piece}'s copy queued", at)
        for piece, at in sorted(self.series.staged_at.items()):
            timeline.note(f"round {piece} staged", at)
        if self.series.started_at is not None:
            timeline.note("staging threads started", self.series.started_at)
        # (max_memory_allocated flattens every statistic into a dict in Python: 161 calls)
        peak = torch.cuda.memory_stats_as_nested_dict(self.device)["allocated_bytes"]["all"]["peak"]
        return peak, torch.cuda.get_device_name(self.device)


def run_slab(run, slab, arrive, sums, report, data, finite_host, finisher, timeline, kept_graphs=None):
    """All the windows of one slab: a first pass in the Gram precision, then (float32) the windows it could not
    settle and those whose eigensolve failed in float64, then what failed again on the CPU.

    ``arrive()`` gives the slab's series and finite flags on the device; it is called once the slab's tables
    are set up (their upload runs meanwhile). Queued without waiting for the device where
    ``run.settles_on_device``; else one synchronisation after the first pass. With the box sums and the
    settling pass on the device, ``finisher.up_to(stop)`` (``sums.Finisher``) is called as the slab's rows
    before ``stop`` get their last addition (else the caller finishes them after). ``timeline`` marks the
    steps. ``kept_graphs`` (``graphs.FirstPassGraphs``, taken): with the box sums and the settling pass on the
    device, the geometry's first pass is captured on its second run and replayed from then on.
    """
    n_volumes = sums.image.shape[1]
    run.choose_paths(finite_host, n_volumes)
    if slab.windows.stop == slab.windows.start:
        series, _ = arrive()
        if isinstance(series, Upload):  # its copies done before its memory can be reused
            series.wait(torch.cuda.current_stream(run.device))
        return
    if not (run.takes_box_sums and run.settles_on_device(n_volumes)):
        kept_graphs = None
    arrived = None
    if kept_graphs is not None and kept_graphs.parts is not None:
        arrived = arrive()
        if not kept_graphs.replays(arrived[0]):
            kept_graphs.parts = None  # (captured for other arrivals: captured again on the next run)
    if kept_graphs is not None and kept_graphs.parts is not None:
        windows, verdicts, finishing = _replay_first_pass(run, kept_graphs, arrived[0], sums, report, finisher,
                                                          timeline)
    else:
        windows, verdicts, finishing = _queue_first_pass(run, slab, arrive, arrived, sums, report, finisher,
                                                         timeline, kept_graphs)
    windows.box_gram = None  # the first pass is done with it

    if finishing is not None:  # each part settled and finished on the side stream as it was queued
        finishing.close()
        timeline.mark("reconstruction queued")
    elif run.settles_on_device(n_volumes):
        settled = settle_on_device(run, windows, verdicts, timed=timeline.enabled)
        timeline.mark("settling pass queued")
        if settled is not None:
            timeline.mark("settling pass done (its stream)", settled)
        timeline.mark("reconstruction queued")
    else:
        settle_on_host(run, windows, verdicts, data, finite_host, slab.windows.start,
                       slab.first * run.plan.spatial_shape[1] * run.plan.spatial_shape[2])


def _part_finishing(run, windows, finisher, timeline):
    """A ``settling.PartFinishing`` for the slab's first pass where it takes the box sums and the settling pass
    runs on the device, else None."""
    if windows.box is None or not run.settles_on_device(windows.n_volumes):
        return None
    return PartFinishing(run, windows, finisher, timeline)


def _replay_first_pass(run, kept_graphs, series, sums, report, finisher, timeline):
    """The slab's first pass replayed from the geometry's graphs on this run's ``series`` and ``sums``; returns
    (the slab's windows, the verdicts, the part finishing)."""
    windows = kept_graphs.windows
    windows.renew(sums)
    run.n_box_slabs += 1
    run.step, run.first_pass = kept_graphs.step, "replayed"
    finishing = _part_finishing(run, windows, finisher, timeline)
    run.settled_on_device += kept_graphs.settled_counts  # (the captured settling passes' counts)
    verdicts = kept_graphs.replay(series, report, finishing)
    timeline.mark("first pass replayed")
    return windows, verdicts, finishing


def _queue_first_pass(run, slab, arrive, arrived, sums, report, finisher, timeline, kept_graphs):
    """The slab's first pass queued by this thread (captured as the geometry's graphs on its second run);
    returns (the slab's windows, the verdicts, the part finishing or None)."""
    plan, n_volumes = run.plan, sums.image.shape[1]
    box = None
    if run.takes_box_sums and (run.path == "box" or box_fits(run.memory, plan, n_volumes, slab)):
        box = boxsums.BoxSums(plan, slab, n_volumes, run.device)
        run.n_box_slabs += 1
        timeline.mark("box sums' tables")
    row0 = slab.first * plan.spatial_shape[1] * plan.spatial_shape[2]
    windows = SlabWindows(run, slab, sums, row0, box)
    finishing = _part_finishing(run, windows, finisher, timeline)
    timeline.mark("slab set up")
    step = run.step or run.batch_size(slab.windows.stop - slab.windows.start, n_volumes)
    series, finite_rows = arrived or arrive()
    verdicts = None
    if kept_graphs is not None and box is not None and kept_graphs.eager_runs:  # (its kernels are built)
        verdicts = kept_graphs.capture(windows, series, finite_rows, step, report, finishing)
        if verdicts is not None:
            run.first_pass = "captured"
            timeline.mark("first pass captured and replayed")
        else:  # the series is there (the capture waited for it)
            series = series.tensor if isinstance(series, Upload) else series
    if verdicts is None:
        verdicts, step = _first_pass(run, windows, series, finite_rows, step, report, timeline,
                                     finishing and finishing.part)
        if kept_graphs is not None and box is not None:
            kept_graphs.eager_runs += 1
    run.step = step
    return windows, verdicts, finishing


def _first_pass(run, windows, series, finite_rows, step, report, timeline, on_part=None):
    """The slab's first pass queued by this thread, in parts as the rows arrive; returns its verdicts (per
    batch: the solver's ``info`` and the windows left unsettled) and the batch size it ended with.
    ``on_part(ready, verdicts, verdicts_ready)`` after each part (``settling.PartFinishing.part``)."""
    verdicts, first = [], 0
    for ready in windows.start(series, finite_rows):  # windows first..ready can run: their rows are there
        part, step, retries = run_in_batches(
            ready - first, step, lambda a, b, first=first: windows.batch(
                slice(first + a, first + b), run.dtype, run.fused, run.settle, run.refine),
            on_batch=(lambda stop, first=first: report(first + stop)) if report else None,
            on_retry=run.solver.release_workspaces)
        verdicts += part
        run.retries += retries
        windows.spread_final_planes(ready)
        if on_part is not None:
            on_part(ready, part, windows.verdicts_ready)
        first = ready
        timeline.mark(f"first pass to window {ready} queued")
    return verdicts, step
