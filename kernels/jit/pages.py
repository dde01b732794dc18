"""Quest's page scores: for each row of heads and each page of keys, the upper bound of q . k over the page's keys
from the page's element-wise key bounds (Quest, section 3.2).

For one query q and a page with bounds min, max [D]:  sum_i max(q_i min_i, q_i max_i) = q+ . max + q- . min,
where q+ = max(q, 0) and q- = min(q, 0). The bound is linear in (q+, q-), so the sum over a row's query heads
(one selection per KV head) and the mean over a question's tokens are taken on q+ and q- before the two dot
products: one pass over the bounds, two dot products per page.
"""

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior

# Arguments that follow a context's size, not specialised on (kernels/README.md)
SCORE_SIZES = ["P"]
THRESHOLD_SIZES = ["P", "K", "NCH"]
WRITE_SIZES = ["P", "K", "NCH", "NUM_KEYS", "PER_ROW"]


@triton.jit(do_not_specialize=SCORE_SIZES)
def page_scores_kernel(
    q_ptr,  # [Hq, 1, D] the decode step's query (unused when REDUCED)
    reduced_ptr,  # [rows, 4, D] float32 when REDUCED: the row's summed q+ and q- of the tokens' mean, then of the last
    min_ptr,  # [Hkv, P, D] element-wise minimum of each page's keys (QUANT: uint8 codes)
    max_ptr,  # [Hkv, P, D] element-wise maximum (QUANT: uint8 codes)
    offset_ptr,  # QUANT: [Hkv, D] float32, a code c stands for offset + step * c (reference.quantize_bounds)
    step_ptr,  # QUANT: [Hkv, D] float32
    out_ptr,  # [rows, P] float32 out: max(bound of the tokens' mean, bound of the last token), summed over the row
    P,
    stride_qh,
    stride_bh,
    stride_bp,
    HEADS_PER_ROW: tl.constexpr,  # query heads a row sums (Hq / rows)
    ROWS_PER_KV: tl.constexpr,  # rows per KV head (rows / Hkv)
    REDUCED: tl.constexpr,  # a question's prefill: its tokens reduced beforehand (pages_ops.page_scores)
    QUANT: tl.constexpr,  # one-byte bounds: the bound is q+ . offset + q- . offset + (q+ * step) . c_max + ...
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    wait_prior(PDL)
    release_next(PDL)
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
    const_mean = 0.0
    const_last = 0.0
    if QUANT:  # linear in the codes: fold the step into the query vectors and the offset into a constant
        offset = tl.load(offset_ptr + h * D + d)
        step = tl.load(step_ptr + h * D + d)
        const_mean = tl.sum((pos_mean + neg_mean) * offset, axis=0)
        const_last = tl.sum((pos_last + neg_last) * offset, axis=0)
        pos_mean = pos_mean * step
        neg_mean = neg_mean * step
        pos_last = pos_last * step
        neg_last = neg_last * step
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    m = p < P
    offs = h * stride_bh + p[:, None] * stride_bp + d[None, :]
    lo = tl.load(min_ptr + offs, mask=m[:, None], other=0).to(tl.float32)  # [BLOCK_P, D]
    hi = tl.load(max_ptr + offs, mask=m[:, None], other=0).to(tl.float32)
    mean = tl.sum(hi * pos_mean[None, :] + lo * neg_mean[None, :], axis=1) + const_mean
    last = tl.sum(hi * pos_last[None, :] + lo * neg_last[None, :], axis=1) + const_last
    tl.store(out_ptr + r * P + p, tl.maximum(mean, last), mask=m)


@triton.jit
def _two_counts(x, t1, t2):
    """Elements of x [N] (N < 2^16) >= t1 and >= t2: one reduction of the two flags packed in an int32's halves."""
    packed = tl.sum((x >= t1).to(tl.int32) | ((x >= t2).to(tl.int32) << 16), axis=0)
    return packed & 0xFFFF, (packed >> 16) & 0xFFFF


@triton.jit
def _counts_at_least(scores_ptr, row, P, t1, t2, SINGLE: tl.constexpr, scores, BLOCK: tl.constexpr):
    """Pages of the row whose score is >= t1 and >= t2 (from `scores` in registers when SINGLE, else chunk by
    chunk; BLOCK < 2^16)."""
    if SINGLE:
        return _two_counts(scores, t1, t2)
    c1 = tl.zeros([], dtype=tl.int32)
    c2 = tl.zeros([], dtype=tl.int32)
    for start in range(0, P, BLOCK):
        p = start + tl.arange(0, BLOCK)
        d1, d2 = _two_counts(tl.load(scores_ptr + row * P + p, mask=p < P, other=float("-inf")), t1, t2)
        c1 += d1
        c2 += d2
    return c1, c2


@triton.jit
def _third(lo, hi, above, c1, c2, K):
    """One step of the search: c1, c2 = count(>= the bracket's first and second third) (c1 >= c2); the K-th is in
    [t2, hi) when c2 >= K, in [t1, t2) when only c1 >= K, else in [lo, t1). Returns lo, hi and count(>= hi)."""
    t1 = lo + (hi - lo) * (1.0 / 3.0)
    t2 = lo + (hi - lo) * (2.0 / 3.0)
    new_lo = tl.where(c2 >= K, t2, tl.where(c1 >= K, t1, lo))
    new_hi = tl.where(c2 >= K, hi, tl.where(c1 >= K, t2, t1))
    new_above = tl.where(c2 >= K, above, tl.where(c1 >= K, c2, c1))
    return new_lo, new_hi, new_above


@triton.jit(do_not_specialize=THRESHOLD_SIZES)
def page_threshold_kernel(
    scores_ptr,  # [rows, P] float32 page scores
    bracket_ptr,  # [rows, 2] float32 out: lo, hi with count(score >= lo) >= K > count(score >= hi)
    room_ptr,  # [rows] int32 out: K - count(score >= hi), the pages to take among the candidates in [lo, hi)
    above_ptr,  # [rows, NCH] int32 out: pages at or above hi in each chunk of CHUNK pages
    cand_ptr,  # [rows, NCH] int32 out: candidates (in [lo, hi)) in each chunk
    P,
    K,  # pages to keep, 1 <= K <= P
    NCH,  # chunks of CHUNK pages
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,  # the whole row fits one block: it stays in registers across the search
    ITERS: tl.constexpr,  # search steps: the bracket ends within (max - min) / 3^ITERS
    CHUNK: tl.constexpr,  # divides BLOCK when SINGLE
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """The first half of Quest's selection, one program per row: a bracket [lo, hi) of the K-th score, and per
    chunk the pages above it and the candidates within it (what page_write_kernel's programs need to place their
    chunk's keys without a prefix sum of their own).

    The bracket starts at the row's lowest and highest score; each step counts the pages at or above its two
    thirds at once (_two_counts: one reduction) and keeps the third that holds the K-th. A step over the whole row
    is the search's cost: one SM per row, ~1.7 us per step at 32K pages on an H100. (H100, 8 rows of 32K pages:
    bisection, one threshold per reduction, 20 steps to (max - min) / 2^20: 30.8 us with the writer, this 28.8;
    an exact search over the scores' bits with four thresholds per int64 reduction, ~14 steps, took longer; a
    histogram per round, tl.histogram over 2^11 bins, ~0.6 ms; compacting the bracket's pages once they were
    under 2048 and counting only those in the last steps (a cumsum over the row, then a scratch buffer), longer.)
    A row in registers (SINGLE) is read once; a longer one is re-read from the cache at each step."""
    wait_prior(PDL)
    release_next(PDL)
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
    above = tl.zeros([], dtype=tl.int32)  # count(>= hi)
    for _ in range(ITERS):
        c1, c2 = _counts_at_least(scores_ptr, row, P, lo + (hi - lo) * (1.0 / 3.0), lo + (hi - lo) * (2.0 / 3.0),
                                  SINGLE, scores, BLOCK)
        lo, hi, above = _third(lo, hi, above, c1, c2, K)
    tl.store(bracket_ptr + row * 2, lo)
    tl.store(bracket_ptr + row * 2 + 1, hi)
    tl.store(room_ptr + row, K - above)
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


@triton.jit(do_not_specialize=WRITE_SIZES)
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
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """The second half, a program per (row, chunk of pages): every page at or above hi and the first candidates
    (page order) until K pages, their keys written where the chunks before put theirs; the program past the last
    chunk writes the keys every row reads and the CSR offsets."""
    wait_prior(PDL)
    release_next(PDL)
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
