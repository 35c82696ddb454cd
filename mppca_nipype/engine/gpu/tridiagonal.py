"""A batched symmetric eigensolver in two Triton kernels, one program per matrix, for what MP-PCA needs:
all the eigenvalues, then the projector onto the leading ``rank`` eigenvectors (no other eigenvector).

``values`` kernel (the matrix in registers, m <= ``MAX_ORDER``):

1. Householder tridiagonalisation, A <- H_k A H_k for k = 0 .. m-3 with H_k = I - u_k u_k^T, on blocks that
   halve as the trailing block shrinks (``_householder_phases``); each u_k is written over row k of the input
   (it is no longer needed) from its block's first column on, the diagonal d and sub-diagonal e beside it.
2. Bisection on Sturm counts of T - x I (LDL^T pivots), all m eigenvalues at once (one lane each), from
   Gershgorin's interval down to the precision's resolution, after one count at BLOCK shifts that brackets
   each lane's eigenvalue (multisection): the eigenvalues come back ascending. The pivots' divisions are
   products with the hardware's reciprocal (``_reciprocal``; compiled kernels only).

``projector`` kernel, once the estimator chose each matrix's rank P:

3. Inverse iteration on the tridiagonal T for the P largest eigenvalues at once (one lane each, in a launch of
   ``PROJECTOR_LANES`` lanes for ranks up to that many; LU without pivoting, a tiny pivot replaced by
   eps ||T||): ``INVERSE_ITERATIONS`` solves, the columns
   re-orthonormalised after each (modified Gram-Schmidt from the largest eigenvalue down), so that a
   cluster of eigenvalues yields a basis of its invariant subspace rather than one vector twice.
4. Back to the matrix's basis: y <- H_0 ... H_{m-3} y, and the projector Y Y^T (a matrix product).

Cost: O(m^3) arithmetic per matrix, like the LAPACK path, but every step stays on one multiprocessor with
no launch in between; a workspace of 2 m BLOCK + 3 m numbers per matrix (BLOCK: m to the next power of
two) besides the input and the projectors. Accuracy: the
backward stability of Householder and bisection (eigenvalues to ~eps ||A||); eigenvectors of a kept
eigenvalue to ~eps ||A|| / gap, as LAPACK's.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

#: Largest matrix order these kernels take (the matrix lives in registers).
MAX_ORDER = 128
#: Solves of the inverse iteration (each followed by re-orthonormalisation). With shifts accurate to the
#: rounding, one solve amplifies the wanted eigenvector over the others by gap / (eps ||T||); the next ones
#: remove what the first left and separate the members of a cluster (measured on the H200, 12,600 48 x 48
#: matrices: 2 solves leave 1e-4 of projector error on clustered spectra, 3 leave 6e-7, at equal time).
INVERSE_ITERATIONS = 3
#: Lanes of the projector launch that serves the matrices whose rank is at most this many (the smallest
#: ``tl.dot`` operand): the inverse iteration, its orthonormalisation and the back-transform then work on
#: (BLOCK, LANES) instead of (BLOCK, BLOCK), 4x less at m = 48; a second launch takes the higher ranks.
#: MP-PCA's ranks are mostly far below 16 (dwidenoise's mode: 1-6).
PROJECTOR_LANES = 16
#: (warps, shifts per eigenvalue and Sturm count) of the values kernel in a counted launch (``values(count=...)``:
#: a settling pass, a few hundred matrices in a launch sized for at most ``COUNTED_LAUNCH_LIMIT``), where each
#: program's latency, not the device's throughput, is the limit: with s shifts a count splits the eigenvalue's
#: interval in s + 1 for s times a count's work. Other launches: ``_warps`` and one shift.
COUNTED_LAUNCH = (4, 2)
COUNTED_LAUNCH_LIMIT = 16_384


def _bisections(dtype) -> int:
    """Halvings that take Gershgorin's interval (at most 4 ||T|| wide) below half a rounding of ||T||."""
    return 4 + {torch.float32: 23, torch.float64: 52}[dtype]  # + the mantissa's bits


def _approximate() -> bool:
    """Whether the kernels divide by the hardware's reciprocal (``_reciprocal``): compiled kernels only, the
    interpreter (TRITON_INTERPRET=1) runs no inline PTX."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def _log2_floor(n):
    return n.bit_length() - 1


def _counts(halvings: int, shifts: int) -> int:
    """Sturm counts with ``shifts`` shifts per eigenvalue that narrow an interval as ``halvings`` halvings."""
    return halvings if shifts == 1 else math.ceil(halvings / math.log2(shifts + 1))


def _householder_phases(m: int) -> int:
    """Blocks the Householder steps take: the first (BLOCK, BLOCK), each next one half the size (down to
    16 x 16) from column m - its size on, while it leaves steps to take (at m = 48: 16 steps on 64 x 64, 16 on
    32 x 32 and 14 on 16 x 16, ~45% of the elements' work of every step on 64 x 64)."""
    phases = 1
    while (_block(m) >> phases) >= 16:  # (m > BLOCK / 2: each block starts past column 0)
        phases += 1
    return phases


def _block(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


def _warps(m: int, dtype) -> int:
    """One warp for float32 matrices up to 64 x 64 (its reductions need no shared memory or barrier), two for
    float64 ones (one warp's registers do not hold a 64 x 64 float64 tile); otherwise enough warps that the
    (BLOCK, BLOCK) matrix takes about 32 registers' worth a thread (docs/gpu.md, "Tuning constants")."""
    if _block(m) <= 64:
        return 1 if dtype == torch.float32 else 2
    elements = _block(m) ** 2 * (2 if dtype == torch.float64 else 1)
    return max(1, min(16, elements // (32 * 32)))


def _projector_warps(m: int, dtype, lanes: int) -> int:
    """``_warps``, but two for float32's (64, 64) projector launch (LANES = BLOCK: the ranks above
    ``PROJECTOR_LANES``): with one warp it takes 5.9 s to compile, with two 3.2 s, and runs 10% longer
    (20,000 matrices of m = 48, ranks 17-39, on the H200: 5.6 against 5.1 ms); the first run on a machine
    compiles it whether any rank needs it or not."""
    if dtype == torch.float32 and _block(m) == 64 and lanes == 64:
        return 2
    return _warps(m, dtype)


@triton.jit
def _reflect(a, v, vv, tiny):
    """H a H with H = I - beta v v^T (beta = 2 / v^T v, ``vv`` = v^T v; H = I for v = 0), as a rank-two
    update; returns the new matrix and u = v sqrt(beta), the stored form of H = I - u u^T."""
    beta = tl.where(vv > tiny, 2.0 / tl.maximum(vv, tiny), 0.0)
    p = tl.sum(a * v[None, :], axis=1) * beta
    w = p - (0.5 * beta * tl.sum(v * p, axis=0)) * v
    return a - v[:, None] * w[None, :] - w[:, None] * v[None, :], v * tl.sqrt(beta)


@triton.jit
def _householder_steps(a, a_ptr, d_ptr, e_ptr, matrix, first: tl.constexpr, m: tl.constexpr, SIZE: tl.constexpr,
                       LAST: tl.constexpr, tiny):
    """Householder steps on the trailing block of rows and columns ``first`` .. m-1 (``a``, (SIZE, SIZE), zero
    past the matrix): those of columns ``first`` .. m-3 (``LAST``), else those of the columns before the
    next phase's block (its first row: m - SIZE / 2), which is stored over the matrix for that phase to
    load. Each H_k = I - u_k u_k^T is stored over row k from column ``first`` on (u_k is zero up to row k),
    and the entries of T this phase made final into d and e."""
    rows = tl.arange(0, SIZE)
    r = rows[:, None]
    c = rows[None, :]
    base = a_ptr + matrix * m * m
    done: tl.constexpr = (m - 2 if LAST else m - SIZE // 2) - first  # columns this phase takes
    for k in range(0, done):  # (k: the column within the block)
        column = tl.sum(tl.where(c == k, a, 0.0), axis=1)
        x = tl.where(rows > k, column, 0.0)
        norm = tl.sqrt(tl.sum(x * x, axis=0))
        leading = tl.sum(tl.where(rows == k + 1, x, 0.0), axis=0)
        alpha = tl.where(leading > 0, -norm, norm)
        # v = x - alpha e_k+1: v^T v = 2 norm (norm + |leading|), one reduction fewer on the step's path
        a, u = _reflect(a, tl.where(rows == k + 1, x - alpha, x), 2.0 * norm * (norm + tl.abs(leading)), tiny)
        tl.store(base + (first + k) * m + first + rows, u.to(a_ptr.dtype.element_ty), mask=first + rows < m)
    inside = first + rows < m
    final = inside if LAST else inside & (rows <= done)  # d_i up to row ``done`` (e_i too: T[i, i-1])
    tl.store(d_ptr + matrix * m + first + rows, tl.sum(tl.where(r == c, a, 0.0), axis=1), mask=final)
    tl.store(e_ptr + matrix * m + first + rows, tl.sum(tl.where(r == c + 1, a, 0.0), axis=1),
             mask=final & ((rows >= 1) | (first == 0)))  # (e_first lies outside the block but for e_0 = 0)
    if not LAST:  # the next phase's block, from row and column ``done`` of this one
        tl.store(base + (first + r) * m + first + c, a.to(a_ptr.dtype.element_ty),
                 mask=(r >= done) & (c >= done) & (first + r < m) & (first + c < m))


@triton.jit
def _trailing_phase(a_ptr, d_ptr, e_ptr, matrix, m: tl.constexpr, SIZE: tl.constexpr, LAST: tl.constexpr,
                    FP64: tl.constexpr, tiny):
    """The Householder steps on the (SIZE, SIZE) block from row and column m - SIZE on, which the phase
    before stored over the matrix."""
    tl.debug_barrier()
    rows = tl.arange(0, SIZE) + (m - SIZE)
    a = tl.load(a_ptr + matrix * m * m + rows[:, None] * m + rows[None, :],
                mask=(rows[:, None] < m) & (rows[None, :] < m), other=0.0).to(tl.float64 if FP64 else tl.float32)
    _householder_steps(a, a_ptr, d_ptr, e_ptr, matrix, m - SIZE, m, SIZE, LAST, tiny)


@triton.jit
def _reciprocal(x, APPROXIMATE: tl.constexpr):
    """1 / x: IEEE's division, or with ``APPROXIMATE`` (compiled kernels only: inline PTX) the hardware's
    reciprocal (float32: within an ulp), in float64 refined by two Newton steps to a rounding (x normal)."""
    if APPROXIMATE:
        if x.dtype == tl.float64:
            r = tl.inline_asm_elementwise("rcp.approx.ftz.f64 $0, $1;", "=d,d", [x], dtype=tl.float64,
                                          is_pure=True, pack=1)
            r = r + r * (1.0 - x * r)
            r = r + r * (1.0 - x * r)
        else:
            r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                          is_pure=True, pack=1)
    else:
        r = 1.0 / x
    return r


@triton.jit
def _count_below(d_ptr, e_ptr, matrix, shift, pivot_floor, m: tl.constexpr, APPROXIMATE: tl.constexpr):
    """Sturm counts: how many eigenvalues of the tridiagonal (d, e) of ``matrix`` lie below each of the
    ``shift`` tensor's numbers (the negative pivots of the LDL^T factors of T - shift I; ``_reciprocal``)."""
    below = tl.zeros(shift.shape, dtype=tl.int32)
    pivot = tl.zeros_like(shift) + 1.0
    for i in range(0, m):
        d_i = tl.load(d_ptr + matrix * m + i)
        e_i = tl.load(e_ptr + matrix * m + i)
        pivot = d_i - shift - e_i * e_i * _reciprocal(pivot, APPROXIMATE)
        pivot = tl.where(tl.abs(pivot) < pivot_floor, -pivot_floor, pivot)
        below += (pivot < 0).to(tl.int32)
    return below


@triton.jit
def _values_kernel(a_ptr, d_ptr, e_ptr, values_ptr, direction_ptr, weight_ptr, count_ptr, m: tl.constexpr,
                   BLOCK: tl.constexpr, FP64: tl.constexpr, BISECTIONS: tl.constexpr, RANK_ONE: tl.constexpr,
                   COUNTED: tl.constexpr, MULTISECTION: tl.constexpr, PHASES: tl.constexpr, SHIFTS: tl.constexpr,
                   APPROXIMATE: tl.constexpr):
    matrix = tl.program_id(0).to(tl.int64)
    if COUNTED:  # only the first *count_ptr matrices are asked for
        if matrix >= tl.load(count_ptr):
            return
    dtype = tl.float64 if FP64 else tl.float32
    rows = tl.arange(0, BLOCK)
    r = rows[:, None]
    c = rows[None, :]
    inside = (r < m) & (c < m)
    a = tl.load(a_ptr + matrix * m * m + r * m + c, mask=inside, other=0.0).to(dtype)
    tiny = 1e-300 if FP64 else 1e-30
    if RANK_ONE:
        # 0. the eigenvalues of A + rho w w^T (w a unit vector): H_w = I - h h^T maps w to -+e_0, so
        #    H_w (A + rho w w^T) H_w = H_w A H_w + rho e_0 e_0^T; the reflectors below act on rows >= 1 and
        #    leave entry (0, 0) alone, so rho is added to d_0 at the end, never mixed into A's numbers.
        # (names of their own: the loop below must not see these as its loop-carried values)
        direction = tl.load(direction_ptr + matrix * m + rows, mask=rows < m, other=0.0).to(dtype)
        leading = tl.sum(tl.where(rows == 0, direction, 0.0), axis=0)
        reflector = tl.where(rows == 0, direction - tl.where(leading > 0, -1.0, 1.0), direction)
        a, h = _reflect(a, reflector, tl.sum(reflector * reflector, axis=0), tiny)
        tl.store(direction_ptr + matrix * m + rows, h.to(direction_ptr.dtype.element_ty), mask=rows < m)

    # 1. Householder: zero column k below the sub-diagonal, from both sides, on blocks that halve as the
    #    trailing block shrinks (``_householder_phases``); then T's diagonal d and sub-diagonal e from memory
    _householder_steps(a, a_ptr, d_ptr, e_ptr, matrix, 0, m, BLOCK, PHASES == 1, tiny)
    if PHASES > 1:
        _trailing_phase(a_ptr, d_ptr, e_ptr, matrix, m, BLOCK // 2, PHASES == 2, FP64, tiny)
    if PHASES > 2:
        _trailing_phase(a_ptr, d_ptr, e_ptr, matrix, m, BLOCK // 4, PHASES == 3, FP64, tiny)
    if PHASES > 3:  # (BLOCK <= 128: down to 16 x 16)
        _trailing_phase(a_ptr, d_ptr, e_ptr, matrix, m, BLOCK // 8, True, FP64, tiny)
    tl.debug_barrier()
    diagonal = tl.load(d_ptr + matrix * m + rows, mask=rows < m, other=0.0).to(dtype)
    below = tl.load(e_ptr + matrix * m + rows, mask=rows < m, other=0.0).to(dtype)  # e_i = T[i, i-1], e_0 = 0
    above = tl.load(e_ptr + matrix * m + rows + 1, mask=rows + 1 < m, other=0.0).to(dtype)  # T[i, i+1]
    if RANK_ONE:
        diagonal += tl.where(rows == 0, tl.load(weight_ptr + matrix).to(dtype), 0.0)
        tl.store(d_ptr + matrix * m + rows, diagonal, mask=rows < m)
    tl.debug_barrier()

    # 2. bisection: lane j converges on the j-th smallest eigenvalue (the device runs enough programs at once
    #    that a count's latency is hidden; a counted launch runs few, and takes SHIFTS shifts a count)
    radius = tl.abs(below) + tl.abs(above)
    low = tl.min(tl.where(rows < m, diagonal - radius, float("inf")), axis=0)
    high = tl.max(tl.where(rows < m, diagonal + radius, -float("inf")), axis=0)
    scale = tl.maximum(tl.abs(low), tl.abs(high))
    pivot_floor = tl.maximum(scale * (1e-300 if FP64 else 1e-36), tiny)
    lower = tl.zeros((BLOCK,), dtype=dtype) + low
    upper = tl.zeros((BLOCK,), dtype=dtype) + high
    if RANK_ONE:
        # all but the largest eigenvalue lie below the trailing block's Gershgorin bound (they interlace with
        # its eigenvalues): their halvings start from A's scale, not from rho's
        trailing = tl.max(tl.where((rows >= 1) & (rows < m), diagonal + radius, -float("inf")), axis=0)
        upper = tl.where(rows < m - 1, tl.minimum(trailing, high), upper)
    if MULTISECTION:
        # one count at BLOCK shifts spread over the interval (lane j: the j-th), then each lane's eigenvalue
        # bracketed by the two shifts around it: as narrow as log2(BLOCK + 1) halvings would leave it
        width = (high - low) / (BLOCK + 1)
        shifts = low + (rows + 1).to(dtype) * width
        counts = _count_below(d_ptr, e_ptr, matrix, shifts, pivot_floor, m, APPROXIMATE)
        at_or_below = counts[None, :] <= rows[:, None]  # shift j lies at or below eigenvalue i
        lower = tl.max(tl.where(at_or_below, shifts[None, :], low), axis=1)
        upper = tl.min(tl.where(at_or_below, high, shifts[None, :]), axis=1)
    if SHIFTS == 1:
        for _ in range(BISECTIONS):  # (after the multisection: as many fewer as it stood for)
            middle = 0.5 * (lower + upper)
            below_middle = _count_below(d_ptr, e_ptr, matrix, middle, pivot_floor, m, APPROXIMATE)
            to_left = below_middle > rows
            upper = tl.where(to_left, middle, upper)
            lower = tl.where(to_left, lower, middle)
    else:
        # SHIFTS shifts per lane, evenly inside its interval: each of the ``BISECTIONS`` counts leaves one of
        # SHIFTS + 1 sub-intervals (log2(SHIFTS + 1) halvings) for SHIFTS times a count's work (names of
        # their own: the multisection's are not of these shapes)
        fractions = (tl.arange(0, SHIFTS) + 1).to(dtype) / (SHIFTS + 1)
        for _ in range(BISECTIONS):
            trial = lower[:, None] + (upper - lower)[:, None] * fractions[None, :]
            below_trial = _count_below(d_ptr, e_ptr, matrix, trial, pivot_floor, m, APPROXIMATE)
            reached = below_trial <= rows[:, None]  # the trial shift lies at or below the lane's eigenvalue
            lower = tl.maximum(lower, tl.max(tl.where(reached, trial, lower[:, None]), axis=1))
            upper = tl.minimum(upper, tl.min(tl.where(reached, upper[:, None], trial), axis=1))
    tl.store(values_ptr + matrix * m + rows, (0.5 * (lower + upper)).to(values_ptr.dtype.element_ty),
             mask=rows < m)


@triton.jit
def _solve_shifted(d_ptr, e_ptr, work_ptr, shift, pivot_floor, matrix, lanes,
                   m: tl.constexpr, LANES: tl.constexpr, FIRST: tl.constexpr, APPROXIMATE: tl.constexpr):
    """(T - shift_j I) y_j = b_j for every lane j at once (LU without pivoting). The right sides are the
    rows of ``work`` (row i holds b_i of every lane), or all ones with ``FIRST``; the solutions replace them.
    Row i of the second half of ``work`` keeps the factor's c'_i between the two sweeps."""
    base = work_ptr + matrix * 2 * m * LANES
    c_prev = tl.zeros((LANES,), dtype=shift.dtype)
    y_prev = tl.zeros((LANES,), dtype=shift.dtype)
    for i in range(0, m):
        d_i = tl.load(d_ptr + matrix * m + i)
        e_i = tl.load(e_ptr + matrix * m + i)
        e_next = tl.load(e_ptr + matrix * m + i + 1, mask=i + 1 < m, other=0.0)
        if FIRST:
            b_i = tl.zeros((LANES,), dtype=shift.dtype) + 1.0
        else:
            b_i = tl.load(base + i * LANES + lanes)
        pivot = d_i - shift - e_i * c_prev
        pivot = tl.where(tl.abs(pivot) < pivot_floor, tl.where(pivot < 0, -pivot_floor, pivot_floor), pivot)
        inverse = _reciprocal(pivot, APPROXIMATE)
        c_prev = e_next * inverse
        y_prev = (b_i - e_i * y_prev) * inverse
        tl.store(base + i * LANES + lanes, y_prev)
        tl.store(base + (m + i) * LANES + lanes, c_prev)
    y_next = tl.zeros((LANES,), dtype=shift.dtype)
    for step in range(0, m):
        i = m - 1 - step
        y_i = tl.load(base + i * LANES + lanes) - tl.load(base + (m + i) * LANES + lanes) * y_next
        tl.store(base + i * LANES + lanes, y_i)
        y_next = y_i


@triton.jit
def _orthonormal_columns(y, keep, rank, lanes, tiny, LANES: tl.constexpr):
    """Modified Gram-Schmidt over the kept lanes, from the largest eigenvalue (the last lane) down."""
    for t in range(0, rank):
        j = LANES - 1 - t
        column = tl.sum(tl.where(lanes[None, :] == j, y, 0.0), axis=1)
        column = column / tl.maximum(tl.sqrt(tl.sum(column * column, axis=0)), tiny)
        overlap = tl.sum(y * column[:, None], axis=0)
        overlap = tl.where(keep & (lanes < j), overlap, 0.0)
        y = y - column[:, None] * overlap[None, :]
        y = tl.where(lanes[None, :] == j, column[:, None], y)
    return y


@triton.jit
def _projector_kernel(a_ptr, d_ptr, e_ptr, values_ptr, rank_ptr, work_ptr, projector_ptr, direction_ptr,
                      count_ptr, weights_ptr, m: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr,
                      FP64: tl.constexpr, SOLVES: tl.constexpr, RANK_ONE: tl.constexpr, LOWEST_RANK: tl.constexpr,
                      HIGHEST_RANK: tl.constexpr, COUNTED: tl.constexpr, WEIGHTED: tl.constexpr = False,
                      APPROXIMATE: tl.constexpr = False):
    """The projector of every matrix whose rank lies in [LOWEST_RANK, HIGHEST_RANK] (the others are left to
    another launch): lane j solves for eigenvalue m - LANES + j, so LANES >= HIGHEST_RANK lanes serve the
    top ranks (LANES = BLOCK serves every rank). WEIGHTED: V diag(w) V^T, w (B, m) ascending at
    ``weights_ptr``."""
    matrix = tl.program_id(0).to(tl.int64)
    if COUNTED:
        if matrix >= tl.load(count_ptr):
            return
    dtype = tl.float64 if FP64 else tl.float32
    rows = tl.arange(0, BLOCK)
    lanes = tl.arange(0, LANES)
    index = lanes + (m - LANES)  # the eigenvalue of each lane (negative: no eigenvalue, for LANES > m)
    r = rows[:, None]
    c = rows[None, :]
    rank = tl.load(rank_ptr + matrix).to(tl.int32)
    keep = (index >= m - rank) & (index >= 0)
    out = projector_ptr + matrix * m * m + r * m + c
    if (rank >= LOWEST_RANK) & (rank <= HIGHEST_RANK):
        if rank == 0:
            tl.store(out, tl.zeros((BLOCK, BLOCK), dtype=dtype).to(projector_ptr.dtype.element_ty),
                     mask=(r < m) & (c < m))
        else:
            magnitude = tl.abs(tl.load(values_ptr + matrix * m + rows, mask=rows < m, other=0.0).to(dtype))
            if RANK_ONE:  # the largest carries rho; the others are known to a rounding of A's scale, not rho's
                magnitude = tl.where(rows < m - 1, magnitude, 0.0)
            scale = tl.max(magnitude, axis=0)
            values = tl.load(values_ptr + matrix * m + index, mask=index >= 0, other=0.0).to(dtype)
            eps = 2.2e-16 if FP64 else 1.2e-7
            tiny = 1e-300 if FP64 else 1e-30
            pivot_floor = tl.maximum(eps * scale, tiny)
            # the shifts, nudged apart so that equal eigenvalues give different solves
            shift = values + (index - m / 2).to(dtype) * (eps * scale)
            base = work_ptr + matrix * 2 * m * LANES
            y = tl.zeros((BLOCK, LANES), dtype=dtype)
            for solve in range(0, SOLVES):
                tl.debug_barrier()
                if solve == 0:
                    _solve_shifted(d_ptr, e_ptr, work_ptr, shift, pivot_floor, matrix, lanes, m, LANES, True,
                                   APPROXIMATE)
                else:
                    _solve_shifted(d_ptr, e_ptr, work_ptr, shift, pivot_floor, matrix, lanes, m, LANES, False,
                                   APPROXIMATE)
                tl.debug_barrier()
                y = tl.load(base + r * LANES + lanes[None, :], mask=r < m, other=0.0)
                y = _orthonormal_columns(tl.where(keep[None, :], y, 0.0), keep, rank, lanes, tiny, LANES)
                if solve + 1 < SOLVES:
                    tl.debug_barrier()
                    tl.store(base + r * LANES + lanes[None, :], y, mask=r < m)
            # back to the matrix's basis: y <- H_0 (H_1 (... H_{m-3} y))
            for step in range(0, m - 2):
                k = m - 3 - step
                u = tl.load(a_ptr + matrix * m * m + k * m + rows, mask=(rows > k) & (rows < m),
                            other=0.0).to(dtype)  # (a later phase's u_k is stored from its block's column on)
                y = y - u[:, None] * tl.sum(u[:, None] * y, axis=0)[None, :]
            if RANK_ONE:  # and through H_w, the first reflector
                u = tl.load(direction_ptr + matrix * m + rows, mask=rows < m, other=0.0).to(dtype)
                y = y - u[:, None] * tl.sum(u[:, None] * y, axis=0)[None, :]
            weighted = y
            if WEIGHTED:  # each kept eigenvector's column scaled by its weight
                w = tl.load(weights_ptr + matrix * m + index, mask=keep, other=0.0).to(dtype)
                weighted = y * w[None, :]
            projector = tl.dot(weighted, tl.trans(y), input_precision="ieee", out_dtype=dtype)
            tl.store(out, projector.to(projector_ptr.dtype.element_ty), mask=(r < m) & (c < m))


class TridiagonalEigh:
    """Eigenvalues of a batch of symmetric matrices, then the projectors onto their leading eigenvectors.

    ``values, info = solver.values(matrices)`` overwrites the contiguous (B, m, m) float32/float64 tensor
    with what the projector needs and returns the eigenvalues (B, m) ascending and ``info`` (B,) int32
    (always 0: bisection cannot fail to converge); ``solver.projector(rank)`` then returns the (B, m, m)
    projectors onto the ``rank`` (B,) leading eigenvectors. Bisection steps: enough to shrink Gershgorin's
    interval to the precision's rounding (``_bisections``: float32 27, float64 56), less the halvings the
    first count's multisection stands for.
    """

    backend = "triton tridiagonal (Householder + bisection + inverse iteration)"

    def __init__(self, device):
        self.device = torch.device(device)
        self._state = None

    def workspace_bytes(self, batch, m, dtype):
        size = torch.empty((), dtype=dtype).element_size()
        return batch * size * (2 * m * _block(m) + 3 * m)

    def release_workspaces(self):
        self._state = None

    def values(self, matrices, rank_one=None, count=None):
        """Eigenvalues of ``matrices`` (see the class), or with ``rank_one = (w, rho)`` ((B, m) unit vectors,
        (B,) weights >= 0) of ``matrices + rho w w^T``: the rank-one term enters the tridiagonal form as one
        number added to d_0, so a huge rho (an undemeaned patch's mean, ``batch.eigenvalues_of``) costs the other
        eigenvalues no precision: they come out to a rounding of ``matrices``' scale, not of rho's.
        ``count`` (a device integer tensor of one element): only the first ``count`` matrices are solved
        (here and by ``projector``), the rest left unwritten; such a launch takes ``COUNTED_LAUNCH``'s warps and
        shifts a count."""
        if matrices.ndim != 3 or matrices.shape[1] != matrices.shape[2] or not matrices.is_contiguous():
            raise ValueError("matrices must be a contiguous (B, m, m) tensor")
        if matrices.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"matrices must be float32 or float64, not {matrices.dtype}")
        batch, m = matrices.shape[0], matrices.shape[-1]
        if m > MAX_ORDER:
            raise ValueError(f"the tridiagonal kernels take m <= {MAX_ORDER}, not {m}")
        fp64 = matrices.dtype == torch.float64
        d = torch.empty((batch, m), dtype=matrices.dtype, device=matrices.device)
        e = torch.empty_like(d)
        values = torch.empty_like(d)
        direction = weight = d  # placeholders: not read without a rank-one term
        if rank_one is not None:
            direction = rank_one[0].to(matrices.dtype).contiguous().clone()  # overwritten by H_w's vector
            weight = rank_one[1].to(matrices.dtype).contiguous()
            if direction.shape != (batch, m) or weight.shape != (batch,):
                raise ValueError(f"rank_one must be ((B, m), (B,)) tensors for B={batch}, m={m}")
        # (not with a rank-one term: its lanes' intervals start at the matrix's scale, not at rho's)
        multisection = rank_one is None
        warps, shifts = _warps(m, matrices.dtype), 1
        if count is not None and batch <= COUNTED_LAUNCH_LIMIT:
            warps, shifts = COUNTED_LAUNCH
        bisections = _counts(_bisections(matrices.dtype) - (_log2_floor(_block(m) + 1) if multisection else 0),
                             shifts)
        if batch:
            _values_kernel[(batch,)](matrices, d, e, values, direction, weight, d if count is None else count, m,
                                     BLOCK=_block(m), FP64=fp64, BISECTIONS=bisections,
                                     RANK_ONE=rank_one is not None, COUNTED=count is not None,
                                     MULTISECTION=multisection, PHASES=_householder_phases(m), SHIFTS=shifts,
                                     APPROXIMATE=_approximate(), num_warps=warps)
        self._state = (matrices, d, e, values, direction if rank_one is not None else None, count)
        return values, torch.zeros(batch, dtype=torch.int32, device=matrices.device)

    def projector(self, rank, weights=None):
        """(B, m, m) projectors onto the ``rank`` leading eigenvectors of the matrices ``values`` saw last;
        with ``weights`` (B, m) ascending, V diag(w) V^T over them."""
        matrices, d, e, values, direction, count = self._state
        batch, m = values.shape
        out = torch.empty((batch, m, m), dtype=matrices.dtype, device=matrices.device)
        work = torch.empty((batch, 2 * m, _block(m)), dtype=matrices.dtype, device=matrices.device)
        rank = rank.to(torch.int32).contiguous()
        if weights is not None:
            weights = weights.to(matrices.dtype).contiguous()
        # (lanes, lowest rank, highest rank) of each launch; each matrix is served by one of them
        launches = ([(PROJECTOR_LANES, 0, PROJECTOR_LANES), (_block(m), PROJECTOR_LANES + 1, m)]
                    if PROJECTOR_LANES < _block(m) else [(_block(m), 0, m)])
        for launch_lanes, lowest, highest in launches if batch else ():
            _projector_kernel[(batch,)](matrices, d, e, values, rank, work, out,
                                        d if direction is None else direction, d if count is None else count,
                                        d if weights is None else weights, m,
                                        BLOCK=_block(m), LANES=launch_lanes, FP64=matrices.dtype == torch.float64,
                                        SOLVES=INVERSE_ITERATIONS, RANK_ONE=direction is not None,
                                        LOWEST_RANK=lowest, HIGHEST_RANK=highest, COUNTED=count is not None,
                                        WEIGHTED=weights is not None,
                                        APPROXIMATE=_approximate(),
                                        num_warps=_projector_warps(m, matrices.dtype, launch_lanes))
        return out
