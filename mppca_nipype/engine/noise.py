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
from .cpu import (NO_CLOCK, add_window_maps, batch_size, first_pass_dtype, run_units, settled_spectra, slab_voxels,
                  unit_slab, window_voxel_weights)


def noise_unit(volume, finite, plan, options, unit, sums, clock=NO_CLOCK):
    """The noise and rank of one unit's windows (``cpu.run_unit``'s way, with no image): for ``center`` each
    centre voxel's own window's, written into ``sums``; else the windows' weighted sums over the unit's slab,
    returned for the caller to add in its rows' turns."""
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
        return None

    slab = unit_slab(unit, plan, volume.shape[1], image=False, lambda_plus=False)
    for start in range(unit.start, unit.stop, step):
        stop = min(start + step, unit.stop)
        spectra = settled_spectra(volume, finite, plan, options, slice(start, stop), clock, dtype)
        voxel_weight = window_voxel_weights(spectra, options, plan, start, stop)
        add_window_maps(slab[1:], spectra, voxel_weight, slab_voxels(plan, unit, slice(start, stop)))
    return slab


def noise_cpu(data, finite, plan, options, *, nprocs=None, progress=None) -> PatchSums:
    """Run the plan's windows for their noise and rank only; the per-voxel sums (``image`` is None)."""
    sums = run_units(noise_unit, data, finite, plan, options, nprocs=nprocs, progress=progress, image=False)
    sums.info.update(eigensolver="LAPACK sytrd/sterf", gram_precision=np.dtype(first_pass_dtype(options)).name)
    return sums
