"""Saap's lookup kernels.

The bucket scores: each query row (a query head of the KV head's group at one token) de-RoPE'd at its position
(float64 angles reduced modulo 2 pi, then float32 cos/sin), normalised, through the KV head's 2-layer MLP (exact
GELU), softmax over the buckets, the rows summed and scaled by 1 / Lq. Float32 weights; the matrix products in
3xTF32 on a GPU (float32's precision on the tensor cores).
logits_kernel (a block of rows or fewer: decode): the buckets spread over programs, each writing its chunk's logits
for every row; pick_kernel: one program per KV head normalises them and sums, then picks the best buckets.

The best buckets (take_best_kernel alone, or after the scores in pick_kernel): per row the threshold tau, the highest
bucket score whose buckets at or above it hold at least `budget` keys, by a sort in registers (the scores packed
with the sizes) and a prefix sum."""

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior


@triton.jit
def _hidden(q_ptr, pos_ptr, freq_ptr, w1_ptr, b1_ptr, h, r, stride_qh, stride_qt, LQ, ROWS, HALF, HIDDEN,
            GROUP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """Rows r [BLOCK_R] of KV head h's group (row = query head in the group x LQ + token) -> the classifier's
    hidden layer [BLOCK_R, BLOCK_H] float32 (zero in the padding)."""
    rv = r < ROWS
    t = r % LQ
    head = h * GROUP + r // LQ
    j = tl.arange(0, BLOCK_D)
    jv = j < HALF
    xm = rv[:, None] & jv[None, :]
    base = q_ptr + head[:, None] * stride_qh + t[:, None] * stride_qt
    a = tl.load(base + j[None, :], mask=xm, other=0.0).to(tl.float32)
    b = tl.load(base + HALF + j[None, :], mask=xm, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + t, mask=rv, other=0).to(tl.float64)
    freq = tl.load(freq_ptr + j, mask=jv, other=0.0).to(tl.float64)
    k = tl.arange(0, BLOCK_H)
    kv = k < HIDDEN
    w1 = w1_ptr + h * 2 * HALF * HIDDEN
    wm = jv[:, None] & kv[None, :]
    w1a = tl.load(w1 + j[:, None] * HIDDEN + k[None, :], mask=wm, other=0.0)  # (every load first: their latencies
    w1b = tl.load(w1 + (HALF + j)[:, None] * HIDDEN + k[None, :], mask=wm, other=0.0)  # overlap)
    b1 = tl.load(b1_ptr + h * HIDDEN + k, mask=kv, other=0.0)
    angle = pos[:, None] * freq[None, :]
    two_pi = tl.full((), 6.283185307179586, tl.float64)  # (a bare literal would be a float32 constant)
    angle = (angle - two_pi * tl.floor(angle / two_pi)).to(tl.float32)
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    xa = a * cos + b * sin
    xb = b * cos - a * sin
    norm = tl.sqrt(tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1))
    inv = 1.0 / tl.maximum(norm, 1e-12)
    xa = xa * inv[:, None]
    xb = xb * inv[:, None]

    hid = tl.dot(xa, w1a, input_precision=PRECISION) + tl.dot(xb, w1b, input_precision=PRECISION)
    hid += b1[None, :]
    return 0.5 * hid * (1.0 + tl.erf(hid * 0.7071067811865476))  # exact GELU (zero in the padding)


@triton.jit
def _out_layer(w2_ptr, b2_ptr, h, cc, C, HIDDEN, BLOCK_H: tl.constexpr):
    """KV head h's output layer for buckets cc [BLOCK_C]: (weights [BLOCK_H, BLOCK_C], bias [BLOCK_C])."""
    k = tl.arange(0, BLOCK_H)
    cv = cc < C
    w = tl.load(w2_ptr + h * HIDDEN * C + k[:, None] * C + cc[None, :], mask=(k < HIDDEN)[:, None] & cv[None, :],
                other=0.0)
    return w, tl.load(b2_ptr + h * C + cc, mask=cv, other=0.0)


@triton.jit
def _logits(hid, w, bias, cc, C, PRECISION: tl.constexpr):
    """hid [BLOCK_R, BLOCK_H] through an output layer's tile -> logits [BLOCK_R, BLOCK_C] (-inf past C)."""
    logit = tl.dot(hid, w, input_precision=PRECISION) + bias[None, :]
    return tl.where((cc < C)[None, :], logit, float("-inf"))


@triton.jit
def logits_kernel(
    q_ptr, pos_ptr, freq_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,  # as classify_kernel's
    out_ptr,  # [Hkv, ROWS, C] float32 out: every row's logits
    stride_qh,
    stride_qt,
    LQ,
    ROWS,  # GROUP * LQ <= BLOCK_R
    C,
    HALF,
    HIDDEN,
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,  # buckets per program
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """A step of few query rows (decode): program (h, chunk) writes KV head h's logits of one chunk of buckets (the
    buckets spread over programs; softmax_sum_kernel normalises)."""
    wait_prior(PDL)
    release_next(PDL)
    h = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    w, bias = _out_layer(w2_ptr, b2_ptr, h, cc, C, HIDDEN, BLOCK_H)  # loaded first: its latency overlaps the rest
    hid = _hidden(q_ptr, pos_ptr, freq_ptr, w1_ptr, b1_ptr, h, r, stride_qh, stride_qt, LQ, ROWS, HALF, HIDDEN,
                  GROUP, BLOCK_D, BLOCK_H, PRECISION)
    logit = _logits(hid, w, bias, cc, C, PRECISION)
    tl.store(out_ptr + (h * ROWS + r[:, None]) * C + cc[None, :], logit, mask=(r < ROWS)[:, None] & (cc < C)[None, :])


@triton.jit
def _take_best(s, n, valid, budget):
    """A row's scores s [BLOCK_C] float32 and sizes n [BLOCK_C] int64 (valid where `valid`) -> keep [BLOCK_C]:
    each score as an order-preserving integer packed with its size into one int64, sorted in descending order, the
    sizes' prefix sum; tau is the score where it first reaches the budget (the lowest where it never does)."""
    bits = (s + 0.0).to(tl.int32, bitcast=True)  # (-0.0 -> +0.0)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # ordered as the floats are
    packed = tl.where(valid, (key.to(tl.int64) << 32) | n, -9223372036854775807 - 1)
    ranked = tl.sort(packed, descending=True)
    held = tl.cumsum(ranked & 0xFFFFFFFF, axis=0)  # keys in the buckets up to each rank
    top = (ranked >> 32).to(tl.int32)
    lowest = tl.min(tl.where(valid, key, 2147483647), axis=0)
    reach = tl.max(tl.where((held.to(tl.float32) >= budget) & (ranked != -9223372036854775807 - 1), top,
                            -2147483647 - 1), axis=0)
    return key >= tl.maximum(reach, lowest)


@triton.jit
def pick_kernel(
    logits_ptr,  # [H, ROWS, C] float32
    sizes_ptr,  # [H, C] int64 (< 2^31 each; HAS_SIZES)
    score_ptr,  # [H, C] float32 out: the rows' softmax over C, summed, times `weight`
    keep_ptr,  # [H, C] bool out: take_best of the scores (PER_KEY: of the scores over max(size, 1))
    ROWS,
    C,
    weight,
    budget,
    HAS_SIZES: tl.constexpr,  # False: the scores alone
    PER_KEY: tl.constexpr,  # the buckets ranked by score per key (kernels.reference.buckets.ranking)
    BLOCK_C: tl.constexpr,  # >= C, a power of two
    starts_ptr=None,  # BLOCKS: [H, C + 1] int64, bucket c of head h at positions starts[h, c] .. starts[h, c + 1] - 1
    block_sums_ptr=None,  # BLOCKS: [H, NB] int64 out, the kept buckets' positions per block of BLOCK_G buckets
    NB=1,
    BLOCKS: tl.constexpr = False,  # (HAS_SIZES) the expansion's first step here (kernels/jit/compact.py)
    BLOCK_G: tl.constexpr = 16,  # divides BLOCK_C
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    wait_prior(PDL)
    release_next(PDL)
    h = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    valid = cc < C
    acc = tl.zeros((BLOCK_C,), tl.float32)
    for r in range(0, ROWS):
        logit = tl.load(logits_ptr + (h * ROWS + r) * C + cc, mask=valid, other=float("-inf"))
        e = tl.exp(logit - tl.max(logit, axis=0))
        acc += e / tl.sum(e, axis=0)
    score = acc * weight
    tl.store(score_ptr + h * C + cc, score, mask=valid)
    if HAS_SIZES:
        n = tl.load(sizes_ptr + h * C + cc, mask=valid, other=0)
        rank = score
        if PER_KEY:
            rank = score / tl.maximum(n, 1).to(tl.float32)
        keep = _take_best(rank, n, valid, budget)
        tl.store(keep_ptr + h * C + cc, keep, mask=valid)
        if BLOCKS:
            lo = tl.load(starts_ptr + h * (C + 1) + cc, mask=valid, other=0)
            hi = tl.load(starts_ptr + h * (C + 1) + cc + 1, mask=valid, other=0)
            held = tl.reshape(tl.where(keep & valid, hi - lo, 0), (BLOCK_C // BLOCK_G, BLOCK_G))
            j = tl.arange(0, BLOCK_C // BLOCK_G)
            tl.store(block_sums_ptr + h * NB + j, tl.sum(held, axis=1), mask=j < NB)


@triton.jit
def take_best_kernel(
    score_ptr,  # [H, C] float32
    sizes_ptr,  # [H, C] int64 (< 2^31 each)
    keep_ptr,  # [H, C] bool out
    C,
    budget,  # float: keys to reach
    BLOCK_C: tl.constexpr,  # >= C, a power of two
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    wait_prior(PDL)
    release_next(PDL)
    h = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    valid = cc < C
    s = tl.load(score_ptr + h * C + cc, mask=valid, other=0.0)
    n = tl.load(sizes_ptr + h * C + cc, mask=valid, other=0)
    tl.store(keep_ptr + h * C + cc, _take_best(s, n, valid, budget), mask=valid)
