"""Issue 5's first alternative to cuSOLVER's XsyevBatched, measured and not kept by the engine: a batched
two-sided Jacobi eigensolver, one Triton program per symmetric m x m matrix (m <= 128), the matrix and its
rotations on chip.

Each sweep takes BLOCK - 1 rounds of the round-robin (parallel) ordering over the BLOCK = next power of two
>= m indices (the padding rows are zero: their rotations are the identity); a round rotates BLOCK / 2
disjoint pairs (p, q) at once, each by the angle that zeroes A[p, q] (the symmetric Schur rotation of Golub
and Van Loan), as the matrix products A <- J^T A J and V <- V J with J the round's rotations. After
``SWEEPS`` sweeps the diagonal holds the eigenvalues and V the eigenvectors, which the host sorts; the
projector onto the leading ``rank`` eigenvectors is V_P V_P^T (a batched product).

The cost is what kept it out of the engine: three (BLOCK, BLOCK, BLOCK) products a round, (BLOCK - 1) rounds a
sweep, ~0.8 GFLOP per 48 x 48 matrix in 8 sweeps against ~0.1 MFLOP of Householder reduction; measured in
``gpu_suite.py`` part 5 against XsyevBatched and the tridiagonal kernels the engine keeps (docs/gpu.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Sweeps of the round-robin ordering (quadratic convergence: 8 leave float32 48 x 48 Gram matrices diagonal
#: to their rounding; the interpreter test checks random, clustered and rank-deficient spectra).
SWEEPS = 8
#: Largest matrix order (the matrix, its vectors and a round's rotations live in registers).
MAX_ORDER = 128


@triton.jit
def _jacobi_kernel(a_ptr, values_ptr, vectors_ptr, m: tl.constexpr, BLOCK: tl.constexpr, SWEEPS: tl.constexpr):
    matrix = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK)
    r = rows[:, None]
    c = rows[None, :]
    a = tl.load(a_ptr + matrix * m * m + r * m + c, mask=(r < m) & (c < m), other=0.0).to(tl.float32)
    v = tl.where(r == c, 1.0, 0.0).to(tl.float32)
    last: tl.constexpr = BLOCK - 1  # (odd: 2 is invertible modulo it, so each round pairs every index)
    for _ in range(SWEEPS):
        for k in range(last):
            # round k: index ``last`` meets k, and j meets 2k - j (mod last) for the others
            partner = tl.where(rows == last, k, (2 * k - rows + 2 * last) % last)
            partner = tl.where(rows == k, last, partner)
            meets = c == partner[:, None]
            diagonal = tl.sum(tl.where(r == c, a, 0.0), axis=1)
            # A[j, partner(j)] as the mean of the two: rounding leaves A a little unsymmetric, and both rows of
            # a pair must take one angle (else J is not orthogonal: within a cluster of equal eigenvalues the
            # angle is a ratio of two roundings)
            off = 0.5 * (tl.sum(tl.where(meets, a, 0.0), axis=1) + tl.sum(tl.where(r == partner[None, :], a, 0.0),
                                                                          axis=0))
            other = tl.sum(tl.where(meets, diagonal[None, :], 0.0), axis=1)  # A[partner(j), partner(j)]
            first = rows < partner  # j plays p, its partner q
            a_pp = tl.where(first, diagonal, other)
            a_qq = tl.where(first, other, diagonal)
            # the angle that zeroes A[p, q]: t = tan(theta), the smaller root of t^2 + 2 tau t - 1 = 0
            rotate = off != 0.0
            tau = (a_qq - a_pp) / (2.0 * tl.where(rotate, off, 1.0))
            t = tl.where(tau >= 0, 1.0, -1.0) / (tl.abs(tau) + tl.sqrt(1.0 + tau * tau))
            t = tl.where(rotate, t, 0.0)
            cosine = 1.0 / tl.sqrt(1.0 + t * t)
            sine = t * cosine
            # J[p, p] = J[q, q] = c, J[p, q] = s, J[q, p] = -s
            rotation = tl.where(r == c, cosine[:, None], tl.where(meets, tl.where(first, sine, -sine)[:, None], 0.0))
            a = tl.dot(tl.trans(rotation), tl.dot(a, rotation, input_precision="ieee"), input_precision="ieee")
            v = tl.dot(v, rotation, input_precision="ieee")
    inside = (r < m) & (c < m)
    tl.store(values_ptr + matrix * m + rows, tl.sum(tl.where(r == c, a, 0.0), axis=1), mask=rows < m)
    tl.store(vectors_ptr + matrix * m * m + r * m + c, v, mask=inside)


class JacobiEigh:
    """``values, info = solver.values(matrices)`` (a (B, m, m) float32 tensor, m <= ``MAX_ORDER``): the
    eigenvalues ascending (``info`` always 0), then ``solver.projector(rank)``: (B, m, m) projectors onto the
    ``rank`` (B,) leading eigenvectors."""

    def __init__(self, device, sweeps=SWEEPS):
        self.device, self.sweeps, self._vectors = torch.device(device), sweeps, None

    def values(self, matrices):
        batch, m = matrices.shape[0], matrices.shape[-1]
        if matrices.dtype != torch.float32 or m > MAX_ORDER or matrices.shape[1] != m:
            raise ValueError(f"the Jacobi kernel takes (B, m, m) float32 matrices, m <= {MAX_ORDER}")
        block = max(16, triton.next_power_of_2(m))
        values = torch.empty((batch, m), dtype=torch.float32, device=matrices.device)
        vectors = torch.empty((batch, m, m), dtype=torch.float32, device=matrices.device)
        if batch:
            _jacobi_kernel[(batch,)](matrices.contiguous(), values, vectors, m, BLOCK=block, SWEEPS=self.sweeps,
                                     num_warps=max(1, min(8, block * block // 1024)))
        values, order = values.sort(dim=1)
        self._vectors = vectors.gather(2, order[:, None, :].expand(-1, m, -1))
        return values, torch.zeros(batch, dtype=torch.int32, device=matrices.device)

    def projector(self, rank):
        m = self._vectors.shape[-1]
        kept = torch.arange(m, device=rank.device)[None, :] >= m - rank[:, None]
        return (self._vectors * kept[:, None, :]) @ self._vectors.mT
