"""The noise map alone, on the CPU: per window the Gram matrix, its eigenvalues and the threshold; no
eigenvector and no reconstruction.

The windows, their batches, the worker processes and the order in which their sums are added are the CPU
engine's (``cpu.window_spectra``, ``cpu.batch_size``, ``cpu.run_units``), and the noise and rank of each
window are aggregated to voxels as ``cpu.run_unit`` aggregates them: at the same options the maps are
bit-identical to ``denoise``'s.
"""

from __future__ import annotations

import time

import numpy as np

from .backend import PatchSums, available_cpus
from .cpu import _process_context, batch_size, run_units, window_spectra, work_units
from .estimators import aggregation_weights


def noise_unit(volume, finite, plan, options, unit):
    """The noise and rank sums of one unit's windows: ``(centre voxels, sigma, rank)`` for ``center``, else
    ``(slab start, weight, sigma, rank)`` over the unit's slab of ``extent[0]`` x-planes."""
    step = batch_size(plan.patch_size, volume.shape[1])
    if options.aggregation == "center":
        first, last = np.searchsorted(plan.centre_window, [unit.start, unit.stop])
        sigma = np.empty(last - first)
        rank = np.empty(last - first)
        for start in range(unit.start, unit.stop, step):
            stop = min(start + step, unit.stop)
            a, b = np.searchsorted(plan.centre_window, [start, stop])
            spectra = window_spectra(volume, finite, plan, options, slice(start, stop))
            window = plan.centre_window[a:b] - start
            sigma[a - first:b - first] = np.sqrt(spectra.sigma2[window])
            rank[a - first:b - first] = spectra.rank[window]
        return plan.centre_voxel[first:last], sigma, rank

    plane = plan.spatial_shape[1] * plan.spatial_shape[2]
    slab_start = unit.x0 * plane
    slab_voxels = plan.extent[0] * plane
    weight = np.zeros(slab_voxels)
    sigma = np.zeros(slab_voxels)
    rank = np.zeros(slab_voxels)
    for start in range(unit.start, unit.stop, step):
        stop = min(start + step, unit.stop)
        spectra = window_spectra(volume, finite, plan, options, slice(start, stop))
        w = aggregation_weights(spectra.rank, options.demeaned, options.aggregation) * plan.multiplicity[start:stop]
        voxel_weight = w[:, None] * spectra.took_part  # (B, n): left-out voxels receive nothing
        flat = (spectra.voxels - slab_start).ravel()
        weight += np.bincount(flat, voxel_weight.ravel(), slab_voxels)
        sigma += np.bincount(flat, (voxel_weight * np.sqrt(spectra.sigma2)[:, None]).ravel(), slab_voxels)
        rank += np.bincount(flat, (voxel_weight * spectra.rank[:, None]).ravel(), slab_voxels)
    return slab_start, weight, sigma, rank


def noise_cpu(data, finite, plan, options, *, nprocs=None, progress=None) -> PatchSums:
    """Run the plan's windows for their noise and rank only; the per-voxel sums (``image`` is None)."""
    started = time.perf_counter()
    n_voxels = int(np.prod(data.shape[:3]))
    finite_flat = finite.reshape(n_voxels)
    units = work_units(plan)
    nprocs = min(nprocs or available_cpus(), max(len(units), 1))
    context = _process_context(nprocs)
    if context is None:
        nprocs = 1
    weight = np.zeros(n_voxels)
    sigma = np.zeros(n_voxels)
    rank = np.zeros(n_voxels)

    def add(result):
        if options.aggregation == "center":
            voxel, s, r = result
            weight[voxel] = 1.0
            sigma[voxel] = s
            rank[voxel] = r
        else:
            start, slab_weight, slab_sigma, slab_rank = result
            stop = start + len(slab_weight)
            weight[start:stop] += slab_weight
            sigma[start:stop] += slab_sigma
            rank[start:stop] += slab_rank

    run_units(noise_unit, data, finite_flat, plan, options, units, nprocs=nprocs, context=context, add=add,
              progress=progress)
    return PatchSums(None, weight, sigma, rank,
                     info=dict(backend="cpu", device="cpu", nprocs=nprocs, eigensolver="LAPACK dsytrd/dsterf",
                               seconds_engine=time.perf_counter() - started))
