"""Log-sum-exp merge of two partial attentions over disjoint key sets: the @triton.jit kernel (wrapper:
kernels/merge_ops.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior


@triton.jit
def merge_pair(out_a, lse_a, out_b, lse_b):
    """Log-sum-exp merge of two partial attentions over disjoint key sets, row by row: out_a / out_b [R, D] fp32
    (normalised), lse_a / lse_b [R] fp32 (natural log, -inf for an empty part) -> (out [R, D], lse [R]) of the
    union (out 0 and lse -inf where both parts are empty)."""
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)  # 0 for an empty part
    w_b = tl.exp(lse_b - m_safe)
    total = w_a + w_b
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    out = out_a * (w_a * inv)[:, None] + out_b * (w_b * inv)[:, None]
    lse = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def merge_two_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr,
    n_rows, lq,
    stride_ah, stride_al, stride_bh, stride_bl, stride_oh, stride_ol,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """BLOCK_R (head, token) rows per program, row i = head i // lq, token i % lq.

    out_a / out_b: [H, Lq, HEAD_DIM] fp32 (unit stride in D), lse_a / lse_b: [H * Lq] fp32 contiguous (natural log,
    -inf for an empty part) -> out [H, Lq, HEAD_DIM] in out's dtype and strides (unit stride in D), lse [H * Lq] fp32
    (-inf and out = 0 where both parts are empty).
    """
    wait_prior(PDL)
    release_next(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n_rows
    head = (rows // lq).to(tl.int64)
    tok = (rows % lq).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_a = tl.load(lse_a_ptr + rows, mask=ok, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + rows, mask=ok, other=float("-inf"))
    a = tl.load(out_a_ptr + head[:, None] * stride_ah + tok[:, None] * stride_al + offs_d[None, :], mask=ok[:, None],
                other=0.0)
    b = tl.load(out_b_ptr + head[:, None] * stride_bh + tok[:, None] * stride_bl + offs_d[None, :], mask=ok[:, None],
                other=0.0)
    out, lse = merge_pair(a, lse_a, b, lse_b)
    tl.store(out_ptr + head[:, None] * stride_oh + tok[:, None] * stride_ol + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok[:, None])
    tl.store(lse_ptr + rows, lse, mask=ok)
