"""Quest's page scores: for each row of heads and each page of keys, the upper bound of q . k over the page's keys
from the page's element-wise key bounds (Quest, section 3.2).

For one query q and a page with bounds min, max [D]:  sum_i max(q_i min_i, q_i max_i) = q+ . max + q- . min,
where q+ = max(q, 0) and q- = min(q, 0). The bound is linear in (q+, q-), so the sum over a row's query heads
(one selection per KV head) and the mean over a question's tokens are taken on q+ and q- before the two dot
products: one pass over the bounds, two dot products per page.
"""

import triton
import triton.language as tl


@triton.jit
def page_scores_kernel(
    q_ptr,  # [Hq, 1, D] the decode step's query (unused when REDUCED)
    reduced_ptr,  # [rows, 4, D] float32 when REDUCED: the row's summed q+ and q- of the tokens' mean, then of the last
    min_ptr,  # [Hkv, P, D] element-wise minimum of each page's keys
    max_ptr,  # [Hkv, P, D] element-wise maximum
    out_ptr,  # [rows, P] float32 out: max(bound of the tokens' mean, bound of the last token), summed over the row
    P,
    stride_qh,
    stride_bh,
    stride_bp,
    HEADS_PER_ROW: tl.constexpr,  # query heads a row sums (Hq / rows)
    ROWS_PER_KV: tl.constexpr,  # rows per KV head (rows / Hkv)
    REDUCED: tl.constexpr,  # a question's prefill: its tokens reduced beforehand (pages_ops.page_scores)
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    r = tl.program_id(0)
    pb = tl.program_id(1)
    h = r // ROWS_PER_KV
    d = tl.arange(0, D)
    if REDUCED:
        pos_mean = tl.load(reduced_ptr + (r * 4 + 0) * D + d)
        neg_mean = tl.load(reduced_ptr + (r * 4 + 1) * D + d)
        pos_last = tl.load(reduced_ptr + (r * 4 + 2) * D + d)
        neg_last = tl.load(reduced_ptr + (r * 4 + 3) * D + d)
    else:  # one token: its mean is itself
        pos_mean = tl.zeros([D], dtype=tl.float32)
        neg_mean = tl.zeros([D], dtype=tl.float32)
        for g in range(HEADS_PER_ROW):
            qv = tl.load(q_ptr + (r * HEADS_PER_ROW + g) * stride_qh + d).to(tl.float32)
            pos_mean += tl.maximum(qv, 0.0)
            neg_mean += tl.minimum(qv, 0.0)
        pos_last = pos_mean
        neg_last = neg_mean
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    m = p < P
    offs = h * stride_bh + p[:, None] * stride_bp + d[None, :]
    lo = tl.load(min_ptr + offs, mask=m[:, None], other=0.0).to(tl.float32)  # [BLOCK_P, D]
    hi = tl.load(max_ptr + offs, mask=m[:, None], other=0.0).to(tl.float32)
    mean = tl.sum(hi * pos_mean[None, :] + lo * neg_mean[None, :], axis=1)
    last = tl.sum(hi * pos_last[None, :] + lo * neg_last[None, :], axis=1)
    tl.store(out_ptr + r * P + p, tl.maximum(mean, last), mask=m)


@triton.jit
def _count_at_least(scores_ptr, row, P, t, SINGLE: tl.constexpr, scores, BLOCK: tl.constexpr):
    """Pages of a row whose score is >= t (from `scores` in registers when SINGLE, else chunk by chunk)."""
    if SINGLE:
        return tl.sum((scores >= t).to(tl.int32), axis=0)
    n = tl.zeros([], dtype=tl.int32)
    for start in range(0, P, BLOCK):
        p = start + tl.arange(0, BLOCK)
        x = tl.load(scores_ptr + row * P + p, mask=p < P, other=float("-inf"))
        n += tl.sum((x >= t).to(tl.int32), axis=0)
    return n


@triton.jit
def page_threshold_kernel(
    scores_ptr,  # [rows, P] float32 page scores
    bracket_ptr,  # [rows, 2] float32 out: lo, hi with count(score >= lo) >= K > count(score >= hi)
    room_ptr,  # [rows] int32 out: K - count(score >= hi), the pages to take among the candidates in [lo, hi)
    above_ptr,  # [rows, NCH] int32 out: pages at or above hi in each chunk of CHUNK pages
    cand_ptr,  # [rows, NCH] int32 out: candidates (in [lo, hi)) in each chunk
    P,
    K,  # pages to keep, 0 <= K <= P
    NCH,  # chunks of CHUNK pages
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,  # the whole row fits one block: it stays in registers across the search
    ITERS: tl.constexpr,  # bisection steps
    CHUNK: tl.constexpr,  # divides BLOCK when SINGLE
):
    """The first half of Quest's selection, one program per row: a bracket [lo, hi) of the K-th score by bisection
    between the row's lowest and highest score, and per chunk the pages above it and the candidates within it (what
    page_write_kernel's programs need to place their chunk's keys without a prefix sum of their own)."""
    row = tl.program_id(0)
    p = tl.arange(0, BLOCK)
    if SINGLE:
        scores = tl.load(scores_ptr + row * P + p, mask=p < P, other=float("-inf"))
        lo = tl.min(tl.where(p < P, scores, float("inf")), axis=0)
        hi = tl.max(scores, axis=0)
    else:
        scores = tl.zeros([BLOCK], dtype=tl.float32)
        lo = tl.full([], float("inf"), dtype=tl.float32)
        hi = tl.full([], float("-inf"), dtype=tl.float32)
        for start in range(0, P, BLOCK):
            q = start + p
            x = tl.load(scores_ptr + row * P + q, mask=q < P, other=float("-inf"))
            lo = tl.minimum(lo, tl.min(tl.where(q < P, x, float("inf")), axis=0))
            hi = tl.maximum(hi, tl.max(x, axis=0))
    hi = hi + tl.maximum(tl.abs(hi), 1e-30) * 1e-6  # exclusive: count(>= hi) = 0 < K
    for _ in range(ITERS):
        mid = lo + (hi - lo) * 0.5
        enough = _count_at_least(scores_ptr, row, P, mid, SINGLE, scores, BLOCK) >= K
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    tl.store(bracket_ptr + row * 2, lo)
    tl.store(bracket_ptr + row * 2 + 1, hi)
    tl.store(room_ptr + row, K - _count_at_least(scores_ptr, row, P, hi, SINGLE, scores, BLOCK))
    if SINGLE:
        above = tl.reshape((scores >= hi).to(tl.int32), (BLOCK // CHUNK, CHUNK))
        cand = tl.reshape(((scores >= lo) & (scores < hi)).to(tl.int32), (BLOCK // CHUNK, CHUNK))
        n = tl.arange(0, BLOCK // CHUNK)
        tl.store(above_ptr + row * NCH + n, tl.sum(above, axis=1), mask=n < NCH)
        tl.store(cand_ptr + row * NCH + n, tl.sum(cand, axis=1), mask=n < NCH)
    else:
        c = tl.arange(0, CHUNK)
        for n in range(0, NCH):
            page = n * CHUNK + c
            x = tl.load(scores_ptr + row * P + page, mask=page < P, other=float("-inf"))
            tl.store(above_ptr + row * NCH + n, tl.sum((x >= hi).to(tl.int32), axis=0))
            tl.store(cand_ptr + row * NCH + n, tl.sum(((x >= lo) & (x < hi)).to(tl.int32), axis=0))


@triton.jit
def page_write_kernel(
    scores_ptr,  # [rows, P] float32 page scores
    bracket_ptr,  # [rows, 2], room_ptr [rows], above_ptr / cand_ptr [rows, NCH]: page_threshold_kernel's
    room_ptr,
    above_ptr,
    cand_ptr,
    keep_ptr,  # [rows, P] bool out: the row's K best pages (ties with the K-th broken by page order)
    indptr_ptr,  # [rows + 1] int64 out: row r's keys at [r * PER_ROW, (r + 1) * PER_ROW)
    indices_ptr,  # [rows * PER_ROW] int32 out: the kept pages' keys in page order, then every key from P * PAGE on
    P,
    K,
    NCH,
    NUM_KEYS,  # keys of the fixed K/V: those from P * PAGE on (a partial page, the dense tail) are always read
    PER_ROW,  # K * PAGE + NUM_KEYS - P * PAGE
    PAGE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a power of two >= NCH
):
    """The second half, a program per (row, chunk of pages): every page at or above hi and the first candidates
    (page order) until K pages, their keys written where the chunks before put theirs; the program past the last
    chunk writes the keys every row reads and the CSR offsets."""
    row = tl.program_id(0)
    n = tl.program_id(1)
    base = row.to(tl.int64) * PER_ROW
    c = tl.arange(0, CHUNK)
    if n == NCH:
        if row == 0:
            tl.store(indptr_ptr, tl.zeros([], dtype=tl.int64))
        tl.store(indptr_ptr + row + 1, base + PER_ROW)
        rest = NUM_KEYS - P * PAGE
        for start in range(0, rest, CHUNK):
            i = start + c
            tl.store(indices_ptr + base + K * PAGE + i, (P * PAGE + i).to(tl.int32), mask=i < rest)
    else:
        lo = tl.load(bracket_ptr + row * 2)
        hi = tl.load(bracket_ptr + row * 2 + 1)
        room = tl.load(room_ptr + row)
        b = tl.arange(0, BLOCK_N)
        before = b < n
        above_before = tl.sum(tl.load(above_ptr + row * NCH + b, mask=before, other=0), axis=0)
        cand_before = tl.sum(tl.load(cand_ptr + row * NCH + b, mask=before, other=0), axis=0)
        kept_before = above_before + tl.minimum(cand_before, room)
        page = n * CHUNK + c
        inside = page < P
        x = tl.load(scores_ptr + row * P + page, mask=inside, other=float("-inf"))
        cand = (x >= lo) & (x < hi) & inside
        rank = cand_before + tl.cumsum(cand.to(tl.int32), axis=0) - cand.to(tl.int32)
        keep = ((x >= hi) & inside) | (cand & (rank < room))
        tl.store(keep_ptr + row * P + page, keep.to(tl.int1), mask=inside)
        at = kept_before + tl.cumsum(keep.to(tl.int32), axis=0) - keep.to(tl.int32)  # the page's place among kept
        j = tl.arange(0, PAGE)
        dst = base + at.to(tl.int64)[:, None] * PAGE + j[None, :]
        tl.store(indices_ptr + dst, (page[:, None] * PAGE + j[None, :]).to(tl.int32), mask=keep[:, None])
