"""The follow part of a step's attention: attention over the follow rows a selection row does not hold, the
@triton.jit kernel (wrapper: kernels/follow_ops.py; reference: kernels/reference/follow.py), and its two steps as
@triton.jit functions (`fresh_rows`, `follow_keys`) that the union kernel (kernels/jit/union.py) runs as a work item."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.jit.merge import merge_pair
from kernels.launch import release_next, wait_prior

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# Arguments that follow a context's size, not specialised on (kernels/README.md)
ATTN_SIZES = ["first", "indexed", "stride_order"]


@triton.jit
def fresh_rows(
    pos_ptr, order_ptr, indptr_ptr, indices_ptr, r, h, first, indexed, m_rows, stride_order,
    HAS_ORDER: tl.constexpr, PROBES: tl.constexpr, ROUNDS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The follow rows of selection row r (KV head h): each of the m_rows token positions (-1: none) maps to a row
    of the K/V (position - first, if in [0, indexed); through order[h] when HAS_ORDER) and is fresh unless row r of
    the selection (sorted indices in [indptr[r], indptr[r + 1])) holds it: a search of ROUNDS rounds of PROBES
    loads, each cutting the range PROBES-fold (a binary search's log2(N) dependent loads cost an 8B-shaped decode
    step 0.2 ms more at 128K). Returns (row [BLOCK_K] int64, fresh [BLOCK_K] bool; False past m_rows)."""
    offs_k = tl.arange(0, BLOCK_K)
    in_list = offs_k < m_rows
    pos = tl.load(pos_ptr + offs_k, mask=in_list, other=-1)
    stored = pos - first
    valid = in_list & (pos >= 0) & (stored >= 0) & (stored < indexed)
    stored = tl.where(valid, stored, 0)
    if HAS_ORDER:
        row = tl.load(order_ptr + h * stride_order + stored, mask=valid, other=0).to(tl.int64)
    else:
        row = stored.to(tl.int64)
    start = tl.load(indptr_ptr + r).to(tl.int64)
    end = tl.load(indptr_ptr + r + 1).to(tl.int64)
    lo = tl.zeros([BLOCK_K], dtype=tl.int64) + start
    hi = tl.zeros([BLOCK_K], dtype=tl.int64) + end
    # the first entry >= row in [lo, hi): a PROBES-ary search (ROUNDS dependent loads, not log2 of the row's length)
    j = tl.arange(0, PROBES).to(tl.int64)
    for _ in tl.static_range(ROUNDS):
        step = (hi - lo + PROBES - 1) // PROBES  # [BLOCK_K]
        at = lo[:, None] + j[None, :] * step[:, None]  # [BLOCK_K, PROBES], increasing
        inside = valid[:, None] & (at < hi[:, None])
        val = tl.load(indices_ptr + at, mask=inside, other=0).to(tl.int64)
        below = inside & (val < row[:, None])
        c = tl.sum(below.to(tl.int64), axis=1)  # probes before the answer
        new_lo = tl.where(c > 0, lo + (c - 1) * step + 1, lo)
        hi = tl.minimum(tl.where(c < PROBES, lo + c * step, hi), hi)
        lo = new_lo
    here = valid & (lo < end)
    found = tl.load(indices_ptr + lo, mask=here, other=-1).to(tl.int64)
    return row, valid & ~(here & (found == row))


@triton.jit
def follow_keys(q, k_ptr, v_ptr, h, row, fresh, stride_kh, stride_kn, stride_vh, stride_vn, qk_scale, offs_d,
                EXACT_FP32: tl.constexpr):
    """Attention of the query tile q [BLOCK_M, HEAD_DIM] (the keys' dtype) over the fresh rows `row` of KV head h
    (unit stride in D); qk_scale = scale * log2(e); EXACT_FP32: fp32 products in IEEE precision. Returns acc
    [BLOCK_M, HEAD_DIM] (unnormalised, fp32), m [BLOCK_M] (max score, log2 domain, -inf without a fresh row) and l
    [BLOCK_M] (sum of exp2(s - m); 0 without)."""
    kk = tl.load(k_ptr + h * stride_kh + row[:, None] * stride_kn + offs_d[None, :], mask=fresh[:, None], other=0.0)
    if EXACT_FP32:
        s = tl.dot(q, tl.trans(kk), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(kk)) * qk_scale  # [BLOCK_M, BLOCK_K] fp32, log2 domain
    s = tl.where(fresh[None, :], s, float("-inf"))
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.where(fresh[None, :], tl.exp2(s - m_safe[:, None]), 0.0)
    vv = tl.load(v_ptr + h * stride_vh + row[:, None] * stride_vn + offs_d[None, :], mask=fresh[:, None], other=0.0)
    if EXACT_FP32:
        acc = tl.dot(p.to(vv.dtype), vv, input_precision="ieee")
    else:
        acc = tl.dot(p.to(vv.dtype), vv)
    return acc, m, tl.sum(p, axis=1)


@triton.jit(do_not_specialize=ATTN_SIZES)
def follow_attn_kernel(
    q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, pos_ptr, order_ptr, out_ptr, lse_ptr, fresh_ptr,
    qk_scale, first, indexed, lq, n_q, m_rows, rows, hkv,
    stride_qh, stride_ql, stride_kh, stride_kn, stride_vh, stride_vn, stride_oh, stride_ol, stride_order,
    HEADS_PER_ROW: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    HAS_PRIOR: tl.constexpr,
    PROBES: tl.constexpr,
    ROUNDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """Program (r, b): selection row r (KV head r * hkv // rows), queries b * BLOCK_M .. of its HEADS_PER_ROW x lq
    (query i: head r * HEADS_PER_ROW + i // lq, token i % lq), over the m_rows follow rows that row r does not
    select (`fresh_rows`). Program (r, 0) writes fresh [rows, m_rows] int8. out [Hq, Lq, D] fp32 and lse [Hq * Lq]
    fp32 (natural log; -inf and out 0 without a fresh row); with HAS_PRIOR they hold the selection's own attention
    on entry and the union's on exit (the two merged by log-sum-exp here: no merge kernel after this one).
    qk_scale = scale * log2(e).
    """
    wait_prior(PDL)
    release_next(PDL)
    r = tl.program_id(0)
    b = tl.program_id(1)
    h = (r * hkv // rows).to(tl.int64)
    row, fresh = fresh_rows(pos_ptr, order_ptr, indptr_ptr, indices_ptr, r, h, first, indexed, m_rows, stride_order,
                            HAS_ORDER, PROBES, ROUNDS, BLOCK_K)
    if b == 0:
        offs_k = tl.arange(0, BLOCK_K)
        tl.store(fresh_ptr + r * m_rows + offs_k, fresh.to(tl.int8), mask=offs_k < m_rows)

    offs_m = b * BLOCK_M + tl.arange(0, BLOCK_M)
    ok_m = offs_m < n_q
    head = (r * HEADS_PER_ROW + offs_m // lq).to(tl.int64)
    tok = (offs_m % lq).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + head[:, None] * stride_qh + tok[:, None] * stride_ql + offs_d[None, :], mask=ok_m[:, None],
                other=0.0).to(k_ptr.dtype.element_ty)
    acc, m, l_sum = follow_keys(q, k_ptr, v_ptr, h, row, fresh, stride_kh, stride_kn, stride_vh, stride_vn, qk_scale,
                                offs_d, k_ptr.dtype.element_ty == tl.float32)
    seen = l_sum > 0
    out = acc / tl.where(seen, l_sum, 1.0)[:, None]
    lse = tl.where(seen, (m + tl.log2(tl.where(seen, l_sum, 1.0))) * LN2, float("-inf"))
    out_at = out_ptr + head[:, None] * stride_oh + tok[:, None] * stride_ol + offs_d[None, :]
    if HAS_PRIOR:  # the fresh rows' part joined with the prior's
        prior_lse = tl.load(lse_ptr + head * lq + tok, mask=ok_m, other=float("-inf"))
        prior_out = tl.load(out_at, mask=ok_m[:, None], other=0.0)
        out, lse = merge_pair(out, lse, prior_out, prior_lse)
    tl.store(out_at, out, mask=ok_m[:, None])
    tl.store(lse_ptr + head * lq + tok, lse, mask=ok_m)
