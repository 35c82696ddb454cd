"""How a series lies in memory, and the copies between its two orders.

A 4D series (X, Y, Z, T) is held either voxel after voxel (*voxel-major*: C order, each voxel's time course
contiguous: the (V, T) rows the engines compute on) or volume after volume (*volume-major*: Fortran order, as
NIfTI stores it and nibabel reads or maps it). ``denoise`` takes either and returns the caller's order, so a
series read from a file and written back is never transposed as a whole: the engines reorder what they copy
anyway (the GPU's staging of the series, the CPU's shared copy of it) and the output is written in the
caller's order as it is assembled.

A whole-array transpose between the orders (``numpy.ascontiguousarray`` of a volume-major series) reads one
value per cache line and took 2.5 s for a 96x96x60x300 series on the 2-core development machine (4.1 s on
the 16-core GPU machine's host); the blocked copies here read and write whole cache lines and took 0.43 s
on one thread there.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import threading

import numpy as np

from .backend import available_cpus

#: Volumes per block of a copy between the orders: each block writes runs of this many values per voxel
#: and reads, per volume, runs of the x-planes copied (measured on 96x96x60x300: 0.43 s with 64, 0.50 with 32).
BLOCK_VOLUMES = 64
#: Threads of a copy between the orders, at most (it is bound by memory bandwidth beyond a few).
COPY_THREADS = 8
#: Values a thread copies at least (fewer: fewer threads).
COPY_MIN_VALUES = 1 << 20

_pool = None
_pool_lock = threading.Lock()


def is_volume_major(data: np.ndarray) -> bool:
    """Whether the 4D ``data`` lies volume after volume (Fortran order), as nibabel gives a NIfTI series."""
    return data.ndim == 4 and data.flags.f_contiguous and not data.flags.c_contiguous


def as_float32(data) -> np.ndarray:
    """``data`` as a contiguous float32 array, copied only where it is not one, keeping its order (a
    volume-major series stays volume-major; anything not contiguous becomes voxel-major)."""
    data = np.asarray(data)
    if data.dtype == np.float32 and (data.flags.c_contiguous or data.flags.f_contiguous):
        return data
    return np.asarray(data, dtype=np.float32, order="F" if is_volume_major(data) else "C")


def empty_like_series(data: np.ndarray) -> np.ndarray:
    """An uninitialised float32 array of ``data``'s shape and order."""
    return np.empty(data.shape, dtype=np.float32, order="F" if is_volume_major(data) else "C")


def padded_series(data: np.ndarray, finite: np.ndarray, padding: int):
    """(``data``, ``finite``) padded by ``padding`` voxels on each side of the three spatial axes: the series
    with zeros there, in its own order, and the flags False there (padding takes part in no patch). As they
    are where ``padding`` is 0.

    What it costs: a copy of the series on the padded grid, (X + 2p)(Y + 2p)(Z + 2p) T float32 values (1.4
    times a 96x96x60 series' for p = 5), held while the backend runs."""
    if not padding:
        return data, finite
    inside = (slice(padding, -padding),) * 3
    padded = np.zeros(tuple(s + 2 * padding for s in data.shape[:3]) + data.shape[3:], dtype=data.dtype,
                      order="F" if is_volume_major(data) else "C")
    padded[inside] = data
    return padded, np.pad(finite, padding)


class _GatheredRows:
    """(V, T) rows of a volume-major series, indexed by flat voxel number (C order) as the array of rows
    would be: ``rows[voxels]`` gathers those voxels' time courses, of shape ``voxels.shape + (T,)``."""

    def __init__(self, data):
        self.data, self.shape = data, (int(np.prod(data.shape[:3])), data.shape[3])

    def __getitem__(self, voxels):
        return self.data[np.unravel_index(voxels, self.data.shape[:3])]


def voxel_rows(data: np.ndarray):
    """The 4D ``data`` as (V, T) rows to gather voxels' time courses from (``rows[voxels]``): a view of
    voxel-major data; for volume-major data, an object that gathers from it without copying the rest (for a
    few windows; a whole pass copies the rows once with ``rows_of_planes``)."""
    if data.flags.c_contiguous:
        return data.reshape(-1, data.shape[3])
    return _GatheredRows(data)


def rows_of_planes(data: np.ndarray, planes: slice, out: np.ndarray, threads: int | None = None,
                   z_planes: slice | None = None):
    """x-planes ``planes`` of the 4D ``data`` (either order) into ``out``: their rows, (planes * Y * Z, T)
    contiguous float32 (the voxel-major order), on threads (volume-major data in blocks). ``z_planes``: only
    the rows of those z-planes, on the calling thread (a part of a copy split by the caller)."""
    selected = data[planes]
    out4 = out.reshape(selected.shape)
    if not is_volume_major(data):  # rows to rows: x-planes on threads
        if z_planes is not None:
            np.copyto(out4[:, :, z_planes], selected[:, :, z_planes])
        else:
            in_parts(lambda xs: np.copyto(out4[xs], selected[xs]), out4.shape[0], out4.size, threads)
        return out
    source = selected.transpose(3, 2, 1, 0)  # (T, Z, Y, planes): contiguous runs along x

    def copy_z(zs):
        for z in range(zs.start, zs.stop):
            for t0 in range(0, source.shape[0], BLOCK_VOLUMES):
                block = slice(t0, t0 + BLOCK_VOLUMES)
                out4[:, :, z, block] = source[block, z].transpose(2, 1, 0)

    if z_planes is not None:
        copy_z(slice(*z_planes.indices(out4.shape[2])[:2]))
    else:
        in_parts(copy_z, out4.shape[2], out4.size, threads)
    return out


def planes_of_rows(rows: np.ndarray, out: np.ndarray, planes: slice = slice(None), divisor=None,
                   threads: int | None = None):
    """The reverse of ``rows_of_planes``: the rows (planes * Y * Z, T) written into x-planes ``planes`` of the 4D
    ``out`` (either order), each row divided by its ``divisor`` (planes * Y * Z,) when given; on threads
    (volume-major ``out`` in blocks)."""
    target = out[planes]
    rows4 = rows.reshape(target.shape)
    scale = None if divisor is None else np.asarray(divisor).reshape(target.shape[:3] + (1,))
    if not is_volume_major(out):  # rows to rows: x-planes on threads

        def copy_x(xs):
            if scale is None:
                np.copyto(target[xs], rows4[xs])
            else:
                np.divide(rows4[xs], scale[xs], out=target[xs], casting="unsafe")

        in_parts(copy_x, target.shape[0], target.size, threads)
        return out
    destination = target.transpose(3, 2, 1, 0)  # (T, Z, Y, planes)

    def copy_z(zs):
        for z in range(zs.start, zs.stop):
            for t0 in range(0, destination.shape[0], BLOCK_VOLUMES):
                block = slice(t0, t0 + BLOCK_VOLUMES)
                values = rows4[:, :, z, block]
                into = destination[block, z].transpose(2, 1, 0)
                if scale is None:
                    np.copyto(into, values)
                else:
                    np.divide(values, scale[:, :, z], out=into, casting="unsafe")

    in_parts(copy_z, rows4.shape[2], rows4.size, threads)
    return out


def in_parts(work, n_planes: int, n_values: int, threads: int | None = None):
    """``work(slice of planes)`` over ``n_planes`` planes (z-planes, or x-planes of voxel-major data; any
    independent pieces of work), split among threads (NumPy's copies, ufuncs, FFTs and interpolation release
    the GIL): at most ``COPY_THREADS``, ``threads`` or else the CPUs this process may use and one per
    ``COPY_MIN_VALUES`` of the ``n_values`` the work touches. The threads are one pool for the process, so
    ``work`` must not wait for another ``in_parts`` itself."""
    global _pool
    if threads is None:
        threads = min(COPY_THREADS, available_cpus(), max(1, n_values // COPY_MIN_VALUES))
    threads = max(1, min(threads, n_planes))
    if threads == 1:
        work(slice(0, n_planes))
        return
    bounds = np.linspace(0, n_planes, threads + 1).astype(int)
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="mppca-layout")
    for done in [_pool.submit(work, slice(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])]:
        done.result()
