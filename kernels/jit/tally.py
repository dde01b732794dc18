"""A step's statistics added into a turn's sums: the @triton.jit kernel (wrapper: kernels/tally_ops.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior

# Arguments that follow a context's size, not specialised on (kernels/README.md)
STEP_SIZES = ["n_units", "stride_scores", "stride_best"]


@triton.jit(do_not_specialize=STEP_SIZES)
def tally_step_kernel(
    indptr_ptr, elements_ptr, kept_ptr, read_ptr, fresh_ptr, scores_ptr, best_ptr,
    n_elements, n_fresh, stride_fresh, n_units, stride_scores, stride_best,
    ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_U: tl.constexpr, HAS_FRESH: tl.constexpr, HAS_SCORES: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """Program 0 adds each row's kept keys (indptr [ROWS + 1], plus its fresh follow rows [ROWS, n_fresh] int8)
    into kept [ROWS] fp32 and the elements [n_elements] into read [1] fp32; program (p, r) takes the running max of
    units p * BLOCK_U ... of row r: best [ROWS, n_units] fp32 = max(best, scores [ROWS, n_units])."""
    wait_prior(PDL)
    release_next(PDL)
    pid = tl.program_id(0)
    if pid == 0 and tl.program_id(1) == 0:
        for r in tl.static_range(ROWS):
            tally_row(indptr_ptr, r, fresh_ptr, n_fresh, stride_fresh, kept_ptr, elements_ptr, n_elements, read_ptr,
                      HAS_FRESH, BLOCK_M, BLOCK_E)
    if HAS_SCORES:
        start = pid * BLOCK_U
        running_max(scores_ptr, best_ptr, tl.program_id(1), start, start + BLOCK_U, n_units, stride_scores,
                    stride_best, BLOCK_U)


@triton.jit
def running_max(scores_ptr, best_ptr, row, start, stop, n_units, stride_scores, stride_best, BLOCK_U: tl.constexpr):
    """best[row, u] = max(best[row, u], scores[row, u]) for units start <= u < min(stop, n_units), BLOCK_U at a
    time (scores any float dtype, best float32)."""
    row = row.to(tl.int64)
    for u0 in range(start, tl.minimum(stop, n_units), BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        ok_u = (u < n_units) & (u < stop)
        s = tl.load(scores_ptr + row * stride_scores + u, mask=ok_u, other=float("-inf")).to(tl.float32)
        b = tl.load(best_ptr + row * stride_best + u, mask=ok_u, other=float("-inf"))
        tl.store(best_ptr + row * stride_best + u, tl.maximum(b, s), mask=ok_u)


@triton.jit
def tally_row(indptr_ptr, row, fresh_ptr, n_fresh, stride_fresh, kept_ptr, elements_ptr, n_elements, read_ptr,
              HAS_FRESH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """One row's part of tally_step_kernel's program 0: kept[row] += its selection's keys (+ its fresh follow rows
    [n_fresh] int8 at fresh_ptr + row * stride_fresh); row 0 also adds the elements [n_elements] into read [1]."""
    count = (tl.load(indptr_ptr + row + 1) - tl.load(indptr_ptr + row)).to(tl.float32)
    if HAS_FRESH:
        for m0 in range(0, n_fresh, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            f = tl.load(fresh_ptr + row * stride_fresh + m, mask=m < n_fresh, other=0)
            count += tl.sum(f.to(tl.float32), axis=0)
    tl.store(kept_ptr + row, tl.load(kept_ptr + row) + count)
    if row == 0:
        total = tl.zeros([BLOCK_E], dtype=tl.float32)
        for e0 in range(0, n_elements, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            total += tl.load(elements_ptr + e, mask=e < n_elements, other=0.0).to(tl.float32)
        tl.store(read_ptr, tl.load(read_ptr) + tl.sum(total, axis=0))
