"""The small series a warm-up denoises so that a machine's first real runs find their kernels compiled.

Triton compiles a kernel once for each set of values of its compile-time constants (``tl.constexpr``) and
keeps it in its cache folder (``use_kernel_cache``). The GPU engine's constants follow from the patch and the
options:

- the patch's voxel count n and volume count T: the fused Gram and reconstruction kernels (``gram``,
  ``reconstruction``: n, T and their block sizes), the eigen step and the threshold (m = min(n, T):
  ``tridiagonal``, ``threshold``); n comes from the extent, which "wide" and "auto" derive from T;
- the demeaning (``DEMEAN``), the Gram precision (``FP64``: a float32 first pass, its float64 settling pass),
  a counted launch (``COUNTED``: the settling pass chosen on the device), the rank-one term of an undemeaned
  float32 run (``RANK_ONE``), the estimator (``ESTIMATOR``) and the settling test (``SETTLE``);
- the path, from T (in a float32 first pass): up to 64 the tridiagonal kernels, up to 128 the fused kernels
  with XsyevBatched (no Triton kernel in the eigen step), beyond gathered patches and cuBLAS;
- for the box sums (voxel demeaning on a full grid) also the image's y and z sizes, which a warm-up cannot
  know.

Triton also specialises integer arguments on divisibility by 16 (the rows and windows a launch covers) and
pointers on 16-byte alignment, so each (options, T) runs on two grids: one whose voxel and window counts
are multiples of 16, one whose are both odd. A warm-up therefore serves the runs whose options and T it
ran; ``warm_up_runs`` lists those runs: each T of ``volumes`` in the options' mode (the defaults unless
given) and in dwidenoise's mode.
"""

from __future__ import annotations

from dataclasses import dataclass
import itertools
import math

import numpy as np

from ..patches import resolve_extent, window_positions

#: A grid larger than any patch: on it ``resolve_extent`` gives the extent a rule asks for, uncapped.
_UNCAPPED = (1001, 1001, 1001)

#: The sides a warm-up grid may take along an axis: the extent plus this many voxels, or more...
_MARGIN = 4
#: ...up to this many more.
_SIDES = 16


@dataclass(frozen=True)
class WarmUpRun:
    """One series of a warm-up: ``mode`` (what it is, for the report), the denoising ``options``, its grid
    ``shape`` and ``n_volumes``."""

    mode: str
    options: dict
    shape: tuple[int, int, int]
    n_volumes: int

    def series(self) -> np.ndarray:
        """The noisy series: a rank-5 signal on a baseline near 1000 plus noise (``phantoms``), so that
        some windows' ranks are near float32's limit and the settling pass runs too."""
        from ...phantoms import low_rank_phantom

        noisy, _ = low_rank_phantom(self.shape, self.n_volumes, seed=self.n_volumes)
        return noisy

    @property
    def label(self) -> str:
        return f"T={self.n_volumes}, {self.mode}, {'x'.join(map(str, self.shape))}"


def warm_up_grids(extent, stride) -> list[tuple[int, int, int]]:
    """The two smallest grids, with sides ``_MARGIN`` to ``_MARGIN + _SIDES - 1`` voxels beyond a patch of
    ``extent`` (three ints, so it is not capped), whose voxel count and count of windows at ``stride`` are
    multiples of 16 (the first) and both odd (the second)."""
    sides = [range(e + _MARGIN, e + _MARGIN + _SIDES) for e in extent]
    windows_along = [{side: len(window_positions(side, e, stride)) for side in axis}
                     for axis, e in zip(sides, extent)]

    def counts(shape):
        return math.prod(shape), math.prod(windows[side] for windows, side in zip(windows_along, shape))

    grids = []
    for wanted in (lambda voxels, windows: voxels % 16 == 0 and windows % 16 == 0,
                   lambda voxels, windows: voxels % 2 == 1 and windows % 2 == 1):
        grid = min((shape for shape in itertools.product(*sides) if wanted(*counts(shape))), key=math.prod,
                   default=None)
        if grid is not None:
            grids.append(tuple(int(side) for side in grid))
    return grids


def warm_up_runs(volumes, options=None) -> list[WarmUpRun]:
    """The series a warm-up denoises: for each T of ``volumes``, the options' mode (``options``: the keyword
    arguments of ``denoise``; the defaults when None) and dwidenoise's mode (with the estimator given, as
    dwidenoise's ``-estimator``), each on both ``warm_up_grids`` of the extent a full-size series of T takes."""
    from .. import DEFAULTS, DWIDENOISE_MODE

    given = options or {}
    options = dict(DEFAULTS, **given)
    dwidenoise = {**options, **DWIDENOISE_MODE, **{k: v for k, v in given.items() if k == "estimator"}}
    modes = [("the defaults" if options == DEFAULTS else "the options given", options)]
    if dwidenoise != options:
        modes.append(("dwidenoise's mode", dwidenoise))
    runs = []
    for n_volumes in volumes:
        for mode, mode_options in modes:
            extent = resolve_extent(mode_options["extent"], _UNCAPPED, n_volumes)
            runs += [WarmUpRun(mode, mode_options, shape, int(n_volumes))
                     for shape in warm_up_grids(extent, mode_options["stride"])]
    return runs
