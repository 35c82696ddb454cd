"""Batched symmetric eigensolver: cuSOLVER's ``cusolverDnXsyevBatched`` through nvmath-python.

The eigensolver of matrices the tridiagonal kernels do not take (m > 64 by default, float64 first passes)
and of the gathered path's long series, whose eigenvalues it refines in float64 (``ProjectorFromVectors.refine``)
or, on the longest, whose leading eigenpairs alone it finds (``ProjectorFromVectors.leading``).
One call decomposes a whole batch of m x m matrices on torch's current stream, with no host
synchronisation: the per-matrix ``info`` stays on the device; the settling pass reads it once, after the
first pass, and redoes failed matrices in float64, then on the CPU (``settling.settle_on_host``). Workspaces are cached per (batch, m, dtype).

``torch.linalg.eigh`` is the fallback when nvmath-python is missing (with a warning: on torch < 2.12 it
loops over the batch on the host for m > 32, ~75x slower on the seed's problem), and the only path for
tensors that are not on a CUDA device (the interpreter tests).
"""

from __future__ import annotations

import warnings

import torch

from ..errors import MPPCAWarning
from ..estimators import signal_factors, signal_projector

_CUDA_DATA_TYPE = {torch.float32: 0, torch.float64: 1}  # cudaDataType: CUDA_R_32F, CUDA_R_64F
_EIG_MODE_NOVECTOR, _EIG_MODE_VECTOR = 0, 1  # cusolverEigMode_t
_FILL_MODE_LOWER = 0  # cublasFillMode_t: CUBLAS_FILL_MODE_LOWER (the matrices are full, either half works)

#: Eigenvectors at each end of the spectrum whose Rayleigh-Ritz values in float64 replace a float32
#: eigensolve's eigenvalues (``ProjectorFromVectors.refine``): ``refine_block`` of them, at most this many.
REFINE_BLOCK = 64
#: Smallest matrix order the refinement serves (below, the blocks would leave too little room for the rank).
REFINE_MIN_ORDER = 64


#: The leading eigenpairs of the longest series' Grams (``ProjectorFromVectors.leading``): a block Krylov space
#: of ``LEADING_STEPS`` blocks of ``LEADING_BLOCK`` vectors (512 dimensions), of whose Ritz pairs the
#: ``LEADING_KEEP`` largest are kept. On multi-echo Grams (1,800 columns) the kept ones that the rank reads
#: came out within 2e-8 (relative) of float64 LAPACK's, with residuals below 1e-4 of the eigenvalue.
LEADING_BLOCK, LEADING_STEPS, LEADING_KEEP = 32, 16, 64
#: Smallest matrix order for ``leading``: measured on the H200 per 64 windows of 13^3 voxels, the full
#: float32 eigensolve and its refinement took 0.052 / 0.100 / 0.179 / 0.450 s at m = 600 / 900 / 1,200 /
#: 1,800 against the Krylov space's 0.056 / 0.058 / 0.057 / 0.058 s (benchmarks/gpu_leading_eigenpairs.py).
LEADING_MIN_ORDER = 768
#: The fewest float64 roundings of the largest eigenvalue a kept Ritz value's bound says (its rounding error
#: on a converged pair: measured up to ~3).
LEADING_ROUNDINGS = 16
#: The random starting block's seed: a window gives the same answer in every run and any batch.
LEADING_SEED = 2016


def leading_width() -> int:
    """The dimensions of ``ProjectorFromVectors.leading``'s Krylov space."""
    return LEADING_BLOCK * LEADING_STEPS


def refine_block(m: int) -> int:
    """Eigenvectors refined at each end of an m x m spectrum: ``REFINE_BLOCK``, or half the spectrum."""
    return min(REFINE_BLOCK, m // 2)


def _load_cusolver():
    """nvmath's cuSOLVER bindings, or None (with the reason) when nvmath-python is missing."""
    try:
        from nvmath.bindings import cusolverDn
    except ImportError as err:
        return None, f"nvmath-python is not installed ({err})"
    except Exception as err:  # a broken install (missing CUDA library): same fallback, with the reason
        return None, f"nvmath-python could not be loaded ({type(err).__name__}: {err})"
    return cusolverDn, None


class ProjectorFromVectors:
    """The pipeline's two-step interface for a solver that returns all eigenvectors at once:
    ``values, info = solver.values(matrices)``, then ``solver.projector(rank)`` (B, m, m) onto the ``rank``
    leading eigenvectors of those matrices (``projector(rank, weights)``: V diag(w) V^T); in between, optionally, ``solver.refine`` (float64 eigenvalues
    at both ends of the spectrum, and Ritz vectors for the projector)."""

    def values(self, matrices):
        values, self._vectors, info = self(matrices)
        return values, info

    def projector(self, rank, weights=None):
        return signal_projector(self._vectors, rank, weights)

    def projector_factors(self, rank, weights=None):
        """``projector``'s two factors (``estimators.signal_factors``) where the solver keeps fewer eigenvectors
        than the matrices' order (``refine``'s and ``leading``'s blocks), else None."""
        if self._vectors.shape[-1] == self._vectors.shape[-2]:
            return None
        return signal_factors(self._vectors, rank, weights)

    def refine(self, matrices, block):
        """The eigenvalues of ``matrices`` (the matrices ``values`` saw, in float64) where the MP estimator
        reads them, refined in float64 from the eigenvectors found in the lower precision.

        The estimator's answer depends on the eigenvalues at the spectrum's two ends (the largest ones, down
        into the noise bulk's upper edge, and the smallest) and on sums that the trace fixes. A float32
        eigensolve gets every eigenvalue to ~eps ||A||, which on long series is more than the spacing of
        the bulk: its eigenvectors there are mixed over that band, so single Rayleigh quotients are no
        better. But a band of mixed vectors still spans the right
        subspace: Rayleigh-Ritz in float64 on the ``block`` lowest and the ``block`` highest eigenvectors
        (S^T A S, with S made orthonormal to second order, and its eigenvalues) gives both ends with an
        error second order in what leaks out of the block; the eigenvalues between keep their Rayleigh
        quotients v^T A v / v^T v (their sum, with the two blocks', is the trace). The top block's Ritz
        vectors replace the eigenvectors: ``projector`` then gives, in float64, projectors onto up to
        ``block`` leading eigenvectors (a float32 vector at the bulk's edge is as blurred as its eigenvalue).

        Returns the refined eigenvalues ascending (B, m) float64 and an ``info`` (B,) int32 that is nonzero
        where an eigensolve of the blocks failed. Needs m >= 2 ``block``.
        """
        vectors = self._vectors.to(torch.float64)
        m = vectors.shape[-1]
        products = matrices @ vectors
        quotients = (vectors * products).sum(dim=1) / (vectors * vectors).sum(dim=1)
        identity = torch.eye(block, dtype=torch.float64, device=vectors.device)
        ends, info = [], torch.zeros(len(vectors), dtype=torch.int32, device=vectors.device)
        for columns in (slice(0, block), slice(m - block, m)):
            basis = vectors[:, :, columns]
            half = 1.5 * identity - 0.5 * (basis.mT @ basis)  # S (I - (S^T S - I) / 2) is orthonormal to O(eps^2)
            ritz = half @ (basis.mT @ products[:, :, columns]) @ half
            values, ritz_vectors, failed = self((0.5 * (ritz + ritz.mT)).contiguous())
            ends.append(values)
            info |= failed
        self._vectors = basis @ (half @ ritz_vectors)  # the top block's Ritz vectors, ascending: (B, m, block)
        refined = torch.cat([ends[0], quotients[:, block:m - block], ends[1]], dim=1)
        return refined.sort(dim=1).values, info

    def leading(self, matrices, usable):
        """The ``LEADING_KEEP`` largest eigenpairs of float64 ``matrices`` (B, m, m) (not overwritten), by
        Rayleigh-Ritz on a block Krylov space of them, for estimators that read only the leading eigenvalues
        and the trace (``estimators.LEADING_ESTIMATORS``, a given noise level) and filters that keep only
        leading components.

        ``usable`` (B,) integers: each matrix's r, its top eigenvalues that are not null directions. Returns
        ``values`` (B, m) ascending in float64: the kept Ritz values on top, below them r - keep places
        that share the rest of the trace equally (so the estimators' sums over the smallest eigenvalues are
        exact up to any P the kept ones decide) and zeros; ``info`` (B,) int32, nonzero where the space
        broke down (r under ``LEADING_STEPS + 1`` blocks, or a block that lost its rank) or its eigensolve
        failed (those windows' values and vectors are 0: they are redone by the settling pass); and
        ``bounds`` (B, keep), how far each kept Ritz value may be from its eigenvalue: its residual norm
        ||A y - theta y||, or, where that is below half the distance to the next Ritz value, its square over
        that distance (the Kato-Temple estimate, which holds once the neighbours have converged). The Ritz
        vectors serve ``projector``.

        The space is built block by block, each block orthogonalised twice against all earlier ones and made
        orthonormal by Cholesky QR (twice), in float64: a random start, so no window can be deficient in a
        direction, fixed by ``LEADING_SEED`` and the same for every window.
        """
        batch, m, _ = matrices.shape
        block, steps, keep = LEADING_BLOCK, LEADING_STEPS, LEADING_KEEP
        width = leading_width()
        device = matrices.device
        generator = torch.Generator(device=device)
        generator.manual_seed(LEADING_SEED)
        basis = torch.empty((batch, m, width), dtype=torch.float64, device=device)
        products = torch.empty_like(basis)
        # one start for every window: a window's answer does not depend on its place in the batch
        start = torch.randn((m, block), generator=generator, dtype=torch.float64, device=device)
        current, failed = _orthonormal(start.expand(batch, m, block))
        for step in range(steps):
            columns = slice(step * block, (step + 1) * block)
            basis[:, :, columns] = current
            products[:, :, columns] = matrices @ current
            if step == steps - 1:
                break
            earlier = basis[:, :, :columns.stop]
            following = products[:, :, columns]
            for _ in range(2):  # (once is not enough in floating point: "twice is enough")
                following = following - earlier @ (earlier.mT @ following)
            current, broke = _orthonormal(following)
            failed |= broke
        projected = basis.mT @ products
        ritz_values, ritz_vectors, info = self((0.5 * (projected + projected.mT)).contiguous())
        usable = usable.to(device=device, dtype=torch.int64).reshape(-1)
        failed |= (info != 0) | (usable < width + block) | ~torch.isfinite(ritz_values).all(dim=1)
        top = ritz_vectors[:, :, width - keep:]
        top_values = ritz_values[:, width - keep:]
        vectors = basis @ top
        residual = torch.linalg.vector_norm(products @ top - vectors * top_values[:, None, :], dim=1)
        beside = ritz_values[:, width - keep - 1:]  # the kept ones and the Ritz value below them
        below = beside[:, 1:] - beside[:, :-1]
        above = torch.cat([below[:, 1:], torch.full_like(below[:, :1], float("inf"))], dim=1)
        gap = torch.minimum(below, above)
        bounds = torch.where(2 * residual < gap, residual * residual / gap.clamp(min=torch.finfo(gap.dtype).tiny),
                             residual)
        # (no closer than float64's own rounding of the largest: a converged residual says nothing below it)
        bounds = torch.maximum(bounds, LEADING_ROUNDINGS * torch.finfo(torch.float64).eps * top_values[:, -1:].abs())
        trace = matrices.diagonal(dim1=1, dim2=2).sum(dim=1)
        rest = (trace - top_values.sum(dim=1)) / (usable - keep).clamp(min=1).to(torch.float64)
        index = torch.arange(m, device=device)[None, :]
        values = torch.where(index >= (m - usable)[:, None], rest[:, None], torch.zeros((), dtype=torch.float64,
                                                                                         device=device))
        values[:, m - keep:] = top_values
        values = torch.where(failed[:, None], 0.0, values).sort(dim=1).values
        self._vectors = torch.where(failed[:, None, None], 0.0, vectors)
        bounds = torch.where(failed[:, None], 0.0, bounds)
        return values, failed.to(torch.int32), bounds


def _orthonormal(block):
    """(Q, failed): ``block`` (B, m, b) made orthonormal by Cholesky QR, twice (the second pass mends what
    the first lost to the block's conditioning), and (B,) bool where a Cholesky factorisation failed; there
    Q is 0, so that the failed window's later products stay finite (its results are discarded)."""
    failed = torch.zeros(block.shape[0], dtype=torch.bool, device=block.device)
    for _ in range(2):
        factor, info = torch.linalg.cholesky_ex(block.mT @ block)
        failed |= info != 0
        factor = torch.where(failed[:, None, None], torch.eye(block.shape[-1], dtype=block.dtype,
                                                              device=block.device), factor)
        block = torch.linalg.solve_triangular(factor, block.mT, upper=False).mT
    return torch.where(failed[:, None, None], 0.0, block), failed


class BatchedEigh(ProjectorFromVectors):
    """Eigen-decomposition of batches of symmetric matrices on one CUDA device.

    ``solver(matrices)`` takes a contiguous (B, m, m) float32/float64 tensor, overwrites it, and returns
    ``(eigenvalues (B, m) ascending, eigenvectors (B, m, m) as columns, info (B,) int32 on the device)``.
    ``info`` is 0 where the solver converged. ``solver(matrices, vectors=False)`` computes the eigenvalues
    alone (the eigenvectors come back None).
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.backend = "torch.linalg.eigh"
        self._cusolver = None
        self._handle = None
        self._params = None
        self._workspaces = {}  # (m, dtype, mode) -> (device, host) workspaces, the largest asked for
        self._sizes = {}  # (batch, m, dtype, mode) -> cuSOLVER's (device, host) bytes
        if self.device.type != "cuda":
            return
        cusolver, reason = _load_cusolver()
        if cusolver is None:
            warnings.warn(f"{reason}: falling back to torch.linalg.eigh, which is far slower on batches of "
                          "matrices larger than 32 (pip install nvmath-python)", MPPCAWarning, stacklevel=3)
            return
        with torch.cuda.device(self.device):
            self._handle = cusolver.create()
            self._params = cusolver.create_params()
        self._cusolver = cusolver
        self.backend = "cusolverDnXsyevBatched"

    def release_workspaces(self):
        """Forget the cached workspaces (after running out of memory: smaller batches need smaller ones)."""
        self._workspaces.clear()

    def close(self):
        if self._cusolver is not None:
            self._cusolver.destroy_params(self._params)
            self._cusolver.destroy(self._handle)
            self._cusolver = None
        self._workspaces.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def workspace_bytes(self, batch: int, m: int, dtype) -> int:
        """Device workspace cuSOLVER asks for a batch of ``batch`` m x m matrices (0 for the fallback)."""
        if self._cusolver is None:
            return 0
        probe = torch.empty((1, m, m), dtype=dtype, device=self.device)
        values = torch.empty((1, m), dtype=dtype, device=self.device)
        device_bytes, _ = self._buffer_size(probe, values, batch)
        return int(device_bytes)

    def _buffer_size(self, matrices, values, batch, mode=_EIG_MODE_VECTOR):
        code = _CUDA_DATA_TYPE[matrices.dtype]
        m = matrices.shape[-1]
        return self._cusolver.xsyev_batched_buffer_size(
            self._handle, self._params, mode, _FILL_MODE_LOWER, m, code, matrices.data_ptr(), m,
            code, values.data_ptr(), code, batch)

    def _workspace(self, matrices, values, mode):
        """Device and host workspaces for this (batch, m, dtype, mode): one pair per (m, dtype, mode), the
        largest asked for so far, serves every smaller batch (a run's batches of several sizes, the last of
        each slab and the settling passes', would otherwise each keep a workspace of its own, several GiB
        at T = 288 beside a budget). cuSOLVER's sizes are asked once per batch size."""
        batch, m = matrices.shape[0], matrices.shape[-1]
        size_key = (batch, m, matrices.dtype, mode)
        if size_key not in self._sizes:
            self._sizes[size_key] = tuple(int(b) for b in self._buffer_size(matrices, values, batch, mode))
        device_bytes, host_bytes = self._sizes[size_key]
        key = (m, matrices.dtype, mode)
        kept = self._workspaces.get(key)
        if kept is None or kept[0].numel() < device_bytes or kept[1].numel() < host_bytes:
            self._workspaces.pop(key, None)  # (freed before the larger one is allocated)
            kept = (torch.empty(max(device_bytes, 1), dtype=torch.uint8, device=self.device),
                    torch.empty(max(host_bytes, 1), dtype=torch.uint8))
            self._workspaces[key] = kept
        on_device, on_host = kept
        return on_device, on_device.numel(), on_host, on_host.numel()

    def __call__(self, matrices, vectors=True):
        if matrices.ndim != 3 or matrices.shape[1] != matrices.shape[2] or not matrices.is_contiguous():
            raise ValueError("matrices must be a contiguous (B, m, m) tensor")
        if matrices.dtype not in _CUDA_DATA_TYPE:
            raise ValueError(f"matrices must be float32 or float64, not {matrices.dtype}")
        batch, m = matrices.shape[0], matrices.shape[-1]
        if self._cusolver is None:
            if not vectors:
                values = torch.linalg.eigvalsh(matrices)
                return values, None, torch.zeros(batch, dtype=torch.int32, device=matrices.device)
            values, eigenvectors = torch.linalg.eigh(matrices)
            return values, eigenvectors, torch.zeros(batch, dtype=torch.int32, device=matrices.device)
        mode = _EIG_MODE_VECTOR if vectors else _EIG_MODE_NOVECTOR
        values = torch.empty((batch, m), dtype=matrices.dtype, device=self.device)
        info = torch.empty(batch, dtype=torch.int32, device=self.device)
        on_device, device_bytes, on_host, host_bytes = self._workspace(matrices, values, mode)
        code = _CUDA_DATA_TYPE[matrices.dtype]
        self._cusolver.set_stream(self._handle, torch.cuda.current_stream(self.device).cuda_stream)
        self._cusolver.xsyev_batched(
            self._handle, self._params, mode, _FILL_MODE_LOWER, m, code, matrices.data_ptr(), m,
            code, values.data_ptr(), code, on_device.data_ptr(), device_bytes, on_host.data_ptr(), host_bytes,
            info.data_ptr(), batch)
        # cuSOLVER is column-major: in this row-major tensor each eigenvector is a row
        return values, (matrices.mT if vectors else None), info
