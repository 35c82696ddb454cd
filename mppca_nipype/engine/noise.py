"""The noise map alone, on the CPU: per window the Gram matrix, its eigenvalues and the threshold; no
eigenvector and no reconstruction.

The windows, their batches, the worker processes and the order in which their sums are added are the CPU
engine's (``cpu.settled_spectra``, ``cpu.batch_size``, ``cpu.run_units``), and the noise and rank of each
window are aggregated to voxels as ``cpu.run_unit`` aggregates them: at the same options the maps are
bit-identical to ``denoise``'s.
"""

from __future__ import annotations

import numpy as np

from .backend import PatchSums
from .cpu import (NO_CLOCK, add_window_maps, batch_size, deposit, first_pass_dtype, run_units, settled_spectra,
                  slab_turns, window_voxel_weights)


def noise_unit(volume, finite, plan, options, unit, sums, turns, clock=NO_CLOCK):
    """The noise and rank of one unit's windows, into ``sums`` (``cpu.run_unit``'s way, with no image): for
    ``center`` each centre voxel's own window's; else the windows' weighted sums over the unit's slab of
    ``extent[0]`` x-planes, added plane by plane in the planes' turns."""
    step = batch_size(plan.patch_size, volume.shape[1])
    dtype = first_pass_dtype(options)
    if options.aggregation == "center":
        for start in range(unit.start, unit.stop, step):
            stop = min(start + step, unit.stop)
            a, b = np.searchsorted(plan.centre_window, [start, stop])
            spectra = settled_spectra(volume, finite, plan, options, slice(start, stop), clock, dtype)
            window = plan.centre_window[a:b] - start
            voxel = plan.centre_voxel[a:b]
            sums.weight[voxel] = 1.0
            sums.sigma[voxel] = np.sqrt(spectra.sigma2[window])
            sums.rank[voxel] = spectra.rank[window]
        return

    plane = plan.spatial_shape[1] * plan.spatial_shape[2]
    slab_start = unit.x0 * plane
    slab_voxels = plan.extent[0] * plane
    weight = np.zeros(slab_voxels)
    sigma = np.zeros(slab_voxels)
    rank = np.zeros(slab_voxels)
    with slab_turns(unit, plan, turns) as pending:
        for start in range(unit.start, unit.stop, step):
            stop = min(start + step, unit.stop)
            spectra = settled_spectra(volume, finite, plan, options, slice(start, stop), clock, dtype)
            voxel_weight = window_voxel_weights(spectra, options, plan, slice(start, stop))
            add_window_maps((weight, sigma, rank), spectra, voxel_weight, slab_start)
        deposit(unit, plan, sums, (None, weight, sigma, rank), turns, clock, pending)


def noise_cpu(data, finite, plan, options, *, nprocs=None, progress=None) -> PatchSums:
    """Run the plan's windows for their noise and rank only; the per-voxel sums (``image`` is None)."""
    sums = run_units(noise_unit, data, finite, plan, options, nprocs=nprocs, progress=progress, image=False)
    sums.info.update(eigensolver="LAPACK sytrd/sterf", gram_precision=np.dtype(first_pass_dtype(options)).name)
    return sums
