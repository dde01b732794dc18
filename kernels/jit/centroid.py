"""Centroid lookup of Squeezed Attention (eq. 1, eq. 3 under candidates): @triton.jit kernels only.

The typed wrappers, block sizes and grids live in kernels/centroid_ops.py; the semantics are those of
kernels.reference.cluster_keep. One kernel per pass (two forms of the score pass), each with tl.constexpr variants:

    centroid_denominator_kernel  grid (unit, query-row block, split): partial (max, sum) of N_j exp(s_j) over the
                                 unit's centroid blocks split, split + NSPLIT, ...; with STORE_S it also keeps s.
    centroid_score_kernel        grid (unit, centroid program): merges the partials into log D per (head, token),
                                 S = exp(s - log D), reduces S per row (mean over heads and tokens, last token),
                                 compares it with the threshold and writes keep / score at the centroid ids.
    centroid_score_prefill_kernel  the same outputs for a dense lookup over many tokens, computed centroid-major
                                 (C q^T on the tensor cores, the query rows streamed): the prefill's score pass.
    centroid_cut_kernel          keep at the threshold a cut at a number of keys took from the score pass's histogram.

BATCHED (the denominator, score and cut kernels): the dense decode lookups of several sequences, each over a context
of its own, in one launch; each sequence's tensors and values are read from its row of two tables (addresses, and
int32 values or float32 bits: kernels/centroid_ops.py select_now), its programs past its own split or block counts
return at once, and its results are those of its lone launch.

Vocabulary (batch 1):
    q [Hq, Lq, D], centroids [Hkv, C, D] (q's dtype, or uint8 codes read as their values with q scaled by the KV
    head's step [Hkv, D] as it is loaded: SCALED), counts [Hkv, C]; G = Hq // Hkv query heads per KV head.
    row:      an output row of keep / score; rows is Hq or Hkv and HPR = Hq // rows query heads share a row.
    unit:     the GH consecutive query heads u * GH ... one program works for, all on KV head u * GH // G: a KV head
              (GH = G) for dense lookups, a row (GH = HPR) for candidate lists, since every row has its own list.
              A unit's (or a row's) query rows are its heads' tokens stacked head-major, m = j * Lq + t, as
              reference._grouped stacks them; partials and cached s are stored per query row h * Lq + t.
    position: the p-th centroid a unit looks at: centroid p (dense) or cand_idx[indptr[row] + p] (USE_LIST), p < n.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.jit.compact import expand_block
from kernels.launch import release_next, wait_prior
from kernels.tables import table_pointer

# Arguments that follow a context's size, not specialised on (kernels/README.md)
DENOMINATOR_SIZES = ["C", "CAP", "NSPLIT", "stride_nh", "stride_ar", "stride_s", "stride_kr", "stride_or"]
SCORE_SIZES = ["C", "CAP", "NSPLIT", "NPROG", "NB", "stride_nh",
               "stride_ar", "stride_s", "stride_kr", "stride_or", "lo", "hi"]
SCORE_PREFILL_SIZES = ["C", "NSPLIT", "NB", "stride_nh", "stride_ar", "stride_kr", "stride_or", "lo", "hi"]
CUT_SIZES = ["C", "NB", "stride_nh", "stride_kr", "stride_or"]
DECODE_LOOKUP_SIZES = ["C", "NSPLIT", "NB", "stride_nh", "stride_s", "stride_kr", "stride_or", "W"]


@triton.jit
def _int(row, i):
    """Entry i of a BATCHED launch's params row: an int32 (as a lone launch passes the value)."""
    return tl.load(row + i).to(tl.int32)


@triton.jit
def _stride(row, i, ALIGNED: tl.constexpr):
    """Entry i of a BATCHED launch's params row, a stride (int32); ALIGNED: a multiple of 16 (tables.aligned)."""
    stride = _int(row, i)
    if ALIGNED:
        stride = tl.multiple_of(stride, 16)
    return stride


@triton.jit
def _float(row, i):
    """Entry i of a BATCHED launch's params row: a float stored as its float32 bits."""
    return tl.load(row + i).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _sequence(table_ptr, params_ptr, seq, q_ptr, cent_ptr, counts_ptr, step_ptr, part_max_ptr, part_sum_ptr, s_ptr,
              valid_ptr, hist_ptr, TABLE_W: tl.constexpr, PARAMS_W: tl.constexpr, ALIGNED: tl.constexpr = False):
    """What both passes read of sequence `seq` of a BATCHED launch: its rows' first entries (DENOMINATOR_POINTERS
    and DENOMINATOR_PARAMS, kernels/centroid_ops.py; SCORE_POINTERS and SCORE_PARAMS begin with them), the pointers
    typed as those given. Returns (q, centroids, counts, step, part_max, part_sum, s cache, valid, hist, C, NSPLIT,
    stride_qh, stride_qt, stride_ch, stride_cc, stride_nh, stride_s, scale2)."""
    at = table_ptr + seq * TABLE_W
    row = params_ptr + seq * PARAMS_W
    return (table_pointer(at, 0, q_ptr, ALIGNED), table_pointer(at, 1, cent_ptr, ALIGNED),
            table_pointer(at, 2, counts_ptr), table_pointer(at, 3, step_ptr),
            table_pointer(at, 4, part_max_ptr, ALIGNED), table_pointer(at, 5, part_sum_ptr, ALIGNED),
            table_pointer(at, 6, s_ptr, ALIGNED),
            table_pointer(at, 7, valid_ptr), table_pointer(at, 8, hist_ptr), _int(row, 0),
            _int(row, 1), _stride(row, 2, ALIGNED), _stride(row, 3, ALIGNED), _stride(row, 4, ALIGNED),
            _stride(row, 5, ALIGNED), _int(row, 6), _int(row, 7), _float(row, 8))


@triton.jit
def _span(indptr_ptr, unit, C, USE_LIST: tl.constexpr):
    """(first packed position, number of positions) of a unit's centroids: all C of them, or its CSR slice."""
    if USE_LIST:
        start = tl.load(indptr_ptr + unit)
        n = (tl.load(indptr_ptr + unit + 1) - start).to(tl.int32)
    else:
        start = 0
        n = C
    return start, n


@triton.jit
def _centroid_ids(idx_ptr, start, pos, n, C, CAP, USE_LIST: tl.constexpr):
    """Positions [BLOCK_C] -> (centroid ids [BLOCK_C], valid [BLOCK_C]). For lists, packed positions at or past the
    capacity CAP are never read and ids outside [0, C) count as invalid (a corrupt list cannot fault)."""
    valid = pos < n
    if USE_LIST:
        valid = valid & (start + pos < CAP)
        cid = tl.load(idx_ptr + start + pos, mask=valid, other=0).to(tl.int32)
        valid = valid & (cid >= 0) & (cid < C)
        cid = tl.where(valid, cid, 0)
    else:
        cid = pos
    return cid, valid


@triton.jit
def _as_dot_operand(c, DTYPE: tl.constexpr, CODES16: tl.constexpr):
    """A tile of centroids as tl.dot's operand: in DTYPE, the queries'; with CODES16, uint8 codes become float16
    1024 + code by their bits (0x6400 | code: exact, and no int-to-float conversion, which would cost more than the
    dot on a prefill's tiles). The 1024 adds 1024 * sum(q) to every score of a query row, which cancels in S.
    Codes already widened to those float16 values (a long question's prefill) are taken as they are."""
    if CODES16:
        if c.dtype == tl.uint8:
            out = (c.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        else:  # the codes widened to those float16 values once, before the launch (kernels/centroid_ops.py)
            out = c
    else:
        out = c.to(DTYPE)
    return out


@triton.jit
def _load_centroids_t(cent_ptr, cid, c_ok, offs_d, D, stride_cc, DTYPE: tl.constexpr, CODES16: tl.constexpr):
    """The centroids of one block, transposed for tl.dot: [BLOCK_D, BLOCK_C] (_as_dot_operand; zeros where masked;
    one-byte codes read as their values)."""
    ptrs = cent_ptr + cid[None, :] * stride_cc + offs_d[:, None]
    return _as_dot_operand(tl.load(ptrs, mask=(offs_d < D)[:, None] & c_ok[None, :], other=0), DTYPE, CODES16)


@triton.jit
def _centroids_ahead(cent_ptr, pos, C, offs_d, D, stride_cc, DTYPE: tl.constexpr, CODES16: tl.constexpr,
                     AHEAD: tl.constexpr):
    """With AHEAD, the dense centroids at positions pos [BLOCK_C] (those below C) as _load_centroids_t reads them,
    before the kernel waits on the one before it (an index is no kernel's output in a step); else zeros, unused."""
    if AHEAD:
        out = _load_centroids_t(cent_ptr, pos, pos < C, offs_d, D, stride_cc, DTYPE, CODES16)
    else:
        out = tl.zeros([offs_d.shape[0], pos.shape[0]], DTYPE)
    return out


@triton.jit
def _load_queries(q_ptr, head, tok, m_ok, offs_d, D, stride_qh, stride_qt, step_ptr, SCALED: tl.constexpr,
                  CODES16: tl.constexpr):
    """Query rows (head, tok) [BLOCK_M] -> [BLOCK_M, BLOCK_D] (zeros where masked). SCALED: times the KV head's
    codes' step [D] at step_ptr (the queries one-byte centroids are scored with), rounded to q's dtype, or to
    float16 with CODES16 (the codes' operand type: _as_dot_operand)."""
    ptrs = q_ptr + head[:, None] * stride_qh + tok[:, None] * stride_qt + offs_d[None, :]
    qb = tl.load(ptrs, mask=m_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if SCALED:
        step = tl.load(step_ptr + offs_d, mask=offs_d < D, other=0.0)
        scaled = qb.to(tl.float32) * step[None, :]
        if CODES16:
            out = scaled.to(tl.float16)
        else:
            out = scaled.to(q_ptr.dtype.element_ty)
    else:
        out = qb
    return out


@triton.jit
def _log2_denominator(part_max_ptr, part_sum_ptr, qrow, m_ok, NSPLIT, BLOCK_SPLIT: tl.constexpr):
    """log2 D = log2 sum_j N_j 2^(s2_j) per query row [BLOCK_M] from the NSPLIT base-2 partials (max, sum of
    2^(x - max)), s2 = log2(e) * scale * q . C, read BLOCK_SPLIT at a time (the max over all of them first): a sum
    that depends on NSPLIT and the tile only, so lookups of other split counts may share the tile (BATCHED).

    -inf where no cluster enters the denominator (then S = 2^(s2 + inf) = inf, as in the reference)."""
    offs = tl.arange(0, BLOCK_SPLIT)
    mx = tl.full([qrow.shape[0]], float("-inf"), tl.float32)
    for s0 in range(0, NSPLIT, BLOCK_SPLIT):
        mask = m_ok[:, None] & (s0 + offs < NSPLIT)[None, :]
        pmax = tl.load(part_max_ptr + qrow[:, None] * NSPLIT + s0 + offs[None, :], mask=mask, other=float("-inf"))
        mx = tl.maximum(mx, tl.max(pmax, axis=1))
    ref = tl.where(mx == float("-inf"), 0.0, mx)  # keeps exp2() away from -inf - -inf
    total = tl.zeros([qrow.shape[0]], tl.float32)
    for s0 in range(0, NSPLIT, BLOCK_SPLIT):
        mask = m_ok[:, None] & (s0 + offs < NSPLIT)[None, :]
        ptrs = qrow[:, None] * NSPLIT + s0 + offs[None, :]
        pmax = tl.load(part_max_ptr + ptrs, mask=mask, other=float("-inf"))  # [BLOCK_M, BLOCK_SPLIT]
        psum = tl.load(part_sum_ptr + ptrs, mask=mask, other=0.0)
        total += tl.sum(psum * tl.exp2(pmax - ref[:, None]), axis=1)
    return tl.where(total > 0, ref + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))


@triton.jit
def _bin_of(score, CUT_LOW: tl.constexpr, CUT_PER: tl.constexpr, CUT_BINS: tl.constexpr):
    """The cut histogram's bin of each score: floor((log2(score) - CUT_LOW) * CUT_PER) within [0, CUT_BINS) (a
    score of 0 or below 2^CUT_LOW in bin 0)."""
    pos = tl.where(score > 0, (tl.log2(tl.where(score > 0, score, 1.0)) - CUT_LOW) * CUT_PER, 0.0)
    return tl.minimum(tl.maximum(pos, 0.0), CUT_BINS - 1).to(tl.int32)


@triton.jit
def _counted(on_ptr, kv_head, HIST_FIXED: tl.constexpr):
    """Whether the KV head's clusters enter the cut's histogram: not where its rows read a fixed list (HIST_FIXED:
    on_ptr [Hkv] uint8, kernels.selection.Fixed.on)."""
    if HIST_FIXED:
        return tl.load(on_ptr + kv_head) == 0
    else:
        return True


@triton.jit
def _hist_add(hist_ptr, bins, weight, ok, CUT_BINS: tl.constexpr, LOCAL: tl.constexpr = 64):
    """weight [BLOCK_C] added into the histogram at bins [BLOCK_C] (where ok and weight > 0): first summed within the
    block over the LOCAL bins around its mean bin, one atomic per such bin that holds any (a lookup's scores crowd a
    few bins, where one atomic per cluster would queue on the same addresses), then one atomic for each of the rest.
    Relaxed: the score pass's last program reads them after its ticket (_cut_when_last)."""
    live = ok & (weight > 0)
    n = tl.sum(live.to(tl.int32), axis=0)
    mean = tl.sum(tl.where(live, bins, 0), axis=0) // tl.maximum(n, 1)
    low = tl.minimum(tl.maximum(mean - LOCAL // 2, 0), CUT_BINS - LOCAL)
    rel = bins - low
    near = live & (rel >= 0) & (rel < LOCAL)
    slots = tl.arange(0, LOCAL)
    local = tl.sum(tl.where(near[:, None] & (rel[:, None] == slots[None, :]), weight[:, None], 0), axis=0)
    tl.atomic_add(hist_ptr + low + slots, local, mask=local > 0, sem="relaxed")
    tl.atomic_add(hist_ptr + bins, weight, mask=live & ~near, sem="relaxed")


@triton.jit
def _cut_when_last(hist_ptr, cut_ptr, listed_ptr, M, lo, hi, key_base, key_least, per_listed, elements_ptr, NEL,
                   per_read, on_ptr, units, HAS_LISTED: tl.constexpr, READ_KEYS: tl.constexpr, PER_HEAD: tl.constexpr,
                   HIST_FIXED: tl.constexpr, CUT_LOW: tl.constexpr, CUT_PER: tl.constexpr, CUT_BINS: tl.constexpr,
                   CUT_COPIES: tl.constexpr = 1, BLOCK_LIST: tl.constexpr = 1024):
    """The end of a score pass that a cut follows: every program takes a ticket (hist[CUT_COPIES * CUT_BINS],
    zeroed with the histograms by the denominator pass) once its atomics are in; the last one sums the CUT_COPIES
    histograms (the programs add into one each, round robin) and works out the keys asked (the
    KeyCount: key_base, less per_listed for each of the M listed positions within [lo, hi) and per_read for each
    index element the pass's units read, elements [NEL], at least key_least; with PER_HEAD times the KV heads the
    histogram counts: `units`, the KV heads the pass scores, less those on_ptr marks) and writes cut [1] float32, the
    threshold of the bin edge whose keys above come nearest (ties: more keys; keys <= 0: +inf; the lowest bin: -1):
    the reference's binned_cut, once per lookup (_write_cut)."""
    tl.debug_barrier()  # the program's histogram atomics are in before its ticket (a release at GPU scope)
    ticket = tl.atomic_add(hist_ptr + CUT_COPIES * CUT_BINS, 1)
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
        _write_cut(hist_ptr, cut_ptr, listed_ptr, M, lo, hi, key_base, key_least, per_listed, elements_ptr, NEL,
                   per_read, on_ptr, units, HAS_LISTED, READ_KEYS, PER_HEAD, HIST_FIXED, CUT_LOW, CUT_PER, CUT_BINS,
                   CUT_COPIES, BLOCK_LIST)


@triton.jit
def _write_cut(hist_ptr, cut_ptr, listed_ptr, M, lo, hi, key_base, key_least, per_listed, elements_ptr, NEL, per_read,
               on_ptr, units, HAS_LISTED: tl.constexpr, READ_KEYS: tl.constexpr, PER_HEAD: tl.constexpr,
               HIST_FIXED: tl.constexpr, CUT_LOW: tl.constexpr, CUT_PER: tl.constexpr, CUT_BINS: tl.constexpr,
               CUT_COPIES: tl.constexpr = 1, BLOCK_LIST: tl.constexpr = 1024):
    """_cut_when_last's work once every score is in the histograms (its arguments)."""
    want = key_base + 0.0
    if HAS_LISTED:
        n = 0
        for m0 in range(0, M, BLOCK_LIST):
            offs = m0 + tl.arange(0, BLOCK_LIST)
            p = tl.load(listed_ptr + offs, mask=offs < M, other=-1)
            n += tl.sum(((p >= lo) & (p < hi)).to(tl.int32), axis=0)
        want = want - per_listed * n.to(tl.float32)
    if READ_KEYS:
        read = 0.0
        for e0 in range(0, NEL, BLOCK_LIST):
            offs = e0 + tl.arange(0, BLOCK_LIST)
            read += tl.sum(tl.load(elements_ptr + offs, mask=offs < NEL, other=0.0, cache_modifier=".cg"), axis=0)
        want = want - per_read * read
    want = tl.maximum(want, key_least)
    if PER_HEAD:
        heads = units
        if HIST_FIXED:
            offs = tl.arange(0, BLOCK_LIST)
            on = tl.load(on_ptr + offs, mask=offs < units, other=1)
            heads = tl.sum((on == 0).to(tl.int32), axis=0)
        want = want * heads.to(tl.float32)
    bins = tl.arange(0, CUT_BINS)
    held = tl.zeros([CUT_BINS], tl.float32)  # keys per bin, lowest scores first, summed over the copies
    for copy in tl.static_range(0, CUT_COPIES):
        held += tl.load(hist_ptr + copy * CUT_BINS + bins, cache_modifier=".cg").to(tl.float32)
    above = tl.sum(held, axis=0) - tl.cumsum(held, axis=0) + held  # keys in bins >= b
    gap = tl.abs(above - want)
    best = tl.min(tl.where(gap == tl.min(gap, axis=0), bins, CUT_BINS), axis=0)
    threshold = tl.where(best == 0, -1.0, tl.exp2(CUT_LOW + best.to(tl.float32) / CUT_PER))
    tl.store(cut_ptr, tl.where(want > 0, threshold, float("inf")))


@triton.jit
def _decide(score, threshold, cnt, cid, c_ok, row, kv_head, blk, C, NB,
            allowed_ptr, keep_ptr, score_ptr, starts_ptr, block_sums_ptr, hist_ptr, counted, stride_ar, stride_kr,
            stride_or, HAS_ALLOWED: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_HIST: tl.constexpr = False,
            CUT_LOW: tl.constexpr = -64.0, CUT_PER: tl.constexpr = 32.0, CUT_BINS: tl.constexpr = 2048):
    """Both score passes' last step for one row and centroid block: keep = score > threshold & count > 0
    (& allowed, which also zeroes the score), written at the centroid ids cid [BLOCK_C]; with HAS_STARTS, the kept
    clusters' keys summed into block_sums[row, blk] for the expansion (kernels/jit/compact.py). With HAS_HIST (a cut
    at a number of keys, decided after every score is known: centroid_cut_kernel) the score alone is written and
    each cluster's keys are added into its score's bin of the histogram hist [CUT_BINS] int32 (where `counted`; the
    program's copy of the histogram)."""
    keep = (score > threshold) & (cnt > 0)
    if HAS_ALLOWED:
        allowed = tl.load(allowed_ptr + row * stride_ar + cid, mask=c_ok, other=0) != 0
        score = tl.where(allowed, score, 0.0)
        keep = keep & allowed
    tl.store(score_ptr + row * stride_or + cid, score, mask=c_ok)
    if HAS_HIST:  # keep marks the clusters the cut decides among (a list's candidates)
        tl.store(keep_ptr + row * stride_kr + cid, (cid >= 0).to(tl.uint8), mask=c_ok)
        _hist_add(hist_ptr, _bin_of(score, CUT_LOW, CUT_PER, CUT_BINS), tl.where(counted, cnt, 0).to(tl.int32), c_ok,
                  CUT_BINS)
    else:
        tl.store(keep_ptr + row * stride_kr + cid, keep.to(tl.uint8), mask=c_ok)
        if HAS_STARTS:
            kv = kv_head.to(tl.int64) * (C + 1)
            lo = tl.load(starts_ptr + kv + cid, mask=c_ok, other=0)
            hi = tl.load(starts_ptr + kv + cid + 1, mask=c_ok, other=0)
            tl.store(block_sums_ptr + row * NB + blk, tl.sum(tl.where(keep & c_ok, hi - lo, 0), axis=0))


@triton.jit
def _denominator_block(qb, ct, cid, c_ok, pos, start, m_i, l_i, qrow, m_ok, head, scale2, counts_ptr, allowed_ptr,
                       s_ptr, stride_ar, stride_s, HPR, HAS_ALLOWED: tl.constexpr, STORE_S: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """One centroid block of the denominator pass: the running (max, sum) [BLOCK_M] of the rows updated with the
    block's x = s2 + log2 N (ct: its centroids [BLOCK_D, BLOCK_C]); with STORE_S, s2 stored at the block's positions."""
    s = tl.dot(qb, ct, input_precision=DOT_PRECISION) * scale2  # [BLOCK_M, BLOCK_C] float32, log2 domain
    cnt = tl.load(counts_ptr + cid, mask=c_ok, other=0)
    c_in = c_ok & (cnt > 0)
    log2_n = tl.where(c_in, tl.log2(tl.maximum(cnt, 1).to(tl.float32)), float("-inf"))  # [BLOCK_C]
    x = s + log2_n[None, :]
    if HAS_ALLOWED:
        allowed = tl.load(allowed_ptr + (head // HPR)[:, None] * stride_ar + cid[None, :],
                          mask=m_ok[:, None] & c_in[None, :], other=0)
        x = tl.where(allowed != 0, x, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(x, axis=1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.exp2(m_i - ref) + tl.sum(tl.exp2(x - ref[:, None]), axis=1)
    if STORE_S:
        tl.store(s_ptr + qrow[:, None] * stride_s + (start + pos)[None, :], s, mask=m_ok[:, None] & c_ok[None, :])
    return m_new, l_i


@triton.jit(do_not_specialize=DENOMINATOR_SIZES)
def centroid_denominator_kernel(
    q_ptr, cent_ptr, counts_ptr, allowed_ptr, indptr_ptr, idx_ptr,  # inputs (allowed / indptr / idx: see flags)
    step_ptr,  # SCALED: [Hkv, D] float32, the one-byte centroids' step
    part_max_ptr, part_sum_ptr, s_ptr,  # outputs: [Hq * Lq, NSPLIT] float32 each; s2 cache [Hq * Lq, W] float32
    valid_ptr,  # HAS_VALID: [1] int64, the real tokens (the first ones of Lq; the rest is padding)
    keep_ptr, score_ptr,  # ZERO: the score pass's outputs [rows, C], zeroed here (a list's row: unit == row)
    hist_ptr,  # ZERO_HIST: [CUT_COPIES * CUT_BINS + 1] int32, the cut's histograms and ticket, zeroed here
    scale2, Lq, C, CAP, G, GH, HPR, NSPLIT,
    stride_qh, stride_qt, stride_ch, stride_cc, stride_nh, stride_ar, stride_s, stride_kr, stride_or,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_ALLOWED: tl.constexpr,  # dense mask allowed [rows, C]: only allowed clusters enter the denominator
    USE_LIST: tl.constexpr,  # the unit's positions are its row's candidate list (CSR indptr / idx)
    STORE_S: tl.constexpr,  # keep s2 in s_ptr so the score pass needs no second look at the centroids (decode)
    DOT_PRECISION: tl.constexpr,
    SCALED: tl.constexpr,  # the centroids are uint8 codes: the queries are scaled by their step
    CODES16: tl.constexpr,  # SCALED with 16-bit queries: the dots run in float16 (_as_dot_operand)
    HAS_VALID: tl.constexpr = False,  # a block of padding tokens alone computes nothing (its partials: -inf, 0)
    AHEAD: tl.constexpr = False,  # dense: the first block's centroids read before waiting (PDL) on the queries
    ZERO: tl.constexpr = False,  # USE_LIST: zero the row's keep and score, BLOCK_Z at a time (no launch of its own)
    BLOCK_Z: tl.constexpr = 1024,
    ZERO_HIST: tl.constexpr = False,
    CUT_BINS: tl.constexpr = 2048,
    CUT_COPIES: tl.constexpr = 1,
    PDL: tl.constexpr = False,  # kernels/launch.py
    table_ptr=None,  # BATCHED: [B, TABLE_W] int64 addresses (DENOMINATOR_POINTERS, kernels/centroid_ops.py)
    params_ptr=None,  # BATCHED: [B, PARAMS_W] int64 values (DENOMINATOR_PARAMS; floats as their float32 bits)
    BATCHED: tl.constexpr = False,
    TABLE_W: tl.constexpr = 1,
    PARAMS_W: tl.constexpr = 1,
    ALIGNED: tl.constexpr = False,  # BATCHED: the tiles' addresses (*_TILES), q's and the centroids' strides 16-aligned
    qs_ptr=None,  # STAGE_Q: [Hq * Lq, BLOCK_D] out, the queries as the dots read them
    STAGE_Q: tl.constexpr = False,
):
    """Pass 1: for BLOCK_M query rows of a unit, running (max, sum) of x_j = s2_j + log2 N_j over the unit's
    centroid blocks split, split + NSPLIT, ... (flash style, base 2: s2 = scale2 * q . C with scale2 = scale *
    log2(e)). Empty clusters, masked ones and invalid positions give x = -inf; without an `allowed` mask that is a
    per-centroid offset, so a tile costs one FMA, one max, one exp2 and one add per element. Rows past the unit's
    end compute on zero queries and are not stored; with HAS_VALID, a block whose rows are all padding skips its
    centroids (no pass reads a padding row's partials). With AHEAD (a dense lookup without HAS_VALID) the program
    reads its first block of centroids before it waits (PDL) for the kernel that wrote the queries (an index is no
    kernel's output in a step), so that read overlaps the kernel before.

    BATCHED (dense decode lookups of several sequences; never with AHEAD, whose tile is the first sequence's): grid
    (unit, query-row block, B * NSPLIT), NSPLIT the grid's splits per sequence; sequence b = split // NSPLIT reads
    its tensors and values from row b of the tables, and its programs past its own NSPLIT return at once.

    STAGE_Q (a dense prefill, never BATCHED): the programs of split 0 also store their query rows as the dots read
    them (scaled by the codes' step, in the dot's dtype) into qs, row h * Lq + t, for the centroid-major score pass
    (centroid_score_prefill_kernel), which would otherwise load and scale them again for each block of centroids."""
    release_next(PDL)
    unit = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    h0 = unit * GH
    cent_ptr += (h0 // G) * stride_ch
    counts_ptr += (h0 // G) * stride_nh
    step_ptr += (h0 // G) * D
    offs_d = tl.arange(0, BLOCK_D)
    pos0 = split * BLOCK_C + tl.arange(0, BLOCK_C)
    ct0 = _centroids_ahead(cent_ptr, pos0, C, offs_d, D, stride_cc, q_ptr.dtype.element_ty, CODES16, AHEAD)
    wait_prior(PDL)
    if BATCHED:  # (the tables are read after the wait: their upload precedes the launch)
        seq = split // NSPLIT
        split = split % NSPLIT
        (q_ptr, cent_ptr, counts_ptr, step_ptr, part_max_ptr, part_sum_ptr, s_ptr, valid_ptr, hist_ptr, C, NSPLIT,
         stride_qh, stride_qt, stride_ch, stride_cc, stride_nh, stride_s, scale2) = _sequence(
            table_ptr, params_ptr, seq, q_ptr, cent_ptr, counts_ptr, step_ptr, part_max_ptr, part_sum_ptr, s_ptr,
            valid_ptr, hist_ptr, TABLE_W, PARAMS_W, ALIGNED)
        if split >= NSPLIT:
            return
        cent_ptr += (h0 // G) * stride_ch
        counts_ptr += (h0 // G) * stride_nh
        step_ptr += (h0 // G) * D

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # stacked query rows of the unit
    m_ok = offs_m < GH * Lq
    head = h0 + offs_m // Lq
    tok = offs_m % Lq
    qrow = head * Lq + tok
    # [BLOCK_M, BLOCK_D]
    qb = _load_queries(q_ptr, head, tok, m_ok, offs_d, D, stride_qh, stride_qt, step_ptr, SCALED, CODES16)
    if STAGE_Q:
        if split == 0:
            tl.store(qs_ptr + qrow.to(tl.int64)[:, None] * BLOCK_D + offs_d[None, :], qb, mask=m_ok[:, None])

    start, n = _span(indptr_ptr, unit, C, USE_LIST)
    blocks = tl.cdiv(n, BLOCK_C)
    if HAS_VALID:
        n_tok = tl.load(valid_ptr).to(tl.int32)
        blocks = tl.where(tl.max((m_ok & (tok < n_tok)).to(tl.int32), axis=0) > 0, blocks, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    first = split
    if AHEAD:  # the first block from the tile read ahead (positions past C are masked: nothing of them counts)
        m_i, l_i = _denominator_block(qb, ct0, pos0, pos0 < C, pos0, start, m_i, l_i, qrow, m_ok, head, scale2,
                                      counts_ptr, allowed_ptr, s_ptr, stride_ar, stride_s, HPR, HAS_ALLOWED, STORE_S,
                                      DOT_PRECISION)
        first = split + NSPLIT
    for blk in range(first, blocks, NSPLIT):
        pos = blk * BLOCK_C + tl.arange(0, BLOCK_C)
        cid, c_ok = _centroid_ids(idx_ptr, start, pos, n, C, CAP, USE_LIST)
        # [BLOCK_D, BLOCK_C]
        ct = _load_centroids_t(cent_ptr, cid, c_ok, offs_d, D, stride_cc, q_ptr.dtype.element_ty, CODES16)
        m_i, l_i = _denominator_block(qb, ct, cid, c_ok, pos, start, m_i, l_i, qrow, m_ok, head, scale2, counts_ptr,
                                      allowed_ptr, s_ptr, stride_ar, stride_s, HPR, HAS_ALLOWED, STORE_S,
                                      DOT_PRECISION)
    tl.store(part_max_ptr + qrow * NSPLIT + split, m_i, mask=m_ok)
    tl.store(part_sum_ptr + qrow * NSPLIT + split, l_i, mask=m_ok)
    if ZERO:  # the row's keep and score off its candidates (the score pass writes the candidates' after this launch)
        if pid_m == 0:
            for c0 in range(split * BLOCK_Z, C, NSPLIT * BLOCK_Z):
                offs_c = c0 + tl.arange(0, BLOCK_Z)
                tl.store(keep_ptr + unit * stride_kr + offs_c, tl.zeros([BLOCK_Z], tl.uint8), mask=offs_c < C)
                tl.store(score_ptr + unit * stride_or + offs_c, tl.zeros([BLOCK_Z], tl.float32), mask=offs_c < C)
    if ZERO_HIST:  # (no memset of its own before the lookup): BLOCK_Z entries a program, the grid's programs in turn
        programs = tl.num_programs(0) * tl.num_programs(1) * NSPLIT  # (BATCHED: the sequence's)
        me = (unit * tl.num_programs(1) + pid_m) * NSPLIT + split
        for z0 in range(me * BLOCK_Z, CUT_COPIES * CUT_BINS + 1, programs * BLOCK_Z):
            offs_z = z0 + tl.arange(0, BLOCK_Z)
            tl.store(hist_ptr + offs_z, tl.zeros([BLOCK_Z], tl.int32), mask=offs_z <= CUT_COPIES * CUT_BINS)


@triton.jit(do_not_specialize=SCORE_SIZES)
def centroid_score_kernel(
    q_ptr, cent_ptr, counts_ptr, allowed_ptr, indptr_ptr, idx_ptr, step_ptr,  # inputs, as in the denominator pass
    part_max_ptr, part_sum_ptr, s_ptr,  # the denominator pass's outputs
    keep_ptr, score_ptr,  # outputs [rows, C]: keep uint8 (a bool view), score float32; written at the unit's ids
    starts_ptr, block_sums_ptr,  # HAS_STARTS: [Hkv, C + 1] int64 key ranges in; [rows, NB] int64 kept keys out
    valid_ptr,  # HAS_VALID: [1] int64, the real tokens (the first ones of Lq; the rest is padding)
    elements_ptr,  # HAS_ELEMENTS: [rows] float32 out, read_base + read_per * the row's candidates (USE_LIST)
    hist_ptr,  # HAS_HIST: [CUT_COPIES * CUT_BINS + 1] int32, zeroed: keys by score bin (_decide), the ticket
    on_ptr,  # HIST_FIXED: [Hkv] uint8, the KV heads whose clusters stay out of the histogram
    cut_ptr, listed_ptr,  # HAS_HIST: [1] float32 out, the cut's threshold; HAS_LISTED: [M] int64 (_cut_when_last)
    scale2, threshold, Lq, C, CAP, G, GH, HPR, NSPLIT, NPROG, NB,
    stride_qh, stride_qt, stride_ch, stride_cc, stride_nh, stride_ar, stride_s, stride_kr, stride_or,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_SPLIT: tl.constexpr,  # power of two >= NSPLIT
    HAS_ALLOWED: tl.constexpr,
    USE_LIST: tl.constexpr,
    LOAD_S: tl.constexpr,  # read s2 from the denominator pass's cache instead of recomputing q . C (decode)
    HAS_STARTS: tl.constexpr,  # also write each (row, centroid block)'s kept keys for kernels/jit/compact.py
    DOT_PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
    CODES16: tl.constexpr,
    HAS_VALID: tl.constexpr,  # only the first valid_ptr[0] tokens count in the mean and the last token
    read_base=0.0,
    read_per=0.0,
    M=0, lo=0, hi=0, key_base=0.0, key_least=0.0, per_listed=0.0, per_read=0.0,  # HAS_HIST: the keys (KeyCount)
    HAS_ELEMENTS: tl.constexpr = False,
    HAS_HIST: tl.constexpr = False,  # scores and the cut histogram only: keep by centroid_cut_kernel
    HIST_FIXED: tl.constexpr = False,
    HAS_LISTED: tl.constexpr = False,
    READ_KEYS: tl.constexpr = False,  # (HAS_ELEMENTS) the keys less per_read per element read
    PER_HEAD: tl.constexpr = False,  # the keys per KV head the histogram counts
    CUT_LOW: tl.constexpr = -64.0,
    CUT_PER: tl.constexpr = 32.0,
    CUT_BINS: tl.constexpr = 2048,
    CUT_COPIES: tl.constexpr = 1,
    PDL: tl.constexpr = False,  # kernels/launch.py
    table_ptr=None,  # BATCHED: [B, TABLE_W] int64 addresses (SCORE_POINTERS, kernels/centroid_ops.py)
    params_ptr=None,  # BATCHED: [B, PARAMS_W] int64 values (SCORE_PARAMS; floats as their float32 bits)
    BATCHED: tl.constexpr = False,
    TABLE_W: tl.constexpr = 1,
    PARAMS_W: tl.constexpr = 1,
    ALIGNED: tl.constexpr = False,  # BATCHED: the tiles' addresses (*_TILES), q's and the centroids' strides 16-aligned
):
    """Pass 2: for the unit's centroid blocks pid, pid + NPROG, ...: every row of the unit loops over its query rows,
    sums S = exp(s - log D) over them (mean over heads and tokens) and over its heads' last tokens, and writes
    score = max(mean, last) and keep = score > threshold & count > 0 (& allowed). The max correction of the
    softmax is folded into log2 D = max + log2(sum), a scalar per query row, so S costs one subtraction and one exp2.
    threshold <= 0 (keep every cluster) is passed as -1, since S >= 0. With HAS_STARTS (dense lookups only) it also
    sums the kept clusters' sizes per block of BLOCK_C centroids: the expansion's first step, fused here.

    BATCHED (dense decode lookups of several sequences): grid (unit, centroid program, B), sequence b's tensors and
    values (C, NSPLIT, NPROG, NB, strides, the keys, the threshold...) read from row b of the tables; programs past
    its NPROG score nothing. A cut's ticket counts the programs of the sequence's slice of the grid (every one
    takes one), its histogram and ticket are its own."""
    wait_prior(PDL)
    release_next(PDL)
    unit = tl.program_id(0)
    pid = tl.program_id(1)
    if BATCHED:
        (q_ptr, cent_ptr, counts_ptr, step_ptr, part_max_ptr, part_sum_ptr, s_ptr, valid_ptr, hist_ptr, C, NSPLIT,
         stride_qh, stride_qt, stride_ch, stride_cc, stride_nh, stride_s, scale2) = _sequence(
            table_ptr, params_ptr, tl.program_id(2), q_ptr, cent_ptr, counts_ptr, step_ptr, part_max_ptr,
            part_sum_ptr, s_ptr, valid_ptr, hist_ptr, TABLE_W, PARAMS_W, ALIGNED)
        at = table_ptr + tl.program_id(2) * TABLE_W
        keep_ptr = table_pointer(at, 9, keep_ptr, ALIGNED)
        score_ptr = table_pointer(at, 10, score_ptr, ALIGNED)
        starts_ptr = table_pointer(at, 11, starts_ptr)
        block_sums_ptr = table_pointer(at, 12, block_sums_ptr)
        on_ptr = table_pointer(at, 13, on_ptr)
        at = params_ptr + tl.program_id(2) * PARAMS_W
        NPROG = _int(at, 9)
        NB = _int(at, 10)
        stride_kr = _int(at, 11)
        stride_or = _int(at, 12)
        threshold = _float(at, 13)
    h0 = unit * GH
    cent_ptr += (h0 // G) * stride_ch
    counts_ptr += (h0 // G) * stride_nh
    step_ptr += (h0 // G) * D
    row0 = h0 // HPR
    rows_here = GH // HPR  # G rows of one query head when a dense unit (a KV head) serves rows == Hq, else 1
    m_row = HPR * Lq  # stacked query rows of one row
    n_tok = Lq
    if HAS_VALID:
        n_tok = tl.load(valid_ptr).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)

    start, n = _span(indptr_ptr, unit, C, USE_LIST)
    if HAS_ELEMENTS:  # the index elements the row's lookup read: its candidates' (a list's unit is its row)
        if pid == 0:
            tl.store(elements_ptr + unit, read_base + read_per * n.to(tl.float32))
    for blk in range(pid, tl.cdiv(n, BLOCK_C), NPROG):
        pos = blk * BLOCK_C + tl.arange(0, BLOCK_C)
        cid, c_ok = _centroid_ids(idx_ptr, start, pos, n, C, CAP, USE_LIST)
        cnt = tl.load(counts_ptr + cid, mask=c_ok, other=0)
        if not LOAD_S:
            # [BLOCK_D, BLOCK_C], reused below
            ct = _load_centroids_t(cent_ptr, cid, c_ok, offs_d, D, stride_cc, q_ptr.dtype.element_ty, CODES16)
        for rr in range(0, rows_here):
            row = row0 + rr
            total = tl.zeros([BLOCK_C], tl.float32)  # sum of S over the row's heads and tokens
            last = tl.zeros([BLOCK_C], tl.float32)  # sum of S over the row's heads at the last token
            for mb in range(0, tl.cdiv(m_row, BLOCK_M)):
                offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
                m_ok = offs_m < m_row
                head = row * HPR + offs_m // Lq
                tok = offs_m % Lq
                qrow = head * Lq + tok
                log2_d = _log2_denominator(part_max_ptr, part_sum_ptr, qrow, m_ok, NSPLIT, BLOCK_SPLIT)
                if LOAD_S:
                    s_ptrs = s_ptr + qrow[:, None] * stride_s + (start + pos)[None, :]
                    s = tl.load(s_ptrs, mask=m_ok[:, None] & c_ok[None, :], other=0.0)
                else:
                    qb = _load_queries(q_ptr, head, tok, m_ok, offs_d, D, stride_qh, stride_qt, step_ptr, SCALED,
                                       CODES16)
                    s = tl.dot(qb, ct, input_precision=DOT_PRECISION) * scale2
                real = m_ok & (tok < n_tok)
                p = tl.where(real[:, None] & c_ok[None, :], tl.exp2(s - log2_d[:, None]), 0.0)  # S [BLOCK_M, BLOCK_C]
                total += tl.sum(p, axis=0)
                last += tl.sum(tl.where((tok == n_tok - 1)[:, None], p, 0.0), axis=0)
            _decide(tl.maximum(total / (HPR * n_tok), last / HPR), threshold, cnt, cid, c_ok, row, h0 // G, blk, C, NB,
                    allowed_ptr, keep_ptr, score_ptr, starts_ptr, block_sums_ptr,
                    hist_ptr + (pid * tl.num_programs(0) + unit) % CUT_COPIES * CUT_BINS,
                    _counted(on_ptr, h0 // G, HIST_FIXED), stride_ar, stride_kr, stride_or, HAS_ALLOWED, HAS_STARTS,
                    HAS_HIST, CUT_LOW, CUT_PER, CUT_BINS)
    if HAS_HIST:
        if BATCHED:  # the cut's own values, read once the scores are in (not held through the loop)
            at = table_ptr + tl.program_id(2) * TABLE_W
            cut_ptr = table_pointer(at, 14, cut_ptr)
            listed_ptr = table_pointer(at, 15, listed_ptr)
            at = params_ptr + tl.program_id(2) * PARAMS_W
            M = _int(at, 14)
            lo = _int(at, 15)
            hi = _int(at, 16)
            key_base = _float(at, 17)
            key_least = _float(at, 18)
            per_listed = _float(at, 19)
        _cut_when_last(hist_ptr, cut_ptr, listed_ptr, M, lo, hi, key_base, key_least, per_listed, elements_ptr,
                       tl.num_programs(0), per_read, on_ptr, tl.num_programs(0), HAS_LISTED, READ_KEYS, PER_HEAD,
                       HIST_FIXED, CUT_LOW, CUT_PER, CUT_BINS, CUT_COPIES)


@triton.jit
def _score_rows(qs_ptr, cent, part_max_ptr, part_sum_ptr, m0, m_row, n_tok, row, scale2, Lq, HPR, NSPLIT, offs_d,
                BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                MASKED: tl.constexpr):
    """Sum of S = 2^(s2 - log2 D) over the stacked query rows m0 .. m0 + BLOCK_M - 1 of `row` (MASKED: those below
    m_row whose token is one of the first n_tok only; else every one, read without masks), per centroid of cent
    [BLOCK_C, BLOCK_D]: [BLOCK_C]. qs: the queries as the denominator pass staged them (STAGE_Q), [Hq * Lq,
    BLOCK_D], so a block of a row's stacked query rows is BLOCK_M whole rows of it."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    qrow = row * HPR * Lq + offs_m  # h * Lq + t of the stacked row m = j * Lq + t of head h = row * HPR + j
    ptrs = qs_ptr + qrow.to(tl.int64)[:, None] * BLOCK_D + offs_d[None, :]
    if MASKED:
        m_ok = (offs_m < m_row) & (offs_m % Lq < n_tok)
        qb = tl.load(ptrs, mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_D]
    else:
        m_ok = tl.full([BLOCK_M], True, tl.int1)
        qb = tl.load(ptrs)
    log2_d = _log2_denominator(part_max_ptr, part_sum_ptr, qrow, m_ok, NSPLIT, BLOCK_SPLIT)
    st = tl.dot(cent, tl.trans(qb), input_precision=DOT_PRECISION)  # [BLOCK_C, BLOCK_M]
    p = tl.exp2(st * scale2 - log2_d[None, :])
    if MASKED:
        p = tl.where(m_ok[None, :], p, 0.0)
    return tl.sum(p, axis=1)


@triton.jit(do_not_specialize=SCORE_PREFILL_SIZES)
def centroid_score_prefill_kernel(
    qs_ptr, cent_ptr, counts_ptr, allowed_ptr,  # inputs (qs: the staged queries; allowed: HAS_ALLOWED only)
    part_max_ptr, part_sum_ptr,  # the denominator pass's partials [Hq * Lq, NSPLIT]
    keep_ptr, score_ptr,  # outputs [rows, C]
    starts_ptr, block_sums_ptr,  # HAS_STARTS: [Hkv, C + 1] int64 key ranges in; [rows, NB] int64 kept keys out
    valid_ptr,  # HAS_VALID: [1] int64, the real tokens (the first ones of Lq; the rest is padding)
    hist_ptr,  # HAS_HIST: [CUT_COPIES * CUT_BINS + 1] int32, zeroed: keys by score bin (_decide), the ticket
    on_ptr,  # HIST_FIXED: [Hkv] uint8, the KV heads whose clusters stay out of the histogram
    cut_ptr, listed_ptr,  # HAS_HIST: [1] float32 out, the cut's threshold; HAS_LISTED: [M] int64 (_cut_when_last)
    scale2, threshold, Lq, C, G, HPR, NSPLIT, NB,
    stride_ch, stride_cc, stride_nh, stride_ar, stride_kr, stride_or,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per step (the dot's N)
    BLOCK_C: tl.constexpr,  # centroids per program (the dot's M), held for the whole program
    BLOCK_H: tl.constexpr,  # >= HPR, >= 16: the row's last-token queries, one per head
    BLOCK_SPLIT: tl.constexpr,
    HAS_ALLOWED: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CODES16: tl.constexpr,  # the centroids are uint8 codes, the staged queries float16 (_as_dot_operand)
    HAS_VALID: tl.constexpr,  # only the first valid_ptr[0] tokens count in the mean and the last token
    M=0, lo=0, hi=0, key_base=0.0, key_least=0.0, per_listed=0.0,  # HAS_HIST: the keys asked (KeyCount)
    HAS_HIST: tl.constexpr = False,  # scores and the cut histogram only: keep by centroid_cut_kernel
    HIST_FIXED: tl.constexpr = False,
    HAS_LISTED: tl.constexpr = False,
    PER_HEAD: tl.constexpr = False,  # the keys per KV head the histogram counts
    CUT_LOW: tl.constexpr = -64.0,
    CUT_PER: tl.constexpr = 32.0,
    CUT_BINS: tl.constexpr = 2048,
    CUT_COPIES: tl.constexpr = 1,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """Pass 2 of a dense lookup over Lq > 1 tokens (the question's prefill), grid (KV head, centroid block): the
    same outputs as centroid_score_kernel, computed centroid-major. The program keeps its BLOCK_C centroids and
    streams the query rows of each of its rows past them, BLOCK_M at a time: s^T = C q^T [BLOCK_C, BLOCK_M] on the
    tensor cores, S = exp2(s^T * scale2 - log2 D) summed over the query rows (scale2 = scale * log2(e)). The last
    token's own S (one query row per head) is a second, small product after the stream, so the stream has no
    per-token select. The query rows come from qs [Hq * Lq, BLOCK_D], where the denominator pass staged them as
    the dots read them (scaled by the codes' step, in the dot's dtype: STAGE_Q): each program streams plain
    contiguous tiles, not the queries' own layout scaled again by every centroid block."""
    wait_prior(PDL)
    release_next(PDL)
    unit = tl.program_id(0)
    cb = tl.program_id(1)
    cent_ptr += unit * stride_ch
    counts_ptr += unit * stride_nh
    cid = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cid < C
    offs_d = tl.arange(0, BLOCK_D)
    cent = _as_dot_operand(tl.load(cent_ptr + cid[:, None] * stride_cc + offs_d[None, :],
                                   mask=c_ok[:, None] & (offs_d < D)[None, :], other=0),
                           qs_ptr.dtype.element_ty, CODES16)  # [BLOCK_C, BLOCK_D]
    cnt = tl.load(counts_ptr + cid, mask=c_ok, other=0)
    rows_here = G // HPR
    m_row = HPR * Lq
    n_tok = Lq
    if HAS_VALID:
        n_tok = tl.load(valid_ptr).to(tl.int32)
    for rr in range(0, rows_here):
        row = unit * rows_here + rr
        total = tl.zeros([BLOCK_C], tl.float32)
        if HAS_VALID and Lq % BLOCK_M == 0:  # padded tokens, blocks within one head: each head's real tokens,
            # whole blocks unmasked, then its last part masked; the padding is not computed
            whole = n_tok // BLOCK_M * BLOCK_M
            for j in range(0, HPR):
                for t0 in range(0, whole, BLOCK_M):
                    total += _score_rows(qs_ptr, cent, part_max_ptr, part_sum_ptr, j * Lq + t0, m_row, n_tok, row,
                                         scale2, Lq, HPR, NSPLIT, offs_d, BLOCK_D, BLOCK_M, BLOCK_SPLIT,
                                         DOT_PRECISION, False)
                if whole < n_tok:
                    total += _score_rows(qs_ptr, cent, part_max_ptr, part_sum_ptr, j * Lq + whole, m_row, n_tok, row,
                                         scale2, Lq, HPR, NSPLIT, offs_d, BLOCK_D, BLOCK_M, BLOCK_SPLIT,
                                         DOT_PRECISION, True)
        elif HAS_VALID:  # padded tokens, blocks across heads: every block masked
            for m0 in range(0, m_row, BLOCK_M):
                total += _score_rows(qs_ptr, cent, part_max_ptr, part_sum_ptr, m0, m_row, n_tok, row, scale2, Lq, HPR,
                                     NSPLIT, offs_d, BLOCK_D, BLOCK_M, BLOCK_SPLIT, DOT_PRECISION, True)
        else:
            full_end = m_row // BLOCK_M * BLOCK_M
            for m0 in range(0, full_end, BLOCK_M):  # whole blocks of query rows: no masks
                total += _score_rows(qs_ptr, cent, part_max_ptr, part_sum_ptr, m0, m_row, n_tok, row, scale2, Lq, HPR,
                                     NSPLIT, offs_d, BLOCK_D, BLOCK_M, BLOCK_SPLIT, DOT_PRECISION, False)
            if full_end < m_row:
                total += _score_rows(qs_ptr, cent, part_max_ptr, part_sum_ptr, full_end, m_row, n_tok, row, scale2, Lq,
                                     HPR, NSPLIT, offs_d, BLOCK_D, BLOCK_M, BLOCK_SPLIT, DOT_PRECISION, True)
        offs_h = tl.arange(0, BLOCK_H)  # the last token of each of the row's heads
        h_ok = offs_h < HPR
        head = row * HPR + offs_h
        last_tok = tl.zeros([BLOCK_H], tl.int32) + (n_tok - 1)
        log2_d = _log2_denominator(part_max_ptr, part_sum_ptr, head * Lq + last_tok, h_ok, NSPLIT, BLOCK_SPLIT)
        qb = tl.load(qs_ptr + (head * Lq + last_tok).to(tl.int64)[:, None] * BLOCK_D + offs_d[None, :],
                     mask=h_ok[:, None], other=0.0)  # [BLOCK_H, BLOCK_D]
        st = tl.dot(cent, tl.trans(qb), input_precision=DOT_PRECISION)  # [BLOCK_C, BLOCK_H]
        last = tl.sum(tl.where(h_ok[None, :], tl.exp2(st * scale2 - log2_d[None, :]), 0.0), axis=1)
        _decide(tl.maximum(total / (HPR * n_tok), last / HPR), threshold, cnt, cid, c_ok, row, unit, cb, C, NB,
                allowed_ptr, keep_ptr, score_ptr, starts_ptr, block_sums_ptr,
                hist_ptr + (cb * tl.num_programs(0) + unit) % CUT_COPIES * CUT_BINS, _counted(on_ptr, unit, HIST_FIXED),
                stride_ar, stride_kr, stride_or, HAS_ALLOWED, HAS_STARTS, HAS_HIST, CUT_LOW, CUT_PER, CUT_BINS)
    if HAS_HIST:
        _cut_when_last(hist_ptr, cut_ptr, listed_ptr, M, lo, hi, key_base, key_least, per_listed, cut_ptr, 0, 0.0,
                       on_ptr, tl.num_programs(0), HAS_LISTED, False, PER_HEAD, HIST_FIXED, CUT_LOW, CUT_PER,
                       CUT_BINS, CUT_COPIES)


@triton.jit(do_not_specialize=CUT_SIZES)
def centroid_cut_kernel(
    score_ptr, counts_ptr, cut_ptr,  # in: score [rows, C] float32, counts [Hkv, C], cut [1] float32 (the threshold
    # the score pass's last program took from its histogram: _cut_when_last)
    keep_ptr, starts_ptr, block_sums_ptr,  # out: keep [rows, C] uint8, block_sums [rows, NB] int64 (starts: [Hkv,
    # C + 1] int64 key ranges in)
    C, NB, RPK, stride_nh, stride_kr, stride_or,
    BLOCK_C: tl.constexpr,
    HAS_STARTS: tl.constexpr = True,  # also the kept keys per block, for the expansion
    AMONG: tl.constexpr = False,  # only the clusters keep marks (the score pass's: a list's candidates) may be kept
    PDL: tl.constexpr = False,  # kernels/launch.py
    table_ptr=None,  # BATCHED: [B, TABLE_W] int64 addresses (CUT_POINTERS, kernels/centroid_ops.py)
    params_ptr=None,  # BATCHED: [B, PARAMS_W] int64 values (CUT_PARAMS)
    BATCHED: tl.constexpr = False,
    TABLE_W: tl.constexpr = 1,
    PARAMS_W: tl.constexpr = 1,
    ALIGNED: tl.constexpr = False,  # BATCHED: the tiles' addresses (CUT_TILES) 16-aligned (kernels.tables.aligned)
):
    """A lookup cut at a number of keys, grid (row, centroid block of BLOCK_C): every program decides its block
    at the threshold the score pass wrote, as the score pass does with a threshold (keep = score > threshold and
    count > 0, its kept keys summed into block_sums with HAS_STARTS; with AMONG, among the clusters keep marks).
    RPK: rows per KV head. BATCHED: grid (row, centroid block, B), sequence b's tensors, C, NB and strides from
    row b of the tables; its blocks past its NB return at once."""
    wait_prior(PDL)
    release_next(PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    if BATCHED:
        at = table_ptr + tl.program_id(2) * TABLE_W
        score_ptr = table_pointer(at, 0, score_ptr, ALIGNED)
        counts_ptr = table_pointer(at, 1, counts_ptr)
        cut_ptr = table_pointer(at, 2, cut_ptr)
        keep_ptr = table_pointer(at, 3, keep_ptr, ALIGNED)
        starts_ptr = table_pointer(at, 4, starts_ptr)
        block_sums_ptr = table_pointer(at, 5, block_sums_ptr)
        at = params_ptr + tl.program_id(2) * PARAMS_W
        C = _int(at, 0)
        NB = _int(at, 1)
        stride_nh = _int(at, 2)
        stride_kr = _int(at, 3)
        stride_or = _int(at, 4)
        if blk >= NB:
            return
    _cut_block(score_ptr, counts_ptr, keep_ptr, starts_ptr, block_sums_ptr, tl.load(cut_ptr), row, row // RPK, blk,
               C, NB, stride_nh, stride_kr, stride_or, BLOCK_C, AMONG, HAS_STARTS, "")


@triton.jit
def _cut_block(score_ptr, counts_ptr, keep_ptr, starts_ptr, block_sums_ptr, threshold, row, kv_head, blk, C, NB,
               stride_nh, stride_kr, stride_or, BLOCK_C: tl.constexpr, AMONG: tl.constexpr, HAS_STARTS: tl.constexpr,
               CACHE: tl.constexpr):
    """A cut's decision for one row's block of BLOCK_C centroids at `threshold` (centroid_cut_kernel's program);
    CACHE: the scores' load's cache modifier ("", or ".cg": scores other programs of the same launch wrote; always
    passed: Triton 3.6 cannot take a string default of a nested function's constexpr)."""
    cid = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cid < C
    cnt = tl.load(counts_ptr + kv_head * stride_nh + cid, mask=c_ok, other=0)
    score = tl.load(score_ptr + row * stride_or + cid, mask=c_ok, other=0.0, cache_modifier=CACHE)
    _decide(score, threshold, cnt, cid, c_ok, row, kv_head, blk, C, NB, keep_ptr, keep_ptr, score_ptr, starts_ptr,
            block_sums_ptr, score_ptr, True, stride_kr, stride_kr, stride_or, AMONG, HAS_STARTS)


@triton.jit
def _claim(counter_ptr):
    """The next task number of a queue (an int32 counter; tasks past the queue's length mean none is left)."""
    return tl.atomic_add(counter_ptr, 1, sem="relaxed")


@triton.jit
def _wait_count(counter_ptr, target, MAX_SPIN: tl.constexpr):
    """Spin until the counter reaches target (acquire: the writes released before its increments are visible after),
    for at most MAX_SPIN reads."""
    done = tl.atomic_add(counter_ptr, 0, sem="acquire")
    spins = 0
    while (done < target) & (spins < MAX_SPIN):
        done = tl.atomic_add(counter_ptr, 0, sem="acquire")
        spins += 1
    tl.debug_barrier()  # every thread of the program reads after the acquire


@triton.jit(do_not_specialize=DECODE_LOOKUP_SIZES)
def centroid_decode_lookup_kernel(
    q_ptr, cent_ptr, counts_ptr, step_ptr,  # inputs: q [Hq, 1, D], centroids [Hkv, C, D], counts [Hkv, C], step
    part_max_ptr, part_sum_ptr, s_ptr,  # the denominator's partials [Hq, NSPLIT] and the s2 cache [Hq, C], float32
    keep_ptr, score_ptr,  # outputs [Hkv, C]: keep uint8 (a bool view), score float32
    starts_ptr, block_sums_ptr,  # HAS_STARTS: [Hkv, C + 1] int64 key ranges in; [Hkv, NB] int64 kept keys out
    hist_ptr,  # HAS_HIST: [CUT_COPIES * CUT_BINS + 1] int32, the cut's histograms and ticket (zeroed here)
    on_ptr,  # HIST_FIXED: [Hkv] uint8, the KV heads whose clusters stay out of the histogram
    cut_ptr, listed_ptr,  # HAS_HIST: [1] float32 out, the cut's threshold; HAS_LISTED: [M] int64 (_cut_when_last)
    sync_ptr,  # [SYNC] int32, zero before the launch and left zero: the denominator's queue, its done count, the
    # score's queue, the exits, the cut written, the cut's queue, the score's done count (CUT_HERE, or EXPAND_HERE
    # without HAS_HIST), the cut's done count and the expansion's queue (EXPAND_HERE)
    scale2, threshold, C, G, NSPLIT, NB, UNITS,
    stride_qh, stride_ch, stride_cc, stride_nh, stride_s, stride_kr, stride_or,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= G, >= 16: the denominator's query rows (a dot's M)
    BLOCK_C: tl.constexpr,  # the denominator's centroid block
    SCORE_M: tl.constexpr,  # >= G: the score's query rows
    SCORE_C: tl.constexpr,  # the score's centroid block (the cut's and the expansion's: NB = cdiv(C, SCORE_C))
    BLOCK_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
    CODES16: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    M=0, lo=0, hi=0, key_base=0.0, key_least=0.0, per_listed=0.0,  # HAS_HIST: the keys asked (KeyCount)
    HAS_HIST: tl.constexpr = False,
    HIST_FIXED: tl.constexpr = False,
    HAS_LISTED: tl.constexpr = False,
    PER_HEAD: tl.constexpr = False,
    CUT_LOW: tl.constexpr = -64.0,
    CUT_PER: tl.constexpr = 32.0,
    CUT_BINS: tl.constexpr = 2048,
    CUT_COPIES: tl.constexpr = 1,
    BLOCK_Z: tl.constexpr = 1024,
    MAX_SPIN: tl.constexpr = 1 << 22,
    AHEAD: tl.constexpr = False,  # read a block of centroids before the wait (see below)
    CUT_HERE: tl.constexpr = False,  # HAS_HIST: decide keep at the cut in a third queue (centroid_cut_kernel's work)
    indptr_ptr=None, out_ptr=None,  # EXPAND_HERE: the Selection's [Hkv + 1] int64 and [capacity] int32, out
    fixed_ptr=None, fixed_on_ptr=None, W=0, tail=0,  # EXPAND_HERE: as expand_groups_kernel's
    EXPAND_HERE: tl.constexpr = False,  # (CUT_HERE where HAS_HIST) the expansion in a last queue
    EXP_BLOCK_K: tl.constexpr = 8,  # EXPAND_HERE: expand_groups_kernel's BLOCK_K, SUB, RCHUNK, BLOCK_NB, BLOCK_T,
    EXP_SUB: tl.constexpr = 128,  # HAS_FIXED (its BLOCK_G is SCORE_C: the block sums are the score pass's)
    EXP_RCHUNK: tl.constexpr = 1,
    EXP_BLOCK_NB: tl.constexpr = 2,
    EXP_BLOCK_T: tl.constexpr = 64,
    EXP_FIXED: tl.constexpr = False,
    SYNC: tl.constexpr = 9,  # the counters in sync_ptr
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """Both passes of a dense decode lookup (one token, a row per KV head) in one launch of any number of programs:
    the denominator pass's tasks (unit, split) from one queue, then, once every one of them is done, the score pass's
    tasks (unit, centroid block) from another: each the same arithmetic as centroid_denominator_kernel's and
    centroid_score_kernel's, so the same partials, scores, keep, block sums and cut bit for bit.

    A program takes tasks from a queue until it is empty, and waits only for tasks other programs have taken, which
    they finish without waiting: no program waits on one that has not started, so the launch needs no program
    resident at once and shares the GPU with anything. The queues live in sync [7] int32, zero before the launch: the
    last program to exit zeroes them for the next. A wait gives up after MAX_SPIN reads (counters not zeroed before
    the launch: wrong results, no hang). With CUT_HERE (a cut at a number of keys), the program that finishes the
    score pass's last task writes the cut (_write_cut) and tells the others, which wait for it (it is running), and
    the cut's tasks (KV head, block of centroids) come from a third queue: keep and the block sums at the cut, as
    centroid_cut_kernel decides them, with no launch of its own. (Not a ticket per program, as _cut_when_last
    takes: a program that has not started would hold the others up.) With EXPAND_HERE, once every block's keep and
    kept keys are written (the score's tasks, or the cut's), the expansion's tasks (KV head, block) come from a last
    queue: expand_groups_kernel's programs (kernels.jit.compact.expand_block), the Selection with no launch of its own.

    With AHEAD, program p reads the first block of denominator task p before it waits (PDL; an index is no kernel's
    output in a step), as the denominator pass does: it uses them if the queue gives it task p, and otherwise they
    wait in L2 for the program the queue gives that task."""
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    pos0 = pid // UNITS * BLOCK_C + tl.arange(0, BLOCK_C)
    ct0 = _centroids_ahead(cent_ptr + pid % UNITS * stride_ch, pos0, C, offs_d, D, stride_cc, q_ptr.dtype.element_ty,
                           CODES16, AHEAD)
    wait_prior(PDL)
    release_next(PDL)
    tasks = UNITS * NSPLIT
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < G
    t = _claim(sync_ptr)
    while t < tasks:  # the denominator pass (centroid_denominator_kernel, dense, one token, STORE_S)
        unit = t % UNITS
        split = t // UNITS
        head = unit * G + offs_m  # query rows h * Lq + t with Lq = 1
        cent = cent_ptr + unit * stride_ch
        qb = _load_queries(q_ptr, head, offs_m * 0, m_ok, offs_d, D, stride_qh, 0, step_ptr + unit * D, SCALED,
                           CODES16)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        first = split
        if AHEAD:
            if t == pid:  # the block read ahead (positions past C masked: nothing of them counts)
                m_i, l_i = _denominator_block(qb, ct0, pos0, pos0 < C, pos0, 0, m_i, l_i, head, m_ok, head, scale2,
                                              counts_ptr + unit * stride_nh, counts_ptr, s_ptr, 0, stride_s, 1, False,
                                              True, DOT_PRECISION)
                first = split + NSPLIT
        for blk in range(first, tl.cdiv(C, BLOCK_C), NSPLIT):
            pos = blk * BLOCK_C + tl.arange(0, BLOCK_C)
            c_ok = pos < C
            ct = _load_centroids_t(cent, pos, c_ok, offs_d, D, stride_cc, q_ptr.dtype.element_ty, CODES16)
            m_i, l_i = _denominator_block(qb, ct, pos, c_ok, pos, 0, m_i, l_i, head, m_ok, head, scale2,
                                          counts_ptr + unit * stride_nh, counts_ptr, s_ptr, 0, stride_s, 1, False,
                                          True, DOT_PRECISION)
        tl.store(part_max_ptr + head * NSPLIT + split, m_i, mask=m_ok)
        tl.store(part_sum_ptr + head * NSPLIT + split, l_i, mask=m_ok)
        if HAS_HIST:  # the cut's histograms and ticket zeroed, BLOCK_Z entries a task, the tasks in turn
            for z0 in range(t * BLOCK_Z, CUT_COPIES * CUT_BINS + 1, tasks * BLOCK_Z):
                offs_z = z0 + tl.arange(0, BLOCK_Z)
                tl.store(hist_ptr + offs_z, tl.zeros([BLOCK_Z], tl.int32), mask=offs_z <= CUT_COPIES * CUT_BINS)
        tl.debug_barrier()  # the task's stores before its count (release)
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
        t = _claim(sync_ptr)
    _wait_count(sync_ptr + 1, tasks, MAX_SPIN)
    offs_g = tl.arange(0, SCORE_M)
    g_ok = offs_g < G
    t = _claim(sync_ptr + 2)
    while t < UNITS * NB:  # the score pass (centroid_score_kernel, LOAD_S, a row per unit)
        unit = t % UNITS
        blk = t // UNITS
        head = unit * G + offs_g
        pos = blk * SCORE_C + tl.arange(0, SCORE_C)
        c_ok = pos < C
        cnt = tl.load(counts_ptr + unit * stride_nh + pos, mask=c_ok, other=0)
        log2_d = _log2_denominator(part_max_ptr, part_sum_ptr, head, g_ok, NSPLIT, BLOCK_SPLIT)
        s = tl.load(s_ptr + head[:, None] * stride_s + pos[None, :], mask=g_ok[:, None] & c_ok[None, :], other=0.0)
        p = tl.where(g_ok[:, None] & c_ok[None, :], tl.exp2(s - log2_d[:, None]), 0.0)  # S [SCORE_M, SCORE_C]
        # (one token: the score pass's mean over heads and tokens and its last token's are both this)
        _decide(tl.sum(p, axis=0) / G, threshold, cnt, pos, c_ok, unit, unit, blk, C, NB,
                counts_ptr, keep_ptr, score_ptr, starts_ptr, block_sums_ptr,
                hist_ptr + t % CUT_COPIES * CUT_BINS, _counted(on_ptr, unit, HIST_FIXED), 0, stride_kr, stride_or,
                False, HAS_STARTS, HAS_HIST, CUT_LOW, CUT_PER, CUT_BINS)
        if EXPAND_HERE and not HAS_HIST:  # keep and the block sums final: counted for the expansion (release)
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 6, 1, sem="release")
        if CUT_HERE:  # the program that finishes the last task writes the cut (it is running: the others may wait)
            tl.debug_barrier()  # the task's histogram atomics are in before its count
            if tl.atomic_add(sync_ptr + 6, 1) == UNITS * NB - 1:
                _write_cut(hist_ptr, cut_ptr, listed_ptr, M, lo, hi, key_base, key_least, per_listed, cut_ptr, 0,
                           0.0, on_ptr, UNITS, HAS_LISTED, False, PER_HEAD, HIST_FIXED, CUT_LOW, CUT_PER, CUT_BINS,
                           CUT_COPIES)
                tl.debug_barrier()  # the cut stored before it is told
                tl.atomic_add(sync_ptr + 4, 1, sem="release")
        t = _claim(sync_ptr + 2)
    if HAS_HIST:
        if not CUT_HERE:
            _cut_when_last(hist_ptr, cut_ptr, listed_ptr, M, lo, hi, key_base, key_least, per_listed, cut_ptr, 0, 0.0,
                           on_ptr, UNITS, HAS_LISTED, False, PER_HEAD, HIST_FIXED, CUT_LOW, CUT_PER, CUT_BINS,
                           CUT_COPIES)
        else:
            _wait_count(sync_ptr + 4, 1, MAX_SPIN)
            cut = tl.load(cut_ptr, cache_modifier=".cg")
            t = _claim(sync_ptr + 5)
            while t < UNITS * NB:  # centroid_cut_kernel's programs (a row per KV head)
                _cut_block(score_ptr, counts_ptr, keep_ptr, starts_ptr, block_sums_ptr, cut, t % UNITS, t % UNITS,
                           t // UNITS, C, NB, stride_nh, stride_kr, stride_or, SCORE_C, False, HAS_STARTS, ".cg")
                if EXPAND_HERE:  # (release: the block's keep and kept keys before its count)
                    tl.debug_barrier()
                    tl.atomic_add(sync_ptr + 7, 1, sem="release")
                t = _claim(sync_ptr + 5)
    if EXPAND_HERE:  # expand_groups_kernel's programs, once every block's keep and kept keys are in
        _wait_count(sync_ptr + (7 if HAS_HIST else 6), UNITS * NB, MAX_SPIN)
        t = _claim(sync_ptr + 8)
        while t < UNITS * NB:
            expand_block(keep_ptr, starts_ptr, block_sums_ptr, indptr_ptr, out_ptr, C, NB, 1, tail, fixed_ptr,
                         fixed_on_ptr, W, t % UNITS, t // UNITS, SCORE_C, EXP_BLOCK_K, EXP_SUB, EXP_RCHUNK,
                         EXP_BLOCK_NB, EXP_BLOCK_T, EXP_FIXED, ".cg")
            t = _claim(sync_ptr + 8)
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + 3, 1) == tl.num_programs(0) - 1:  # the last to exit: every queue drained and passed
        tl.store(sync_ptr + tl.arange(0, 16), tl.zeros([16], tl.int32), mask=tl.arange(0, 16) < SYNC)
