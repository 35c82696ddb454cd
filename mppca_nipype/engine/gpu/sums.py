"""The per-voxel sums of a slab on the device, and their way to the caller: divided and downloaded.

``SlabSums``: image (rows, T) and weight, sigma, rank (rows,) of one slab's rows, float32, starting from the
halo the previous slab carried; lambda_+ (rows,) too when the run asks for it. ``Finisher``: a slab's rows
divided by their weights (``divide_rows``, one kernel) and copied into the run's page-locked outputs as they
get their last addition, on a stream of its own while the device goes on computing.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .upload import to_device


#: Rows per program of ``_divide_rows_kernel``.
DIVIDE_ROWS = 32
#: Bytes of the divided image transposed on the device at a time by ``download_volume_major`` (each part's
#: download runs while the next is transposed).
TRANSPOSE_BYTES = 64 << 20


@triton.jit
def _divide_rows_kernel(image_ptr, weight_ptr, sigma_ptr, rank_ptr, first, stop, n_volumes,
                        BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = first + tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < stop
    weight = tl.load(weight_ptr + rows, mask=valid, other=1.0)
    divisor = tl.where(weight > 0, weight, 1.0)  # a voxel no window served keeps its sums, 0
    tl.store(sigma_ptr + rows, tl.load(sigma_ptr + rows, mask=valid, other=0.0) / divisor, mask=valid)
    tl.store(rank_ptr + rows, tl.load(rank_ptr + rows, mask=valid, other=0.0) / divisor, mask=valid)
    for t0 in range(0, n_volumes, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        element_valid = valid[:, None] & (t < n_volumes)[None, :]
        image = image_ptr + rows[:, None] * n_volumes + t[None, :]
        tl.store(image, tl.load(image, mask=element_valid, other=0.0) / divisor[:, None], mask=element_valid)


def divide_rows(image, weight, sigma, rank, rows: slice):
    """``image`` (V, T) and the ``sigma`` and ``rank`` maps (V,) divided by ``weight`` in ``rows``, in place
    (rows of weight 0 keep their sums, 0), in one launch."""
    first, stop = rows.start, rows.stop
    if stop > first:
        n_volumes = image.shape[1]
        _divide_rows_kernel[(triton.cdiv(stop - first, DIVIDE_ROWS),)](
            image, weight, sigma, rank, first, stop, n_volumes, BLOCK_R=DIVIDE_ROWS,
            BLOCK_T=min(64, triton.next_power_of_2(n_volumes)), num_warps=4)


class SlabSums:
    """The per-voxel sums of one slab's rows on the device: image (rows, T), weight, sigma and rank (rows,),
    and with ``lambda_plus`` each window's Marchenko-Pastur edge (rows,) (``batch.SlabWindows``, weighted as
    sigma), starting from the halo sums the previous slab ``carried`` into its first rows."""

    def __init__(self, n_rows, n_volumes, device, carried=None, lambda_plus=False):
        self.image = torch.zeros((n_rows, n_volumes), dtype=torch.float32, device=device)
        self.weight, self.sigma, self.rank = (torch.zeros(n_rows, dtype=torch.float32, device=device)
                                              for _ in range(3))
        self.lambda_plus = torch.zeros(n_rows, dtype=torch.float32, device=device) if lambda_plus else None
        if carried is not None:
            for sums, values in zip(self.all_tensors(), carried):
                sums[:len(values)] = values

    def tensors(self):
        """The sums the reconstruction kernels add into: image, weight, sigma, rank."""
        return self.image, self.weight, self.sigma, self.rank

    def all_tensors(self):
        """``tensors()`` and, when the run asks for it, ``lambda_plus``."""
        return self.tensors() + ((self.lambda_plus,) if self.lambda_plus is not None else ())

    def zero_(self):
        for sums in self.all_tensors():
            sums.zero_()
        return self

    def tail(self, start):
        """The sums of rows ``start`` on (the halo a next slab goes on adding into), or None if there are none."""
        return tuple(x[start:].clone() for x in self.all_tensors()) if start < len(self.weight) else None

    def divide(self, rows: slice):
        """Values instead of sums in ``rows``: 0 where no patch served the voxel (its sums are 0)."""
        if self.lambda_plus is not None and rows.stop > rows.start:
            weight = self.weight[rows]
            self.lambda_plus[rows] /= torch.where(weight > 0, weight, 1.0)
        divide_rows(self.image, self.weight, self.sigma, self.rank, rows)

    def add(self, rows, image, weight, sigma, rank, lambda_plus=None, replace=False):
        """Add host-computed values into rows (or, with ``replace``, write them: centre aggregation);
        ``lambda_plus`` where the sums hold it."""
        index = to_device(rows, self.weight.device)
        values_of = (image, weight, sigma, rank) + ((lambda_plus,) if self.lambda_plus is not None else ())
        for sums, values in zip(self.all_tensors(), values_of):
            values = to_device(np.asarray(values, dtype=np.float32), sums.device)
            if replace:
                sums[index] = values
            else:
                sums.index_add_(0, index, values)


class Finisher:
    """A slab's rows before ``final`` divided by their weights (with ``normalize``) and copied into the host
    ``outputs`` from row ``first`` on, as they get their last addition (``up_to``): on the GPU, divided on the
    current stream and downloaded on the ``downloads`` stream while the device goes on computing. The image's
    rows go as they are finished, the maps' (1/T of the image each) when asked (``maps``) and with the
    last rows: fewer copies to queue (the host's queueing of copies can be a run's critical path). Without
    ``outputs``: divided only (as captured in a graph, ``settling.PartFinishing``)."""

    def __init__(self, sums, outputs, first, final, normalize, downloads):
        self.sums, self.outputs, self.first, self.final = sums, outputs, first, final
        self.normalize, self.downloads, self.done, self.maps_done = normalize, downloads, 0, 0
        if downloads is not None:
            for values in sums.all_tensors():  # read by the downloads: not reused before they are done
                values.record_stream(downloads)

    def divider(self):
        """A ``Finisher`` of the same rows that divides them and copies nothing."""
        return Finisher(self.sums, None, self.first, self.final, self.normalize, None)

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
            copies += [(k, slice(self.maps_done, stop)) for k in range(1, len(self.sums.all_tensors()))]
            self.maps_done = stop
        if self.outputs is not None:  # (an output left None is not downloaded here: ``download_volume_major``)
            copies = [(k, part) for k, part in copies if self.outputs[k] is not None]
        if not copies or self.outputs is None:
            return
        tensors = self.sums.all_tensors()
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


def download_volume_major(image, out, downloads):
    """The divided image (V, T), its rows in (x, y, z) order, into the page-locked host tensor ``out`` of shape
    (T, Z, Y, X): the volume-major order of a caller's series read from a NIfTI file. Transposed on the device
    (the current stream) some volumes at a time (``TRANSPOSE_BYTES``), each part downloaded on ``downloads``
    while the next is transposed: the host receives the series in its order, with no transpose of its own."""
    n_volumes = image.shape[1]
    volumes = image.view(*reversed(out.shape[1:]), n_volumes)  # (X, Y, Z, T)
    step = max(1, TRANSPOSE_BYTES // (4 * image.shape[0]))
    stream = torch.cuda.current_stream(image.device)
    for t0 in range(0, n_volumes, step):
        part = volumes[..., t0:t0 + step].permute(3, 2, 1, 0).contiguous()
        transposed = torch.cuda.Event()
        transposed.record(stream)
        downloads.wait_event(transposed)
        part.record_stream(downloads)
        with torch.cuda.stream(downloads):
            out[t0:t0 + step].copy_(part, non_blocking=True)
