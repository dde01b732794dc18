"""Sparse FlashAttention over a CSR selection of keys: the @triton.jit kernels (wrappers: kernels/sparse_ops.py).

Vocabulary (see kernels.selection.Selection and kernels.reference.sparse_attention):
    row r       one entry of the selection; it reads KV head r * Hkv // rows and serves G = Hq // rows query heads
    M = G * Lq  the query rows of a row: its G query heads stacked along the Lq tokens (m -> head r*G + m // Lq,
                token m % Lq), so each selected key is loaded once for the whole group
    item        a work item of split-KV: `chunk` consecutive entries of one row's key list (the last one shorter);
                items are numbered row after row, row r owning items first[r] .. first[r] + ceil(count[r]/chunk) - 1.
                The plan is recomputed on the device from indptr by every program (no host synchronisation).
    packed      prefill first copies the first packed_cap entries of the key list (their K/V) into contiguous
                buffers (gather_selected_kernel); a range that ends within them is read from there

Scores are kept in the log2 domain (q.k * scale * log2(e)), so partial lse values are base 2; final lse is natural.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


# Arguments that follow a context's size, not specialised on (kernels/README.md)
ATTN_SIZES = ["packed_cap", "dense_len"]
GATHER_SIZES = ["cap"]
MERGE_SIZES = ["dense_len"]


@triton.jit
def item_plan(indptr_ptr, rows, chunk, BLOCK_R: tl.constexpr, DENSE: tl.constexpr = False, dense_len=0):
    """Work items per row from indptr [rows + 1] (DENSE: row r is keys r * dense_len .. (r + 1) * dense_len - 1,
    indptr is not read): ceil(keys / chunk).

    Returns first [BLOCK_R] (exclusive prefix sum of the items per row), n_items [BLOCK_R] (0 past `rows`) and the
    total number of items (a scalar).
    """
    r = tl.arange(0, BLOCK_R)
    in_range = r < rows
    lo, hi = bounds(indptr_ptr, r, in_range, DENSE, dense_len)
    n_items = (hi - lo + chunk - 1) // chunk
    inclusive = tl.cumsum(n_items, 0)
    return inclusive - n_items, n_items, tl.sum(n_items, 0)


@triton.jit
def bounds(indptr_ptr, r, ok, DENSE: tl.constexpr, dense_len):
    """Entries lo .. hi - 1 of rows r (0, 0 where not ok): from indptr, or DENSE rows of dense_len keys each."""
    if DENSE:
        lo = tl.where(ok, r.to(tl.int64) * dense_len, 0)
        hi = tl.where(ok, lo + dense_len, 0)
    else:
        lo = tl.load(indptr_ptr + r, mask=ok, other=0).to(tl.int64)
        hi = tl.load(indptr_ptr + r + 1, mask=ok, other=0).to(tl.int64)
    return lo, hi


@triton.jit
def _heaviest_first(indptr_ptr, rows, rank, BLOCK_R: tl.constexpr):
    """The row with the rank-th most keys (ties: lower row first), from indptr [rows + 1] on the device. Programs
    are started in grid order, so giving grid row `rank` to that row starts the longest rows' programs first and
    leaves the short ones to fill the last wave (longest processing time first)."""
    r = tl.arange(0, BLOCK_R)
    ok = r < rows
    count = tl.load(indptr_ptr + r + 1, mask=ok, other=0) - tl.load(indptr_ptr + r, mask=ok, other=0)
    count = tl.where(ok, count, -1)
    c_i, c_j = count[:, None], count[None, :]
    before = (c_j > c_i) | ((c_j == c_i) & (r[None, :] < r[:, None]))  # [i, j]: row j ranks before row i
    row_rank = tl.sum(before.to(tl.int32), axis=1)  # [BLOCK_R]
    return tl.sum(tl.where(row_rank == rank, r, 0), axis=0)


@triton.jit
def _key_block(
    q, k_base, v_base, indices_ptr, n0, end, offs_d, acc, m_i, l_i,
    stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, k_desc, v_desc,
    BLOCK_N: tl.constexpr, EXACT_FP32: tl.constexpr, GATHERED: tl.constexpr, MASKED: tl.constexpr,
    FUSED: tl.constexpr, TMA: tl.constexpr,
):
    """One step of the online softmax over entries n0 .. n0 + BLOCK_N - 1 of the key list (MASKED: those < end
    only; else all of them, with no mask on any load). GATHERED: entry n is row n of the packed buffers k_base /
    v_base; else key indices[n] of k_base / v_base. FUSED: scale inside the exponent and accumulate P V into
    acc in the dot; else scale s first and add P V to acc. H200, 128K, 32/8 heads: prefill with whole blocks
    unmasked and FUSED took 1.41 ms where every block masked and unfused took 1.55; split-KV decode (16 query
    rows) took 71 us that way instead of 55, so it keeps the masked, unfused form. TMA (packed K/V, unmasked
    blocks only): k_desc / v_desc are tensor descriptors of the packed buffers [capacity, HEAD_DIM] with blocks
    [BLOCK_N, HEAD_DIM], loaded by the copy engine. Returns (acc, m_i, l_i)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        n_valid = offs_n < end
        if GATHERED:
            idx = offs_n.to(tl.int64)
        else:
            idx = tl.load(indices_ptr + offs_n, mask=n_valid, other=0).to(tl.int64)  # [BLOCK_N] key rows
        k = tl.load(k_base + idx[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=n_valid[:, None], other=0.0)
        v = tl.load(v_base + idx[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=n_valid[:, None], other=0.0)
    elif TMA:
        y = tl.cast(n0, tl.int32)  # descriptor coordinates are 32-bit
        k = k_desc.load([y, 0])  # [BLOCK_N, HEAD_DIM]
        v = v_desc.load([y, 0])
    else:
        idx = offs_n.to(tl.int64) if GATHERED else tl.load(indices_ptr + offs_n).to(tl.int64)
        k = tl.load(k_base + idx[:, None] * stride_kn + offs_d[None, :] * stride_kd)  # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_base + idx[:, None] * stride_vn + offs_d[None, :] * stride_vd)
    if EXACT_FP32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N], unscaled
    if FUSED:
        if MASKED:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 domain; finite: a block holds at least one key
        p = tl.exp2(s * qk_scale - m_new[:, None])
    else:
        s = s * qk_scale
        if MASKED:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FUSED:
        acc = acc * alpha[:, None]
        if EXACT_FP32:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        if EXACT_FP32:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _key_loop(
    q, k_base, v_base, indices_ptr, start, end, offs_d, acc, m_i, l_i,
    stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, k_desc, v_desc,
    BLOCK_N: tl.constexpr, EXACT_FP32: tl.constexpr, GATHERED: tl.constexpr, PEEL: tl.constexpr, TMA: tl.constexpr,
):
    """The online softmax over entries start .. end - 1 of the key list, BLOCK_N at a time (see _key_block).
    PEEL (prefill): whole blocks without masks (through the descriptors with TMA), then the last, partial block;
    else (split-KV items) every block masked, unfused (measured faster there). Returns (acc, m_i, l_i)."""
    if PEEL:
        full_end = start + (end - start) // BLOCK_N * BLOCK_N
        for n0 in range(start, full_end, BLOCK_N):
            acc, m_i, l_i = _key_block(q, k_base, v_base, indices_ptr, n0, end, offs_d, acc, m_i, l_i,
                                       stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, k_desc, v_desc,
                                       BLOCK_N, EXACT_FP32, GATHERED, False, True, TMA)
        if full_end < end:
            acc, m_i, l_i = _key_block(q, k_base, v_base, indices_ptr, full_end, end, offs_d, acc, m_i, l_i,
                                       stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, k_desc, v_desc,
                                       BLOCK_N, EXACT_FP32, GATHERED, True, True, False)
    else:
        for n0 in range(start, end, BLOCK_N):
            acc, m_i, l_i = _key_block(q, k_base, v_base, indices_ptr, n0, end, offs_d, acc, m_i, l_i,
                                       stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, k_desc, v_desc,
                                       BLOCK_N, EXACT_FP32, GATHERED, True, False, False)
    return acc, m_i, l_i


@triton.jit
def attend(
    q_ptr, k_ptr, v_ptr, indices_ptr,
    row, start, end, offs_m, offs_d, m_valid,
    stride_qh, stride_ql, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    rows, num_kv_heads, group, lq, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, EXACT_FP32: tl.constexpr,
    PACKED: tl.constexpr = False,
    PEEL: tl.constexpr = True,
    kp_ptr=None,
    vp_ptr=None,
    packed_cap=0,
    k_desc=None,
    v_desc=None,
    TMA: tl.constexpr = False,
    DENSE: tl.constexpr = False,
    row_start=0,
):
    """Online softmax of the query rows offs_m of `row` over its selected keys indices[start:end].

    DENSE: the row's key list is its whole KV head, in order (no index list is read): entry n of the range
    row_start .. is key n - row_start of k / v (dense attention through the same split-KV and prefill grids).

    PACKED: kp/vp hold the first packed_cap entries of the key list packed in selection order ([packed_cap,
    HEAD_DIM], gather_selected_kernel): a range that ends within them reads entry n as row n of kp/vp, no index
    read; a range past them (a selection larger than the buffers) reads k/v through the indices. TMA (PACKED and
    PEEL only): whole packed blocks come through the tensor descriptors k_desc / v_desc of those buffers, the last,
    partial block through masked loads (a descriptor would read past the row into the next row's keys or into
    unwritten memory).
    Returns acc [BLOCK_M, HEAD_DIM] (unnormalised, fp32), m [BLOCK_M] (running max, log2 domain), l [BLOCK_M]
    (running sum of exp2(s - m)); l == 0 where no key was seen.
    """
    head = (row * group + offs_m // lq).to(tl.int64)  # [BLOCK_M] query head of each query row
    tok = offs_m % lq
    q = tl.load(
        q_ptr + head[:, None] * stride_qh + tok[:, None] * stride_ql + offs_d[None, :] * stride_qd,
        mask=m_valid[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM], input dtype
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    kv_head = (row * num_kv_heads // rows).to(tl.int64)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    if DENSE:
        acc, m_i, l_i = _key_loop(q, k_base - row_start * stride_kn, v_base - row_start * stride_vn, indices_ptr,
                                  start, end, offs_d, acc, m_i, l_i, stride_kn, stride_kd, stride_vn, stride_vd,
                                  qk_scale, k_desc, v_desc, BLOCK_N, EXACT_FP32, True, PEEL, False)
    elif PACKED:
        if end <= packed_cap:
            acc, m_i, l_i = _key_loop(q, kp_ptr, vp_ptr, indices_ptr, start, end, offs_d, acc, m_i, l_i,
                                      HEAD_DIM, 1, HEAD_DIM, 1, qk_scale, k_desc, v_desc,
                                      BLOCK_N, EXACT_FP32, True, PEEL, TMA)
        else:
            acc, m_i, l_i = _key_loop(q, k_base, v_base, indices_ptr, start, end, offs_d, acc, m_i, l_i,
                                      stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, k_desc, v_desc,
                                      BLOCK_N, EXACT_FP32, False, PEEL, False)
    else:
        acc, m_i, l_i = _key_loop(q, k_base, v_base, indices_ptr, start, end, offs_d, acc, m_i, l_i,
                                  stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, k_desc, v_desc,
                                  BLOCK_N, EXACT_FP32, False, PEEL, False)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=ATTN_SIZES)
def sparse_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, out_ptr, lse_ptr,
    stride_qh, stride_ql, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    rows, num_kv_heads, group, lq, chunk, qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr,
    EXACT_FP32: tl.constexpr,
    PACKED: tl.constexpr = False,
    kp_ptr=None,
    vp_ptr=None,
    packed_cap=0,
    k_desc=None,
    v_desc=None,
    TMA: tl.constexpr = False,
    DENSE: tl.constexpr = False,
    dense_len=0,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """Sparse attention forward. Grid axis 0: blocks of BLOCK_M query rows (of M = group * lq).

    SPLIT == False (prefill): axis 1 is the row (heaviest first); the program reads the row's whole key list and
        writes the final out [rows * M, HEAD_DIM] fp32 and lse [rows * M] fp32 (natural log; 0 and -inf for an
        empty row).
    SPLIT == True (split-KV, decode): axis 1 holds persistent workers; worker w takes items w, w + W, w + 2W, ...
        below the total (known on the device only) and writes, per item, the normalised partial output into
        out [items, M, HEAD_DIM] and its base-2 lse into lse [items, M]; sparse_attn_merge_kernel combines them.
    PACKED: kp / vp [packed_cap, HEAD_DIM] hold the first packed_cap entries of the key list (see _attend); TMA:
    k_desc / v_desc describe them. DENSE: row r's entries indptr[r] .. indptr[r + 1] - 1 are the keys 0 .. of its
    KV head in order; indices is not read, nor indptr: row r's entries are r * dense_len .. (r + 1) * dense_len - 1.
    """
    wait_prior(PDL)
    release_next(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    num_m = group * lq
    m_valid = offs_m < num_m
    if SPLIT:
        first, n_items, total = item_plan(indptr_ptr, rows, chunk, BLOCK_R, DENSE, dense_len)
        r_ids = tl.arange(0, BLOCK_R)
        for item in range(tl.program_id(1), total, tl.num_programs(1)):
            row = tl.sum((first + n_items <= item).to(tl.int32), 0)  # rows whose items all precede this one
            local = item - tl.sum(tl.where(r_ids == row, first, 0), 0)
            row_lo, row_hi = bounds(indptr_ptr, row, True, DENSE, dense_len)
            start = row_lo + local * chunk
            end = tl.minimum(start + chunk, row_hi)
            acc, m_i, l_i = attend(
                q_ptr, k_ptr, v_ptr, indices_ptr, row, start, end, offs_m, offs_d, m_valid,
                stride_qh, stride_ql, stride_qd, stride_kh, stride_kn, stride_kd, stride_vh, stride_vn, stride_vd,
                rows, num_kv_heads, group, lq, qk_scale,
                BLOCK_M, BLOCK_N, HEAD_DIM, EXACT_FP32, PACKED, False, kp_ptr, vp_ptr, packed_cap,
                DENSE=DENSE, row_start=start - local * chunk,
            )
            flat = item * num_m + offs_m.to(tl.int64)  # [BLOCK_M] rows of the partial buffers
            tl.store(out_ptr + flat[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=m_valid[:, None])
            tl.store(lse_ptr + flat, m_i + tl.log2(l_i), mask=m_valid)  # l_i > 0: an item holds >= 1 key
    else:
        if DENSE:  # every row holds dense_len keys: grid order is as good as any
            row = tl.program_id(1)
        else:
            row = _heaviest_first(indptr_ptr, rows, tl.program_id(1), BLOCK_R)
        start, end = bounds(indptr_ptr, row, True, DENSE, dense_len)
        acc, m_i, l_i = attend(
            q_ptr, k_ptr, v_ptr, indices_ptr, row, start, end, offs_m, offs_d, m_valid,
            stride_qh, stride_ql, stride_qd, stride_kh, stride_kn, stride_kd, stride_vh, stride_vn, stride_vd,
            rows, num_kv_heads, group, lq, qk_scale,
            BLOCK_M, BLOCK_N, HEAD_DIM, EXACT_FP32, PACKED, True, kp_ptr, vp_ptr, packed_cap, k_desc, v_desc, TMA,
            DENSE, start,
        )
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
        flat = row.to(tl.int64) * num_m + offs_m
        tl.store(out_ptr + flat[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=m_valid[:, None])
        tl.store(lse_ptr + flat, lse, mask=m_valid)


@triton.jit(do_not_specialize=GATHER_SIZES)
def gather_selected_kernel(
    k_ptr, v_ptr, indptr_ptr, indices_ptr, k_out_ptr, v_out_ptr,
    stride_kh, stride_kn, stride_vh, stride_vn,
    rows, num_kv_heads, cap,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """Copy the first `cap` entries of the key list (the selected keys and values, in selection order: entry n of
    the CSR list -> buffer row n) into packed [cap, HEAD_DIM] buffers. Grid (key blocks, rows): program (t, r)
    copies entries indptr[r] + t * BLOCK_N ... of row r below cap, or nothing past the row's end (the grid covers
    the longest possible row)."""
    wait_prior(PDL)
    release_next(PDL)
    row = tl.program_id(1)
    start = tl.load(indptr_ptr + row).to(tl.int64) + tl.program_id(0) * BLOCK_N
    end = tl.minimum(tl.load(indptr_ptr + row + 1).to(tl.int64), cap)
    if start < end:
        offs_n = start + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        ok = (offs_n < end)[:, None]
        idx = tl.load(indices_ptr + offs_n, mask=offs_n < end, other=0).to(tl.int64)
        kv_head = (row * num_kv_heads // rows).to(tl.int64)
        k = tl.load(k_ptr + kv_head * stride_kh + idx[:, None] * stride_kn + offs_d[None, :], mask=ok)
        tl.store(k_out_ptr + offs_n[:, None] * HEAD_DIM + offs_d[None, :], k, mask=ok)
        v = tl.load(v_ptr + kv_head * stride_vh + idx[:, None] * stride_vn + offs_d[None, :], mask=ok)
        tl.store(v_out_ptr + offs_n[:, None] * HEAD_DIM + offs_d[None, :], v, mask=ok)


@triton.jit(do_not_specialize=MERGE_SIZES)
def sparse_attn_merge_kernel(
    part_out_ptr, part_lse_ptr, indptr_ptr, out_ptr, lse_ptr,
    rows, num_m, chunk,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DENSE: tl.constexpr = False,
    dense_len=0,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """Log-sum-exp merge of the split-KV partials. Grid (cdiv(num_m, BLOCK_M), rows, HEAD_DIM // BLOCK_D): BLOCK_M
    query rows of one row and one slice of the head dimension per program; the row's partials are read BLOCK_I at
    a time (decode: many items, one query row per program; split prefill: few items, many query rows).

    part_out [items, num_m, HEAD_DIM] fp32 (normalised), part_lse [items, num_m] fp32 (base 2) ->
    out [rows * num_m, HEAD_DIM] fp32, lse [rows * num_m] fp32 (natural log; 0 and -inf for a row with no keys).
    """
    wait_prior(PDL)
    release_next(PDL)
    row = tl.program_id(1)
    first, n_items, _ = item_plan(indptr_ptr, rows, chunk, BLOCK_R, DENSE, dense_len)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_valid = offs_m < num_m
    r_ids = tl.arange(0, BLOCK_R)
    row_first = tl.sum(tl.where(r_ids == row, first, 0), 0)
    row_items = tl.sum(tl.where(r_ids == row, n_items, 0), 0)
    out, lse = merge_items(part_out_ptr, part_lse_ptr, row_first, row_items, offs_m, offs_d, m_valid, num_m,
                           HEAD_DIM, BLOCK_M, BLOCK_I, BLOCK_D)
    dst = row.to(tl.int64) * num_m + offs_m  # [BLOCK_M]
    tl.store(out_ptr + dst[:, None] * HEAD_DIM + offs_d[None, :], out, mask=m_valid[:, None])
    if tl.program_id(2) == 0:
        tl.store(lse_ptr + dst, lse, mask=m_valid)


@triton.jit
def merge_items(
    part_out_ptr, part_lse_ptr, row_first, row_items, offs_m, offs_d, m_valid, num_m,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Log-sum-exp merge of the partials row_first .. row_first + row_items - 1 (of part_out [items, num_m,
    HEAD_DIM] fp32, normalised, and part_lse [items, num_m] fp32, base 2; an item that saw no key holds lse -inf),
    query rows offs_m, head-dim slice offs_d, BLOCK_I partials at a time. Returns out [BLOCK_M, BLOCK_D] fp32 and
    lse [BLOCK_M] (natural log; out 0 and lse -inf for a query row no item saw a key of)."""
    offs_i = tl.arange(0, BLOCK_I)
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the partial lse (base 2)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i0 in range(0, row_items, BLOCK_I):
        valid = m_valid[:, None] & (i0 + offs_i < row_items)[None, :]  # [BLOCK_M, BLOCK_I]
        flat = (row_first + i0 + offs_i).to(tl.int64)[None, :] * num_m + offs_m[:, None]  # [BLOCK_M, BLOCK_I]
        part_lse = tl.load(part_lse_ptr + flat, mask=valid, other=float("-inf"))
        part_out = tl.load(
            part_out_ptr + flat[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=valid[:, :, None], other=0.0
        )  # [BLOCK_M, BLOCK_I, BLOCK_D]
        m_new = tl.maximum(m_run, tl.max(part_lse, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: no (-inf) - (-inf)
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(part_lse - m_ref[:, None])  # [BLOCK_M, BLOCK_I], 0 past the row's items and for empty items
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part_out, 1)
        l_run = l_run * alpha + tl.sum(w, 1)
        m_run = m_new
    empty = l_run == 0.0
    l_safe = tl.where(empty, 1.0, l_run)
    return acc / l_safe[:, None], tl.where(empty, float("-inf"), (m_run + tl.log2(l_safe)) * LN2)
