"""The extra maps ``denoise`` computes on request: each patch's Marchenko-Pastur upper edge (``lambda_plus``,
aggregated by the backends as they aggregate sigma) and the variance each voxel lost (``variance_removed``,
from the arrays alone, whichever backend ran).
"""

from __future__ import annotations

import numpy as np

from .errors import MPPCAInputError
from .layout import in_parts

#: The maps ``denoise(maps=...)`` can add to its result, each an attribute of ``DenoiseResult``.
MAPS = ("lambda_plus", "variance_removed")

#: Bytes of the series ``removed_variance`` reads per block of x-planes (its float64 temporaries are twice
#: that).
RESIDUAL_BLOCK_BYTES = 32 << 20


def resolve_maps(maps) -> tuple[str, ...]:
    """The extra maps asked for, as a tuple of names from ``MAPS`` (one name, or an iterable of them; None
    or empty: none); raises MPPCAInputError for any other."""
    if maps is None:
        return ()
    names = (maps,) if isinstance(maps, str) else tuple(maps)
    unknown = [name for name in names if name not in MAPS]
    if unknown:
        raise MPPCAInputError(f"maps must be among {', '.join(MAPS)}, not {unknown[0]!r}")
    return tuple(name for name in MAPS if name in names)


def removed_variance(data, denoised, served) -> np.ndarray:
    """(X, Y, Z) float32: the mean over volumes of (input - denoised)^2 at each ``served`` voxel, 0 elsewhere.

    The variance of what denoising took out of each voxel's time course, in the data's units squared, to read
    beside ``sigma ** 2``: where only noise was removed it is a little under sigma^2 (the kept components
    keep some noise). Summed in float64, a block of x-planes at a time (no temporary of the whole series),
    the blocks spread over threads (``layout.in_parts``; each block's sums are the same on any number).
    """
    shape3 = data.shape[:3]
    out = np.zeros(shape3, dtype=np.float32)
    plane_bytes = max(int(np.prod(data.shape[1:])) * data.dtype.itemsize, 1)
    step = max(1, RESIDUAL_BLOCK_BYTES // plane_bytes)

    def blocks(numbers):
        with np.errstate(invalid="ignore", over="ignore"):  # (non-finite voxels are not served: 0 below)
            for x0 in range(numbers.start * step, min(numbers.stop * step, shape3[0]), step):
                block = slice(x0, x0 + step)
                residual = np.subtract(data[block], denoised[block], dtype=np.float64)
                out[block] = np.mean(np.square(residual, out=residual), axis=3)

    in_parts(blocks, -(-shape3[0] // step), data.size)
    out[~served] = 0
    return out
