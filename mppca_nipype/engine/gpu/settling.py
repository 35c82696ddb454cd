"""The settling pass: the windows float32 could not settle, and those whose eigensolve failed, redone in
float64; what fails again, on the CPU.

A float32 first pass gives its unsettled windows (``threshold``: their rank could change within float32's
error) weight 0 and leaves them for this pass. Where the run ``settles_on_device`` (fused kernels in float64,
the tridiagonal eigensolver, weighted or uniform aggregation) the windows to redo are chosen on the device
(``choose_windows``: compacted to the front, their number left on the device) and float64 batches run over
all those places, each launch's kernels returning at once past that number: the run never waits for the
device. It runs on a stream of its own, of high priority, from the moment the first pass's verdicts are
known: beside the first pass's end (``settle_on_device``), or with the box sums beside the next part of the
first pass, each part's final x-planes reconstructed, divided and downloaded on that stream too
(``PartFinishing``). Elsewhere the host looks at the verdicts once, after the first pass
(``settle_on_host``), and windows whose float64 eigensolve fails too are redone with the CPU backend's own
functions (``cpu_contributions``).
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import triton
import triton.language as tl

from ..layout import voxel_rows
from .batch import Chosen
from .gram import fused_fits
from .plan import run_in_batches
from .warmup import compiling_only

#: Pieces along x in which a part's final planes are reconstructed, each divided and downloaded while the
#: next one computes.
FINAL_PIECES = 8


#: Windows ``_choose_kernel`` looks at per step of its loop.
CHOOSE_BLOCK = 1024


@triton.jit
def _choose_kernel(info_ptr, unsettled_ptr, base_ptr, multiplicity_ptr, n_windows, first, chosen_base_ptr,
                   chosen_multiplicity_ptr, asked_ptr, count_ptr, BLOCK: tl.constexpr):
    """One program: the windows ``first + i`` (i < n_windows) whose ``info`` is not 0 or that are
    ``unsettled``, in order: their base rows and multiplicities compacted to the front, their number, and
    ``asked[j] = j < number``."""
    count = tl.sum(tl.zeros((BLOCK,), dtype=tl.int64), axis=0)
    for start in range(0, n_windows, BLOCK):
        i = start + tl.arange(0, BLOCK)
        valid = i < n_windows
        redo = ((tl.load(info_ptr + i, mask=valid, other=0) != 0)
                | (tl.load(unsettled_ptr + i, mask=valid, other=0) != 0)) & valid
        taken = redo.to(tl.int64)
        place = count + tl.cumsum(taken, axis=0) - 1
        window = first + i
        tl.store(chosen_base_ptr + place, tl.load(base_ptr + window, mask=redo, other=0), mask=redo)
        tl.store(chosen_multiplicity_ptr + place, tl.load(multiplicity_ptr + window, mask=redo, other=0.0), mask=redo)
        count += tl.sum(taken, axis=0)
    tl.store(count_ptr, count)
    for start in range(0, n_windows, BLOCK):
        j = start + tl.arange(0, BLOCK)
        tl.store(asked_ptr + j, j < count, mask=j < n_windows)


def choose_windows(info, unsettled, base, multiplicity, first=0):
    """The windows a settling pass redoes, chosen without the host: of windows ``first`` to ``first + n``
    (``info`` (n,) int32 not 0: a failed eigensolve; ``unsettled`` (n,) bool), their ``base`` rows and
    ``multiplicity`` (the slab's, by window) compacted to the front in order, their ``count`` (a 0-d int64
    tensor) and ``asked`` (n,) bool: the places before the count. The places past the count are left
    unwritten. One launch, where torch would take ~20 operations (a sort among them)."""
    n_windows = info.numel()
    device = info.device
    # (a run that only compiles launches no kernel: it chooses none, so that no index it reads is garbage)
    allocate = torch.zeros if compiling_only() else torch.empty
    chosen_base = allocate(n_windows, dtype=base.dtype, device=device)
    chosen_multiplicity = allocate(n_windows, dtype=multiplicity.dtype, device=device)
    asked = allocate(n_windows, dtype=torch.bool, device=device)
    count = allocate((), dtype=torch.int64, device=device)
    _choose_kernel[(1,)](info, unsettled, base, multiplicity, n_windows, first, chosen_base, chosen_multiplicity,
                         asked, count, BLOCK=CHOOSE_BLOCK, num_warps=4)
    return chosen_base, chosen_multiplicity, asked, count


def settling_step(run, n_windows, n_volumes):
    """Windows per batch of a settling pass chosen on the device over ``n_windows`` windows (float64, fused)."""
    return run.batch_size(n_windows, n_volumes, dtype=torch.float64, fused=True, refine=0)


def queue_settling(run, windows, verdicts, first=0, step=None):
    """Queue, on the current stream, the settling pass of the slab's windows ``first`` on that the first
    pass's ``verdicts`` cover (a failed eigensolve or an unsettled rank): those to redo compacted first
    (``choose_windows``), their number left on the device, and float64 batches over all those places whose
    kernels return at once past that number (each launch sized for every window, the work for the few
    redone); they add their windows with the fused reconstruction (atomics). ``windows``: the slab's
    ``batch.SlabWindows``; ``step``: windows per batch (default ``settling_step``)."""
    info, left = verdicts[0] if len(verdicts) == 1 else (torch.cat([info for info, _ in verdicts]),
                                                         torch.cat([left for _, left in verdicts]))
    base, multiplicity, asked, count = choose_windows(info, left, windows.base, windows.multiplicity, first)
    run.settled_on_device.append(count)
    n_windows = len(info)
    step = step or settling_step(run, n_windows, windows.n_volumes)
    _, _, retries = run_in_batches(
        n_windows, step, lambda a, b: windows.batch(
            Chosen(base[a:b], multiplicity[a:b], asked[a:b],
                   count if (a, b) == (0, n_windows) else (count - a).clamp(0, b - a)),
            torch.float64, True, False),
        on_retry=run.solver.release_workspaces)
    run.retries += retries


def settle_on_device(run, windows, verdicts, timed=False):
    """The settling pass without the host (``queue_settling``) after the whole first pass of the fused kernels.

    On a GPU the pass runs on a stream of its own (``run.side``, of high priority), from the moment the first
    pass's verdicts are known (``SlabWindows.verdicts_ready``: before its projectors), beside the rest of the
    first pass (its few hundred windows leave most of the device idle; they had weight 0 in the first pass),
    and the current stream waits for it. Every tensor it reads that the current stream allocated stays
    referenced until that wait is queued (so no block it reads is handed to the current stream's later work
    before it is done). Returns the event the current stream waits for (with ``timed``, one that times), or
    None without a stream of its own."""
    with torch.cuda.stream(run.side) if run.side is not None else nullcontext():
        if run.side is not None:
            run.side.wait_event(windows.verdicts_ready)
        queue_settling(run, windows, verdicts)
    if run.side is None:
        return None
    settled = torch.cuda.Event(enable_timing=timed)
    settled.record(run.side)
    torch.cuda.current_stream(run.device).wait_event(settled)
    return settled


def settle_on_host(run, windows, verdicts, data, finite_host, first_window, first_row):
    """The settling pass after one look at the first pass's ``verdicts`` (after all its work is queued): the
    windows to redo in float64 by number, then the box's reconstruction (their projectors replace the first
    pass's there), then what failed again on the CPU, added into the slab's sums. ``first_window`` and
    ``first_row``: the slab's first window and row in the plan's numbering."""
    redo = torch.cat([info for info, _ in verdicts]) != 0
    if run.settle:
        redo |= torch.cat([left for _, left in verdicts])
    redo = torch.nonzero(redo).reshape(-1).cpu().numpy()
    if compiling_only():  # (its verdicts mean nothing) every window, so that the float64 kernels compile too
        redo = np.arange(sum(len(info) for info, _ in verdicts))
    failed = redo
    if run.settle and len(redo):
        run.n_settled += len(redo)
        fused64 = run.path != "gather" and fused_fits(run.plan.patch_size, windows.n_volumes, torch.float64)
        step64 = run.batch_size(len(redo), windows.n_volumes, dtype=torch.float64, fused=fused64, refine=0)
        verdicts, _, retries = run_in_batches(
            len(redo), step64, lambda a, b: windows.batch(redo[a:b], torch.float64, fused64, False),
            on_retry=run.solver.release_workspaces)
        run.retries += retries
        failed = redo[torch.nonzero(torch.cat([info for info, _ in verdicts]) != 0).reshape(-1).cpu().numpy()]
    windows.accumulate_box()
    if len(failed) and not compiling_only():
        run.n_redone_on_cpu += len(failed)
        if isinstance(data, torch.Tensor):  # a series on the device: on the host for these few windows
            data = data.cpu().numpy()
        rows, values, replace = cpu_contributions(data, finite_host, run.plan, run.options, failed + first_window)
        windows.sums.add(rows - first_row, *values, replace=replace)


class PartFinishing:
    """With the box sums and the settling pass on the device, each part of a slab's first pass finished as
    soon as it is queued, on the run's side stream (``GPURun.side``; on the CPU in turn): its windows'
    settling pass (``queue_settling``: they had weight 0 in the first pass) from the moment its
    verdicts are known, then, once its spread is done, the x-planes no later window holds
    (``BoxSums.final_planes``) reconstructed (``BoxSums.apply``) in pieces, each divided and downloaded beside
    the rest (``sums.Finisher``). So only the last part's settling pass, reconstruction and download follow the
    first pass, not the whole slab's. ``part`` queues a part's work; with the first pass's graphs, ``capture``
    captures it as two graphs per part (the settling pass, the reconstruction and division), which
    ``replay`` launches (the host queued ~1.5 ms a part otherwise, and became the run's critical path).

    Nothing here races: the side stream does the settling passes and the reconstruction in order; a part's
    settled windows start at its first corner along x, past the planes every earlier part's reconstruction
    wrote, and the planes a part reconstructs were spread (by the first pass's stream) before it; the first
    pass never writes the sums. ``close()`` makes the current stream wait for the side stream's last work."""

    def __init__(self, run, windows, finisher, timeline):
        self.run, self.windows, self.finisher, self.timeline = run, windows, finisher, timeline
        self.stream, self.windows_done, self.planes_done = run.side, 0, 0
        self.planes_per_piece = -(-windows.box.shape[0] // FINAL_PIECES)
        self.settling_step = settling_step(run, len(windows.base), windows.n_volumes)

    def _settle(self, ready, verdicts):
        """Queue the settling pass of the windows from where the last part left off up to ``ready``."""
        queue_settling(self.run, self.windows, verdicts, self.windows_done, self.settling_step)
        self.windows_done = ready

    def _apply(self, ready, on_final):
        """Queue the reconstruction of the planes the windows up to ``ready`` leave final, from where the last
        part left off, with ``on_final(stop)`` after each piece and once more for the maps."""
        box = self.windows.box
        stop = box.final_planes(ready)
        box.apply(self.windows.volume, *self.windows.sums.tensors(), self.planes_done, stop, self.planes_per_piece,
                  on_final)
        on_final(stop * box.shape[1] * box.shape[2], maps=True)
        self.planes_done = stop

    def part(self, ready, verdicts, verdicts_ready=None):
        """The first pass is queued up to window ``ready``: ``verdicts`` those of its windows from the last
        part's ``ready`` on, ``verdicts_ready`` an event after them on the current stream (None: after all the
        part). Queues the part's finishing."""
        on_final = self.finisher.up_to
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
        self._mark(f"planes to {self.windows.box.final_planes(ready)} reconstructed (side stream)")

    def capture(self, ready, verdicts, pool, divider):
        """Capture the part's finishing: (settling graph, reconstruction graph, pieces), in the graph pool
        ``pool`` (they run one after the other on the side stream), the second dividing its rows (``divider``:
        ``Finisher.divider()``, shared by the parts) and recording after each piece an event of its own;
        pieces: (stop, maps, event) for the run's ``Finisher.up_to``."""
        pieces = []

        def divided(stop, maps=False):
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
        if self.timeline.enabled:
            self.timeline.mark(step, self._record(self.stream, timed=True))

    def close(self):
        """The current stream waits for the side stream's work (after the last part)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.run.device).wait_stream(self.stream)


def cpu_contributions(data, finite, plan, options, windows):
    """What the windows whose eigensolve failed on the device give, computed by the CPU backend's functions:
    ``(rows, (image, weight, sigma, rank[, lambda_plus]), replace)``: values to add into those rows, or for
    centre aggregation to write there (``replace``); lambda_plus where the options ask for it."""
    from ..cpu import fit_windows, window_voxel_weights

    n_volumes = data.shape[3]
    fit = fit_windows(voxel_rows(data), finite.reshape(-1), plan, options, windows)
    restored = fit.reconstruct()
    if options.aggregation == "center":
        centres = np.flatnonzero(np.isin(plan.centre_window, windows))
        own = np.searchsorted(windows, plan.centre_window[centres])
        rows = plan.centre_voxel[centres]
        values = (restored[own, plan.centre_position[centres]], np.ones(len(rows)),
                  np.sqrt(fit.sigma2[own]), fit.rank[own])
        if fit.lambda_plus is not None:
            values += (fit.lambda_plus[own],)
        return rows, values, True
    voxel_weight = window_voxel_weights(fit, options, plan, windows)
    values = ((restored * voxel_weight[:, :, None]).reshape(-1, n_volumes), voxel_weight.ravel(),
              (voxel_weight * np.sqrt(fit.sigma2)[:, None]).ravel(), (voxel_weight * fit.rank[:, None]).ravel())
    if fit.lambda_plus is not None:
        values += ((voxel_weight * fit.lambda_plus[:, None]).ravel(),)
    return fit.voxels.ravel(), values, False
