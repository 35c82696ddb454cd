"""One batch of a slab's windows: Gram -> eigenvalues -> threshold -> projector -> reconstruction.

``SlabWindows`` holds one slab's windows on the device (their corner rows within the slab, multiplicities,
centres) and, with the box sums, the first pass's Gram matrices of all of them and its projectors until the
box reconstructs them. ``SlabWindows.batch`` runs a batch with no host synchronisation:

1. Gram matrices: the box sums' (the whole slab's, computed as its rows arrive: ``start``), the fused
   Triton kernel's (``gram.gram``), or the gathered path's (``gram.gather_gram``).
2. Eigenvalues: the run's solver (``tridiagonal.TridiagonalEigh`` or ``cusolver.BatchedEigh``), with the
   undemeaned patch's mean as a rank-one term (``takes_mean_apart``), refined in float64 at both ends of
   the spectrum on long series (``refine``), or on the longest only the leading eigenpairs, in float64
   (``GPURun.leading``); ``info`` stays on the device.
3. The threshold and, in a float32 pass, the settling verdicts (``threshold``): an unsettled window gets
   weight 0 here and is redone by the settling pass (``settling``).
4. The projector onto the kept eigenvectors (weighted by the filter's ``component_weights`` for a filter
   other than ``hard``), the window's weight (``aggregation_weights`` times its
   multiplicity), and the reconstruction: into the box (first pass), by the fused kernels
   (``reconstruction``), or gathered (torch), added into the slab's sums (``sums.SlabSums``), or for
   ``center`` each centre row written to its voxel. Where the run asks for it, each window's
   Marchenko-Pastur edge (``estimators.marchenko_pastur_edge``) is added, weighted as sigma, into the sums'
   ``lambda_plus`` (torch, whichever path reconstructs: ``SlabWindows.add_lambda_plus``).

Everything a batch needs is allocated before anything is added into the sums, so that a batch that runs
out of memory can be redone smaller (``plan.run_in_batches``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..estimators import aggregation_weights, component_weights, marchenko_pastur_edge, unresolved_projectors
from . import cusolver, reconstruction, threshold
from .cusolver import ProjectorFromVectors
from .gram import gather_gram, gram
from .threshold import rounding_uncertainty, threshold_on_device
from .upload import Upload, round_bounds, to_device


@dataclass(frozen=True)
class Chosen:
    """A batch of a slab's windows chosen on the device (``settling.choose_windows``): their ``base`` rows and
    ``multiplicity`` (B,), of which the first ``count`` (a device integer; ``asked`` (B,): the places before
    it) are to be run; the kernels skip the rest."""

    base: torch.Tensor
    multiplicity: torch.Tensor
    asked: torch.Tensor
    count: torch.Tensor


@dataclass
class _Selection:
    """The windows of one batch as the kernels take them: ``base`` rows and ``multiplicity`` (B,); for
    ``Chosen`` windows ``asked`` and ``count``; ``index`` (B,) on the device for windows given by number;
    ``centres`` (rows, window in the batch, position in the window) for ``center`` aggregation."""

    base: torch.Tensor
    multiplicity: torch.Tensor
    asked: torch.Tensor | None = None
    count: torch.Tensor | None = None
    index: torch.Tensor | None = None
    centres: tuple | None = None


class SlabWindows:
    """One slab's windows on the device, and with ``box`` (``boxsums.BoxSums``) the first pass's Gram matrices
    of all of them, and its projectors (with a settling pass chosen on the host, that pass's too) until
    ``accumulate_box`` reconstructs them all at once. ``sums``: the slab's ``sums.SlabSums``."""

    def __init__(self, run, slab, sums, row0, box=None):
        device, plan = run.device, run.plan
        self.run, self.sums, self.box, self.n_volumes = run, sums, box, sums.image.shape[1]
        self.volume = self.finite = self.box_gram = None  # once the slab's rows are there (``start``)
        self.verdicts_ready = None  # an event after the first pass's last verdicts (on a GPU, with ``run.side``)
        self.capturing = False  # while the first pass is captured as graphs (``graphs.FirstPassGraphs.capture``)
        self.box_kept = box  # (``renew``: the box of windows kept with their graphs)
        # a given noise map's values on the slab's rows (``_given_variance``)
        self.noise_rows = run.noise_variance[row0:] if run.noise_map else None
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
        """For another run of windows kept with their first pass's graphs: that run's ``sums`` and the box."""
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
        if self.box is not None and self.run.settles_on_device(self.n_volumes):
            self.box.spread(ready)

    def accumulate_box(self):
        """The box sums' reconstruction of every window they hold at once (after a settling pass chosen on the
        host: its windows are in the box too)."""
        if self.box is not None:
            self.box.accumulate(self.volume, *self.sums.tensors())
            self.box = None

    def batch(self, windows, dtype, fused, settle, refine=0):
        """Gram -> eigensolver -> threshold -> reconstruction of a batch of the slab's windows: a slice
        (first pass), a sorted array of their indices (a settling pass chosen on the host) or ``Chosen`` ones
        (a settling pass chosen on the device: fused kernels, tridiagonal eigensolver, no centre rows). Returns
        the solver's ``info`` and, with ``settle``, the windows left unsettled (given weight 0 here); all on
        the device, no synchronisation. With ``refine`` (a block size: gathered path, a solver with all
        eigenvectors, m >= ``cusolver.REFINE_MIN_ORDER``) the patches and the Gram are float64, the eigensolver
        runs on the Gram rounded to ``dtype``, and the eigenvalues at both ends of the spectrum are refined in
        float64 (``ProjectorFromVectors.refine``): their far smaller error leaves far fewer windows unsettled on
        long series. With ``refine`` and ``GPURun.leading``, only the leading eigenpairs are found, in float64
        (``ProjectorFromVectors.leading``): a window settles within their error bounds."""
        run, n_volumes = self.run, self.volume.shape[1]
        selection = self._select(windows)
        # no demeaning in float32 with the tridiagonal kernels: the Gram of the undemeaned patch is
        # n mu mu^T + (the volume-demeaned Gram), exactly; the kernels take the second and the rank-one term
        # apart (``TridiagonalEigh.values(rank_one=...)``), so the patch's mean costs no precision
        rank_one = run.mean_apart and dtype == torch.float32
        grams, n_took_part, volume_mean, gathered = self._grams(windows, selection, dtype, fused, refine, rank_one)
        # removing a mean costs one degree of freedom: along time (voxel) or along the voxels (volume)
        usable_voxels = n_took_part - 1 if run.demean == "volume" else n_took_part
        usable_volumes = n_volumes - int(run.demean == "voxel")
        given = self._given_variance(selection, len(grams))
        leading = bool(refine) and run.leading
        if leading:
            values, info, bounds = run.solver.leading(grams, usable_voxels.clamp(max=usable_volumes))
            kept_block, scale = cusolver.LEADING_KEEP, None  # (float64: the largest eigenvalue scales)
            delta = (leading_uncertainty(values, bounds, usable_voxels, usable_volumes, run.options.estimator, given)
                     if settle else None)
        else:
            values, info, scale = eigenvalues_of(run.solver, grams, dtype, refine, rank_one, n_took_part,
                                                 volume_mean, selection.count)
            kept_block = refine
            # refined eigenvalues settle with their own small slack where the decision reads the spectrum's ends
            refined = refine and (run.noise_variance is not None
                                  or run.options.estimator in threshold.REFINED_ESTIMATORS)
            delta = (rounding_uncertainty(values, threshold.REFINED_SETTLE_SLACK if refined else run.settle_slack,
                                          scale) if settle else None)
        patch_rank, sigma2, unsettled = threshold_on_device(values, usable_voxels, usable_volumes,
                                                            run.options.estimator, delta, given)
        edge = None
        if run.options.lambda_plus:  # the edge the threshold placed, at its own P (before a filter recounts it)
            edge = marchenko_pastur_edge(sigma2, patch_rank, usable_voxels, usable_volumes,
                                         None if run.noise_variance is not None else run.options.estimator)
        weights = near_cut = None
        if run.options.filter != "hard" and delta is None:  # the noise level as known: the weights decide
            weights = component_weights(values, usable_voxels, usable_volumes, sigma2, run.options.filter)
        elif run.options.filter != "hard":  # settled: an eigenvalue within reach of the filter's cut too
            weights, near_cut = component_weights(values, usable_voxels, usable_volumes, sigma2,
                                                  run.options.filter, delta)
        if weights is not None:
            patch_rank = (weights > 0).sum(dim=1)
        keep = info == 0
        if selection.asked is not None:  # the places past the count hold no window (their numbers are unwritten)
            keep &= selection.asked
        if settle:
            if near_cut is not None:
                unsettled |= near_cut
            if kept_block:
                unsettled |= patch_rank >= kept_block - threshold.REFINE_GUARD
            if rank_one or run.noise_variance is not None or weights is not None:
                # (a given level may cut inside the noise bulk, where float32 mixes the eigenvectors on both
                # sides of the cut: such windows are redone in float64)
                unsettled |= unresolved_projectors(values, patch_rank,
                                                   values[:, -1].clamp(min=0) if scale is None else scale)
            keep &= ~unsettled
            self._record_verdicts()
        # the gathered path applies a block's few vectors as two thin products (``signal_factors``)
        factors = (run.solver.projector_factors(patch_rank, weights)
                   if gathered is not None and isinstance(run.solver, ProjectorFromVectors) else None)
        projector = run.solver.projector(patch_rank, weights) if factors is None else factors
        if run.center:
            patch_weight = keep.to(torch.float32)
        else:  # where, not a product: a place left unwritten may hold any number
            patch_weight = torch.where(keep, aggregation_weights(patch_rank, run.options.mean_parameters,
                                                                 run.options.aggregation)
                                       * selection.multiplicity, 0.0).to(torch.float32)
        edge_addend = self._lambda_plus_addend(selection, patch_weight, edge) if edge is not None else None
        self._reconstruct(windows, selection, fused, gathered, volume_mean if not rank_one else None, projector,
                          patch_weight, torch.sqrt(sigma2).to(torch.float32), patch_rank.to(torch.float32))
        if edge_addend is not None:
            self.add_lambda_plus(*edge_addend)
        return info, unsettled

    def _lambda_plus_addend(self, selection, patch_weight, edge):
        """(rows, values, replace) of the windows' lambda_+ ``edge`` (B,) for the sums, made before anything is
        added (a batch that runs out of memory is redone): for ``center`` each centre's own window's, to write,
        else w * lambda_+ for every finite voxel of each window, to add (as the kernels add w * sigma)."""
        run = self.run
        kept = patch_weight != 0  # (where, not a product: a window left out may hold any number)
        if run.center:
            rows, own_window, _ = selection.centres
            values = torch.where(kept, patch_weight * edge, 0.0)[own_window]
            return rows, values.to(torch.float32), True
        base = selection.base
        if selection.asked is not None:  # the places past the count hold no window: any row will do there
            base = torch.where(selection.asked, base, torch.zeros_like(base))
        voxels = base[:, None].to(torch.int64) + run.voxel_offsets[None, :].to(torch.int64)
        values = torch.where(kept, patch_weight * edge, 0.0)[:, None] * self.finite[voxels]
        return voxels.reshape(-1), values.reshape(-1).to(torch.float32), False

    def add_lambda_plus(self, rows, values, replace):
        """Write (``replace``) or add a batch's lambda_+ ``values`` into the sums' rows."""
        if replace:
            self.sums.lambda_plus[rows] = values
        else:
            self.sums.lambda_plus.index_add_(0, rows, values)

    def _grams(self, windows, selection, dtype, fused, refine, rank_one):
        """Step 1 of ``batch``: the Gram matrices (B, m, m), the voxels that took part (B,), and the patches'
        mean time courses (fused kernels, volume demeaning) or the gathered path's (patches, means, took_part,
        voxels) for its reconstruction (else None)."""
        run, n_voxels = self.run, self.run.voxel_offsets.numel()
        if self.box_gram is not None and isinstance(windows, slice) and dtype == torch.float32:  # first pass
            grams = self.box_gram[windows].clone()  # the solver overwrites it; a retried batch needs it whole
            return grams, torch.full((len(grams),), n_voxels, dtype=torch.int32, device=run.device), None, None
        if fused:
            grams, n_took_part, volume_mean = gram(self.volume, self.finite, selection.base, run.voxel_offsets,
                                                   demean="volume" if rank_one else run.demean, dtype=dtype,
                                                   count=selection.count)
            return grams, n_took_part, volume_mean, None
        grams, *gathered = gather_gram(self.volume, self.finite, selection.base, run.voxel_offsets, run.demean,
                                       torch.float64 if refine else dtype, n_voxels >= self.volume.shape[1])
        return grams, gathered[2].sum(dim=1).to(torch.int32), None, gathered

    def _given_variance(self, selection, batch):
        """(B,) float64: each window's given noise variance (``DenoiseOptions.noise_variance``), or None when
        the noise is estimated. A map's is the mean of sigma^2 over the window's finite voxels that have a
        value (the map is 0 where a voxel outside the mask had none), as ``cpu.given_noise_variance``."""
        given = self.run.noise_variance
        if given is None:
            return None
        if not self.run.noise_map:
            return given.expand(batch)
        base = selection.base
        if selection.asked is not None:  # the places past the count hold no window: any row will do there
            base = torch.where(selection.asked, base, torch.zeros_like(base))
        voxels = base[:, None].to(torch.int64) + self.run.voxel_offsets[None, :].to(torch.int64)
        values = self.noise_rows[voxels]
        counted = (self.finite[voxels] > 0) & (values > 0)
        return torch.where(counted, values, 0.0).sum(dim=1) / counted.sum(dim=1).clamp(min=1)

    def _select(self, windows) -> _Selection:
        """The batch's windows (see ``batch``) as the kernels take them."""
        run, device = self.run, self.run.device
        if isinstance(windows, Chosen):
            return _Selection(windows.base, windows.multiplicity, windows.asked, windows.count)
        if isinstance(windows, slice):
            selection = _Selection(self.base[windows], self.multiplicity[windows])
            if run.center:
                a, b = np.searchsorted(self.centre_window_host, [windows.start, windows.stop])
                selection.centres = (self.centre_voxel[a:b], self.centre_window[a:b] - windows.start,
                                     self.centre_position[a:b])
            return selection
        index = to_device(windows, device)
        selection = _Selection(self.base[index], self.multiplicity[index], index=index)
        if run.center:
            chosen = np.flatnonzero(np.isin(self.centre_window_host, windows))
            own = np.searchsorted(windows, self.centre_window_host[chosen]).astype(np.int32)
            chosen = to_device(chosen, device)
            selection.centres = (self.centre_voxel[chosen], to_device(own, device), self.centre_position[chosen])
        return selection

    def _record_verdicts(self):
        """With the settling pass on the device beside the first pass: the verdicts are known, so that pass
        may start (an event of the graph's own while captured: each replay records it there)."""
        run = self.run
        if run.side is not None and run.settles_on_device(self.n_volumes):
            self.verdicts_ready = torch.cuda.Event(external=self.capturing)
            self.verdicts_ready.record(torch.cuda.current_stream(run.device))

    def _reconstruct(self, windows, selection, fused, gathered, volume_mean, projector, patch_weight, patch_sigma,
                     patch_rank):
        """Step 4 of ``batch``: the windows' weighted projections into the box or the sums."""
        run, sums = self.run, self.sums
        if self.box is not None and not isinstance(windows, Chosen):
            # the first pass, and a settling pass chosen on the host: its windows replace their projectors
            self.box.add_windows(windows if isinstance(windows, slice) else selection.index,
                                 projector.to(torch.float32), patch_weight, patch_sigma, patch_rank)
        elif fused:  # (a settling pass chosen on the device adds its windows here with the box sums too)
            # (float64 read as it is: a launch sized for every window would convert them all)
            projector = projector.contiguous()
            if run.center:
                rows, own_window, _ = selection.centres
                reconstruction.reconstruct_centres(self.volume, rows, own_window, projector.to(torch.float32),
                                                   patch_weight, patch_sigma, patch_rank, *sums.tensors(),
                                                   demean=run.demean, volume_mean=volume_mean)
            else:
                reconstruction.reconstruct_accumulate(self.volume, self.finite, selection.base, run.voxel_offsets,
                                                      projector, patch_weight, patch_sigma, patch_rank,
                                                      *sums.tensors(), demean=run.demean, volume_mean=volume_mean,
                                                      voxel_scale=run.voxel_scale)
        else:
            _add_gathered(run, sums, selection, gathered, projector, patch_weight, patch_sigma, patch_rank)


def _add_gathered(run, sums, selection, gathered, projector, patch_weight, patch_sigma, patch_rank):
    """The gathered path's reconstruction (torch): each patch times its projector (a matrix, or the two
    factors of one: ``ProjectorFromVectors.projector_factors``), the means put back,
    written at the centre rows or added with the windows' weights into the sums. Every addend is made before
    the first is added."""
    patches, means, took_part, voxels = gathered
    n_volumes = patches.shape[2]
    time_side = patches.shape[1] >= n_volumes  # the Gram's side: the projector acts on time, else on voxels
    if isinstance(projector, tuple):  # (V diag(w), V): two thin products
        kept, vectors = (factor.to(patches.dtype) for factor in projector)
        restored = (patches @ kept) @ vectors.mT if time_side else kept @ (vectors.mT @ patches)
    else:
        projector = projector.to(patches.dtype)
        restored = patches @ projector if time_side else projector @ patches
    if means is not None:
        restored = restored + means
    if run.center:
        rows, own_window, own_position = selection.centres
        w = patch_weight[own_window]
        values = (restored[own_window, own_position].to(torch.float32) * w[:, None], w,
                  w * patch_sigma[own_window], w * patch_rank[own_window])
        for target, value in zip(sums.tensors(), values):
            target[rows] = value
        return
    voxel_weight = patch_weight[:, None] * took_part
    if run.voxel_scale is not None:
        voxel_weight = voxel_weight * run.voxel_scale.to(voxel_weight.dtype)
    addends = ((restored * voxel_weight[:, :, None]).reshape(-1, n_volumes).to(torch.float32),
               voxel_weight.reshape(-1), (voxel_weight * patch_sigma[:, None]).reshape(-1),
               (voxel_weight * patch_rank[:, None]).reshape(-1))
    flat = voxels.reshape(-1)
    for target, addend in zip(sums.tensors(), addends):
        target.index_add_(0, flat, addend)


def leading_uncertainty(values, bounds, usable_voxels, usable_volumes, estimator, given):
    """(B, 1): how far the eigenvalues a window's rank reads may be from the true ones, for leading eigenpairs
    (``ProjectorFromVectors.leading``'s ``values`` and ``bounds``): the largest bound among the rank's
    components and the two below them (the first noise eigenvalues, which the estimator tests), the rank as
    the values give it."""
    rank, _, _ = threshold_on_device(values, usable_voxels, usable_volumes, estimator, None, given)
    keep = bounds.shape[1]
    index = torch.arange(keep, device=bounds.device)[None, :]
    read = index >= keep - (rank + 2).clamp(max=keep)[:, None]
    return torch.where(read, bounds, 0.0).amax(dim=1, keepdim=True)


def eigenvalues_of(solver, grams, dtype, refine, rank_one, n_took_part, volume_mean, count=None):
    """The eigen step's first half: eigenvalues (B, m) float64 ascending, ``info`` and the scale of their
    float32 error (None: the largest eigenvalue). ``refine`` (a block size): the float64 ``grams`` solved
    rounded to ``dtype``, both ends refined in float64. ``rank_one``: ``grams`` are the volume-demeaned Grams
    and n mu mu^T (``volume_mean`` mu, ``n_took_part`` n) is added as a rank-one term; the error scale is then
    the demeaned Gram's norm. ``count``: only the first ``count`` are solved (the tridiagonal kernels;
    ``Chosen`` batches)."""
    if refine:
        values, info = solver.values(grams.to(dtype))
        values, refine_info = solver.refine(grams, refine)
        return values, info | refine_info, None
    if rank_one:
        scale = torch.linalg.matrix_norm(grams).to(torch.float64)  # before the solver overwrites it
        mean = volume_mean.to(torch.float64)
        norm2 = (mean * mean).sum(dim=1)
        direction = mean / norm2.sqrt().clamp(min=torch.finfo(torch.float64).tiny)[:, None]
        values, info = solver.values(grams, rank_one=(direction, n_took_part.to(torch.float64) * norm2))
        return values.to(torch.float64), info, scale
    values, info = solver.values(grams) if count is None else solver.values(grams, count=count)
    return values.to(torch.float64), info, None
