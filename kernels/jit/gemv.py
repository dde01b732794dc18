"""One token's matrix-vector product, bound by reading the weights: the @triton.jit kernel (wrapper:
kernels/gemv_ops.py).

Besides y = w @ x, the kernel can take the elementwise work between a gated MLP's two products and after them, so
that neither is a launch of its own: with GATED, x holds [g, u] (the gate's and the up product's K values each)
and the product reads silu(g) * u; with RESIDUAL, y + res is stored instead of y. Each intermediate is rounded to the
model's dtype where the model's eager modules round it (transformers' Llama MLP and residual add:
kernels/reference/gemv.py). (Taking the residual add and the RMSNorm before the gate/up product as well, every
program recomputing the norm of the whole input, made a decode step slower: engine/bench/README.md.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior


@triton.jit
def _tile(w_rows, cols, row_ok, K, EVEN: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] at columns cols (w evicted first: never read again in the step)."""
    if EVEN:
        w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
    else:
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0,
                    eviction_policy="evict_first")
    return w


@triton.jit
def _x(x_ptr, cols, K, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(x_ptr + cols)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0)


@triton.jit
def _input(x_ptr, cols, K, GATED: tl.constexpr, EVEN: tl.constexpr):
    """The product's input at columns cols, float32: x, or with GATED silu(g) rounded, times u, rounded."""
    if GATED:
        g = _x(x_ptr, cols, K, EVEN)
        gf = g.to(tl.float32)
        act = (gf * tl.sigmoid(gf)).to(g.dtype)
        return (act.to(tl.float32) * _x(x_ptr + K, cols, K, EVEN).to(tl.float32)).to(g.dtype).to(tl.float32)
    return _x(x_ptr, cols, K, EVEN).to(tl.float32)


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, b_ptr, res_ptr, y_ptr, N, K, stride_w,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """y [N] = w [N, K] @ input [K] (+ b [N]) (+ res [N] with RESIDUAL), accumulated in float32: program p streams
    rows p * BLOCK_N ... of w, BLOCK_K columns at a time, each read once, and reduces each tile over K as it goes.
    input: x [K], or with GATED silu(x[:K]) * x[K:] (x [2K]). EVEN: N % BLOCK_N == 0 and K % BLOCK_K == 0 (no
    masks). PDL (kernels/launch.py): the first tile of weights is read before waiting for the kernel that writes x
    (weights are no kernel's output), and the next kernel is released at once."""
    release_next(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    cols = tl.arange(0, BLOCK_K)
    w = _tile(w_rows, cols, row_ok, K, EVEN)
    wait_prior(PDL)
    acc = tl.sum(w.to(tl.float32) * _input(x_ptr, cols, K, GATED, EVEN)[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = _tile(w_rows, cols, row_ok, K, EVEN)
        acc += tl.sum(w.to(tl.float32) * _input(x_ptr, cols, K, GATED, EVEN)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = acc.to(y_ptr.dtype.element_ty)
    if RESIDUAL:  # the product rounded, plus the residual, rounded (the model's residual add)
        y = (y.to(tl.float32) + tl.load(res_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)).to(y.dtype)
    tl.store(y_ptr + rows, y, mask=row_ok)
