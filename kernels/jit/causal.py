"""Dense FlashAttention with position masks (causal, optional sliding window): the @triton.jit kernel (wrapper:
kernels/causal_ops.py; semantics: kernels.reference.causal_attention).

Vocabulary:
    M = G * Lq   the query rows of one KV head: its G = Hq // Hkv query heads stacked along the Lq tokens (m -> head
                 kvh * G + m // Lq, token m % Lq), as in kernels/jit/sparse.py, so each key block is loaded once for
                 the whole group
    positions    query token i sits at q_pos[i], read from device memory (the engine replays the call in a CUDA graph
                 with new positions); key j sits at k_start + j (a launch argument). Query i sees key j iff
                 k_start + j <= q_pos[i] and, with WINDOW, k_start + j > q_pos[i] - window.

Scores are kept in the log2 domain (q.k * scale * log2(e)); the stored lse is natural.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.jit.merge import merge_pair
from kernels.launch import release_next, wait_prior

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


# Arguments that follow a context's size, not specialised on (kernels/README.md)
ATTN_SIZES = ["k_start"]


@triton.jit
def causal_keys(
    q, k_base, v_base, lo, hi, last, window, acc, m_i, l_i, offs_d,
    stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
    BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, EXACT_FP32: tl.constexpr,
):
    """The online softmax of the query tile q [BLOCK_M, HEAD_DIM] over key slots lo .. hi - 1 of one KV head
    (k_base / v_base point at its slot 0), BLOCK_N at a time, each row seeing the slots up to last [BLOCK_M] int32
    (its position - k_start) and, with WINDOW, after last - window. Scores in the log2 domain (qk_scale = scale *
    log2(e)). Returns (acc [BLOCK_M, HEAD_DIM] unnormalised fp32, m_i, l_i); l_i stays 0 for a row that sees no key."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key slots (int32)
        n_valid = offs_n < hi
        rows = offs_n.to(tl.int64)
        k = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=n_valid[:, None],
                    other=0.0)  # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=n_valid[:, None],
                    other=0.0)
        if EXACT_FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N], unscaled
        visible = n_valid[None, :] & (offs_n[None, :] <= last[:, None])  # [BLOCK_M, BLOCK_N]
        if WINDOW:
            visible = visible & (offs_n[None, :] > last[:, None] - window)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no (-inf) - (-inf)
        p = tl.exp2(s - m_ref[:, None])  # 0 where masked
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if EXACT_FP32:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=ATTN_SIZES)
def causal_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, q_pos_ptr, out_ptr, lse_ptr, prior_out_ptr, prior_lse_ptr,
    stride_qh, stride_ql, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_p,
    stride_oh, stride_ol, stride_ph, stride_pl,
    group, lq, lk, k_start, window, qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    EXACT_FP32: tl.constexpr,
    HAS_PRIOR: tl.constexpr = False,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """Attention of BLOCK_M query rows of one KV head over the keys their positions can see. Grid
    (cdiv(M, BLOCK_M), Hkv).

    q [Hq, Lq, HEAD_DIM], k / v [Hkv, Lk, HEAD_DIM] (any strides); q_pos [Lq] int32/int64 (stride stride_p);
    qk_scale = scale * log2(e); window must be 0 without WINDOW (it also bounds the clamp of the positions).
    Writes out [Hq, Lq, HEAD_DIM] (strides stride_oh, stride_ol, unit in D; any float dtype) and lse [Hq * Lq] fp32
    (natural log; 0 and -inf for a row that sees no key). HAS_PRIOR: merged first with the attention over other keys
    given as prior_out [Hq, Lq, HEAD_DIM] fp32 (strides stride_ph, stride_pl, unit in D) and prior_lse [Hq * Lq] fp32
    (natural log, -inf for none): the stored out and lse are those of the union.

    Only the key blocks that some row of the tile can see are visited: up to hi = min(Lk, max position - k_start + 1)
    and, with WINDOW, from the block holding min position - window + 1 - k_start. Keys at or past hi are never read
    (a static buffer's unwritten slots past the newest query stay unread). Every block is masked per row.
    """
    wait_prior(PDL)
    release_next(PDL)
    kv_head = tl.program_id(1).to(tl.int64)
    # Tiles in reverse order: under causal masking the last tiles see the most keys, so they start first.
    offs_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    num_m = group * lq
    m_valid = offs_m < num_m
    head = kv_head * group + offs_m // lq  # [BLOCK_M] query head of each row (int64)
    tok = offs_m % lq  # [BLOCK_M] token of each row, < lq also for the padding rows past M
    q = tl.load(
        q_ptr + head[:, None] * stride_qh + tok[:, None] * stride_ql + offs_d[None, :] * stride_qd,
        mask=m_valid[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM], input dtype
    pos = tl.load(q_pos_ptr + tok * stride_p).to(tl.int64)  # [BLOCK_M]; padding rows repeat real tokens' positions
    # Each row's newest visible key slot, in int32 for cheap masks. Clamping to [-1, lk + window] (window 0 without
    # WINDOW) changes no answer: -1 sees no key; lk sees every key, lk + window none within the window.
    last = tl.minimum(tl.maximum(pos - k_start, -1), lk + window).to(tl.int32)  # [BLOCK_M]
    hi = tl.minimum(tl.max(last, 0) + 1, lk)  # slots [0, hi) can be visible; hi <= 0: none
    if WINDOW:
        lo = tl.maximum(tl.min(last, 0) - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        lo = hi * 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i); 0 until a key is seen
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, m_i, l_i = causal_keys(q, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, lo, hi, last, window,
                                acc, m_i, l_i, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
                                BLOCK_N, WINDOW, EXACT_FP32)

    empty = l_i == 0.0  # a row that saw a key has l_i >= 1 (its max contributes exp2(0))
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    o = acc / l_safe[:, None]
    flat = kv_head * num_m + offs_m  # [BLOCK_M] rows of lse [Hq * Lq]: head * Lq + token
    tok64 = tok.to(tl.int64)
    if HAS_PRIOR:  # log-sum-exp merge with the other keys' attention
        p_lse = tl.load(prior_lse_ptr + flat, mask=m_valid, other=float("-inf"))
        p_out = tl.load(prior_out_ptr + head[:, None] * stride_ph + tok64[:, None] * stride_pl + offs_d[None, :],
                        mask=m_valid[:, None], other=0.0)
        o, lse = merge_pair(o, lse, p_out, p_lse)
    tl.store(out_ptr + head[:, None] * stride_oh + tok64[:, None] * stride_ol + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])
    tl.store(lse_ptr + flat, lse, mask=m_valid)
