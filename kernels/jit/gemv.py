"""One token's matrix-vector product, bound by reading the weights: the @triton.jit kernel (wrapper:
kernels/gemv_ops.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """y [N] = w [N, K] @ x [K] (+ b [N]), accumulated in float32: program p streams rows p * BLOCK_N ... of w,
    BLOCK_K columns at a time, each read once (evicted first: they are never read again in the step), and reduces
    each tile over K as it goes. EVEN: N % BLOCK_N == 0 and K % BLOCK_K == 0 (no masks)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(x_ptr + cols)
            w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
        else:
            col_ok = cols < K
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)
