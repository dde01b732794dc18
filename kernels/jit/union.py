"""A decode step's whole attention in two launches: the @triton.jit kernels (wrapper: kernels/union_ops.py;
semantics: kernels/reference/union.py).

A query's keys are the union of three disjoint sets: the fixed context's keys its row selects (or all of them),
the follow rows the selection does not hold (kernels/jit/follow.py) and the new tokens its position sees
(kernels/jit/causal.py). One split-KV launch takes all three as work items: first the selection's items, numbered
and cut as kernels/jit/sparse.py's (ceil(keys / chunk) per row, row after row), then, numbered after them, each
row's short items: ceil(visible / chunk) over the new tokens' slots (visible: up to the newest query's position,
read on the device) and, with FOLLOW, one over its follow rows. A worker runs its selection items, then short
items from the last worker back (those that drew a selection item fewer). The two loops are apart so the
selection's loop keeps the sparse kernel's registers (three workers to an SM). Every item writes a normalised
partial and its base-2 lse; the merge kernel combines a row's items and writes the layer's output in the
model's dtype and layout. BATCHED: one launch of each for several sequences, each over its own context, their
tensors and values read from tables (kernels/union_ops.py union_attention_batch).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.jit.causal import causal_keys
from kernels.jit.follow import follow_keys, fresh_rows
from kernels.jit.merge import merge_pair
from kernels.jit.sparse import attend, bounds, item_plan, merge_items
from kernels.jit.tally import running_max, tally_row
from kernels.launch import release_next, wait_prior
from kernels.tables import table_pointer, table_stride

# Arguments that follow a context's size, not specialised on (kernels/README.md)
SPLIT_SIZES = ["stride_order", "k_start", "first", "indexed", "spread", "dense_len"]
MERGE_SIZES = ["k_start", "n_units", "stride_scores", "stride_best", "spread", "dense_len"]


@triton.jit
def new_items(q_pos_ptr, stride_p, lq, k_start, n_new, chunk):
    """Items of every row over the new tokens: slots 0 .. visible - 1 (visible = newest query's position - k_start +
    1, within [0, n_new]) in items of `chunk` slots. Returns (items, visible), int32 scalars. (Scalar loads: a
    block load and its reduction here took the split kernel from 193 registers to 255 and spills.)"""
    top = tl.load(q_pos_ptr).to(tl.int32)
    for i in range(1, lq):
        top = tl.maximum(top, tl.load(q_pos_ptr + i * stride_p).to(tl.int32))
    visible = tl.minimum(tl.maximum(top - k_start + 1, 0), n_new)
    return (visible + chunk - 1) // chunk, visible


@triton.jit
def fitted_plan(indptr_ptr, rows, chunk, spread, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DENSE: tl.constexpr,
                dense_len, FIT: tl.constexpr):
    """The selection's items (item_plan's), their keys fitted on the device to those it holds: `chunk` is the plan's,
    sized for a typical selection; with FIT a heavier one (DuoAttention's layers with several whole heads) takes the
    multiple of BLOCK_N that cuts it into at most `spread` items (a row's rounding up counted): one wave of longer
    items rather than several waves (fewer items: the partial buffers sized for `chunk` still hold them). The split
    and the merge launch derive the same plan. Returns (first [BLOCK_R], n_items [BLOCK_R], total items, keys per
    item). (Cutting a lighter one into shorter items as well made squeeze's 128K step slower on an H200:
    engine/bench/README.md.)"""
    key_chunk = chunk
    if FIT:
        r = tl.arange(0, BLOCK_R)
        lo, hi = bounds(indptr_ptr, r, r < rows, DENSE, dense_len)
        least = tl.cdiv(tl.sum(hi - lo, 0), tl.maximum(spread - rows, 1))
        key_chunk = tl.maximum((least + BLOCK_N - 1) // BLOCK_N * BLOCK_N, chunk)
    first_item, n_items, total = item_plan(indptr_ptr, rows, key_chunk, BLOCK_R, DENSE, dense_len)
    return first_item, n_items, total, key_chunk


@triton.jit
def _store_partial(part_out_ptr, part_lse_ptr, item, num_m, offs_m, offs_d, m_valid, acc, m_i, l_i,
                   HEAD_DIM: tl.constexpr):
    """An item's normalised partial and its base-2 lse (out 0, lse -inf where it saw no key)."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    flat = item * num_m + offs_m.to(tl.int64)  # [BLOCK_M] rows of the partial buffers
    tl.store(part_out_ptr + flat[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=m_valid[:, None])
    tl.store(part_lse_ptr + flat, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")), mask=m_valid)


@triton.jit(do_not_specialize=SPLIT_SIZES)
def union_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, kn_ptr, vn_ptr, q_pos_ptr, pos_ptr, order_ptr, fresh_ptr,
    part_out_ptr, part_lse_ptr,
    stride_qh, stride_ql, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_nkh, stride_nkn, stride_nkd,
    stride_nvh, stride_nvn, stride_nvd,
    stride_p, stride_order,
    rows, num_kv_heads, group, lq, chunk, qk_scale, k_start, n_new, first, indexed, m_rows, spread,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXACT_FP32: tl.constexpr,
    DENSE: tl.constexpr,
    FOLLOW: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    PROBES: tl.constexpr,
    ROUNDS: tl.constexpr,
    dense_len=0,
    FIT: tl.constexpr = False,
    PDL: tl.constexpr = False,  # kernels/launch.py
    table_ptr=None,  # BATCHED: [B, TABLE_W] int64 addresses
    params_ptr=None,  # BATCHED: [B, PARAMS_W] int64
    BATCHED: tl.constexpr = False,
    TABLE_W: tl.constexpr = 13,  # len(SPLIT_POINTERS)
    PARAMS_W: tl.constexpr = 13,  # len(SPLIT_PARAMS)
    ALIGNED: tl.constexpr = False,  # BATCHED: the tiles' addresses (SPLIT_TILES) and K/V head strides 16-aligned
):
    """Grid (cdiv(M, BLOCK_M), workers), M = group * lq query rows per row; BATCHED: grid (cdiv(M, BLOCK_M), workers,
    B), sequence b's tensors and the values that differ between sequences read from row b of table and params
    (in the order of SPLIT_POINTERS and SPLIT_PARAMS, kernels/union_ops.py; every other argument, the first
    sequence's, gives the dtypes and the strides the sequences share).

    q [Hq, Lq, D]; k / v [Hkv, N, D] the fixed context (DENSE: every key of row r's KV head, indptr / indices not
    read); kn / vn [Hkv, n_new, D] the new tokens' slots, slot j at position k_start + j; q_pos [Lq] (stride
    stride_p). FOLLOW: pos [m_rows] int64 token positions of the follow rows (-1: none), mapped through
    order [Hkv, indexed] int32 when HAS_ORDER (kernels/jit/follow.py); the query block 0 of a row's follow item
    writes fresh [rows, m_rows] int8. Writes part_out [items, M, D] fp32 (normalised; 0 for an item that saw no
    key) and part_lse [items, M] fp32 (base 2; -inf for such an item): the selection's items first, then row r's
    short items at total + r * (new-token items + FOLLOW) ... The selection's items are fitted_plan's (chunk, spread,
    FIT), as the merge kernel derives them.
    """
    wait_prior(PDL)
    release_next(PDL)
    if BATCHED:  # this program's sequence (SPLIT_POINTERS, SPLIT_PARAMS in kernels/union_ops.py)
        at = table_ptr + tl.program_id(2) * TABLE_W
        q_ptr = table_pointer(at, 0, q_ptr, ALIGNED)
        k_ptr = table_pointer(at, 1, k_ptr, ALIGNED)
        v_ptr = table_pointer(at, 2, v_ptr, ALIGNED)
        indptr_ptr = table_pointer(at, 3, indptr_ptr)
        indices_ptr = table_pointer(at, 4, indices_ptr)
        kn_ptr = table_pointer(at, 5, kn_ptr, ALIGNED)
        vn_ptr = table_pointer(at, 6, vn_ptr, ALIGNED)
        q_pos_ptr = table_pointer(at, 7, q_pos_ptr)
        pos_ptr = table_pointer(at, 8, pos_ptr)
        order_ptr = table_pointer(at, 9, order_ptr)
        fresh_ptr = table_pointer(at, 10, fresh_ptr)
        part_out_ptr = table_pointer(at, 11, part_out_ptr, ALIGNED)
        part_lse_ptr = table_pointer(at, 12, part_lse_ptr, ALIGNED)
        at = params_ptr + tl.program_id(2) * PARAMS_W
        stride_kh = table_stride(at, 0, ALIGNED)
        stride_vh = table_stride(at, 1, ALIGNED)
        stride_nkh = table_stride(at, 2, ALIGNED)
        stride_nvh = table_stride(at, 3, ALIGNED)
        stride_order = tl.load(at + 4)
        chunk = tl.load(at + 5)
        k_start = tl.load(at + 6)
        n_new = tl.load(at + 7)
        first = tl.load(at + 8)
        indexed = tl.load(at + 9)
        m_rows = tl.load(at + 10)
        spread = tl.load(at + 11)
        dense_len = tl.load(at + 12)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    num_m = group * lq
    m_valid = offs_m < num_m
    worker, workers = tl.program_id(1), tl.num_programs(1)
    first_item, n_items, total, key_chunk = fitted_plan(indptr_ptr, rows, chunk, spread, BLOCK_R, BLOCK_N, DENSE,
                                                        dense_len, FIT)
    r_ids = tl.arange(0, BLOCK_R)
    for item in range(worker, total, workers):  # the selection's keys (kernels/jit/sparse.py's split items)
        row = tl.sum((first_item + n_items <= item).to(tl.int32), 0)  # rows whose items all precede this one
        local = item - tl.sum(tl.where(r_ids == row, first_item, 0), 0)
        row_lo, row_hi = bounds(indptr_ptr, row, True, DENSE, dense_len)
        start = row_lo + local * key_chunk
        acc, m_i, l_i = attend(
            q_ptr, k_ptr, v_ptr, indices_ptr, row, start, tl.minimum(start + key_chunk, row_hi), offs_m, offs_d,
            m_valid, stride_qh, stride_ql, stride_qd, stride_kh, stride_kn, stride_kd, stride_vh, stride_vn,
            stride_vd, rows, num_kv_heads, group, lq, qk_scale,
            BLOCK_M, BLOCK_N, HEAD_DIM, EXACT_FP32, False, False, DENSE=DENSE, row_start=row_lo,
        )
        _store_partial(part_out_ptr, part_lse_ptr, item, num_m, offs_m, offs_d, m_valid, acc, m_i, l_i, HEAD_DIM)
    n_causal, visible = new_items(q_pos_ptr, stride_p, lq, k_start, n_new, chunk)
    per_row = n_causal + FOLLOW
    for short in range(workers - 1 - worker, rows * per_row, workers):  # new tokens and follow rows
        row = short // per_row
        local = short - row * per_row
        kv_head = (row * num_kv_heads // rows).to(tl.int64)
        head = (row * group + offs_m // lq).to(tl.int64)  # [BLOCK_M] query head of each query row
        tok = offs_m % lq
        q = tl.load(q_ptr + head[:, None] * stride_qh + tok[:, None] * stride_ql + offs_d[None, :] * stride_qd,
                    mask=m_valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM], the keys' dtype
        if local < n_causal:  # new-token slots lo .. lo + chunk - 1, each query seeing up to its position
            lo = (local * chunk).to(tl.int32)
            pos = tl.load(q_pos_ptr + tok * stride_p).to(tl.int64)
            last = tl.minimum(tl.maximum(pos - k_start, -1), n_new).to(tl.int32)  # [BLOCK_M]
            acc, m_i, l_i = causal_keys(
                q, kn_ptr + kv_head * stride_nkh, vn_ptr + kv_head * stride_nvh, lo,
                tl.minimum(lo + chunk, visible).to(tl.int32), last, 0,
                tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32), tl.full([BLOCK_M], float("-inf"), tl.float32),
                tl.zeros([BLOCK_M], dtype=tl.float32), offs_d, stride_nkn, stride_nkd, stride_nvn, stride_nvd,
                qk_scale, BLOCK_N, False, EXACT_FP32,
            )
        else:  # the follow rows the row does not select
            follow_row, fresh = fresh_rows(pos_ptr, order_ptr, indptr_ptr, indices_ptr, row, kv_head, first,
                                           indexed, m_rows, stride_order, HAS_ORDER, PROBES, ROUNDS, BLOCK_K)
            if tl.program_id(0) == 0:
                offs_k = tl.arange(0, BLOCK_K)
                tl.store(fresh_ptr + row * m_rows + offs_k, fresh.to(tl.int8), mask=offs_k < m_rows)
            acc, m_i, l_i = follow_keys(q, k_ptr, v_ptr, kv_head, follow_row, fresh, stride_kh, stride_kn,
                                        stride_vh, stride_vn, qk_scale, offs_d, EXACT_FP32)
        _store_partial(part_out_ptr, part_lse_ptr, total + short, num_m, offs_m, offs_d, m_valid, acc, m_i, l_i,
                       HEAD_DIM)


@triton.jit(do_not_specialize=MERGE_SIZES)
def union_merge_kernel(
    part_out_ptr, part_lse_ptr, indptr_ptr, q_pos_ptr, out_ptr, lse_ptr,
    fresh_ptr, kept_ptr, read_ptr, elements_ptr, scores_ptr, best_ptr,
    rows, group, lq, chunk, k_start, n_new, stride_p, stride_oh, stride_ol,
    m_rows, n_elements, n_units, stride_scores, stride_best, spread,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DENSE: tl.constexpr,
    FOLLOW: tl.constexpr,
    TALLY: tl.constexpr,
    HAS_SCORES: tl.constexpr,
    dense_len=0,
    FIT: tl.constexpr = False,
    BLOCK_N: tl.constexpr = 64,
    BLOCK_S: tl.constexpr = 4,
    BLOCK_F: tl.constexpr = 64,
    BLOCK_E: tl.constexpr = 128,
    BLOCK_U: tl.constexpr = 512,
    PDL: tl.constexpr = False,  # kernels/launch.py
    table_ptr=None,  # BATCHED: [B, TABLE_W] int64 addresses
    params_ptr=None,  # BATCHED: [B, PARAMS_W] int64
    BATCHED: tl.constexpr = False,
    TABLE_W: tl.constexpr = 12,  # len(MERGE_POINTERS)
    PARAMS_W: tl.constexpr = 12,  # len(MERGE_PARAMS)
    ALIGNED: tl.constexpr = False,  # BATCHED: the tiles' addresses (MERGE_TILES) and out strides 16-aligned
):
    """Each row's items merged by log-sum-exp (the same plan as union_attn_fwd_kernel, derived on the device): its
    selection's BLOCK_I at a time, its few short items BLOCK_S at a time. Grid (cdiv(M, BLOCK_M), rows,
    HEAD_DIM // BLOCK_D). Writes out [Hq, Lq, HEAD_DIM] (strides stride_oh,
    stride_ol, unit in D; any float dtype) and lse [Hq * Lq] fp32 (natural log; out 0 and lse -inf for a query
    that sees no key).
    TALLY: also the step's statistics (kernels.reference.tally.tally_step, one row per KV head): the first program
    of each row adds its kept keys and fresh follow rows (fresh [rows, m_rows] int8, written by the split launch)
    into kept [rows], row 0 the elements [n_elements] into read [1]; with HAS_SCORES the row's programs share its
    running max of the unit scores [rows, n_units] into best.
    BATCHED: grid (cdiv(M, BLOCK_M), B * rows, HEAD_DIM // BLOCK_D), sequence b's rows b * rows ..., its tensors and
    values read from row b of table and params (as the split launch's)."""
    wait_prior(PDL)
    release_next(PDL)
    row = tl.program_id(1)
    if BATCHED:  # this program's sequence (MERGE_POINTERS, MERGE_PARAMS in kernels/union_ops.py)
        seq = row // rows
        row = row - seq * rows
        at = table_ptr + seq * TABLE_W
        part_out_ptr = table_pointer(at, 0, part_out_ptr, ALIGNED)
        part_lse_ptr = table_pointer(at, 1, part_lse_ptr, ALIGNED)
        indptr_ptr = table_pointer(at, 2, indptr_ptr)
        q_pos_ptr = table_pointer(at, 3, q_pos_ptr)
        out_ptr = table_pointer(at, 4, out_ptr, ALIGNED)
        lse_ptr = table_pointer(at, 5, lse_ptr, ALIGNED)
        fresh_ptr = table_pointer(at, 6, fresh_ptr)
        kept_ptr = table_pointer(at, 7, kept_ptr)
        read_ptr = table_pointer(at, 8, read_ptr)
        elements_ptr = table_pointer(at, 9, elements_ptr)
        scores_ptr = table_pointer(at, 10, scores_ptr)
        best_ptr = table_pointer(at, 11, best_ptr)
        at = params_ptr + seq * PARAMS_W
        chunk = tl.load(at)
        k_start = tl.load(at + 1)
        n_new = tl.load(at + 2)
        m_rows = tl.load(at + 3)
        n_elements = tl.load(at + 4)
        n_units = tl.load(at + 5)
        stride_scores = tl.load(at + 6)
        stride_best = tl.load(at + 7)
        spread = tl.load(at + 8)
        dense_len = tl.load(at + 9)
        stride_oh = table_stride(at, 10, ALIGNED)
        stride_ol = table_stride(at, 11, ALIGNED)
    num_m = group * lq
    first_item, n_items, total, _ = fitted_plan(indptr_ptr, rows, chunk, spread, BLOCK_R, BLOCK_N, DENSE, dense_len,
                                                FIT)
    r_ids = tl.arange(0, BLOCK_R)
    n_causal, _ = new_items(q_pos_ptr, stride_p, lq, k_start, n_new, chunk)
    per_row = n_causal + FOLLOW
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_valid = offs_m < num_m
    own, own_lse = merge_items(part_out_ptr, part_lse_ptr, tl.sum(tl.where(r_ids == row, first_item, 0), 0),
                               tl.sum(tl.where(r_ids == row, n_items, 0), 0), offs_m, offs_d, m_valid, num_m,
                               HEAD_DIM, BLOCK_M, BLOCK_I, BLOCK_D)
    short, short_lse = merge_items(part_out_ptr, part_lse_ptr, total + row * per_row, per_row, offs_m, offs_d,
                                   m_valid, num_m, HEAD_DIM, BLOCK_M, BLOCK_S, BLOCK_D)
    out, lse = merge_pair(own, own_lse, short, short_lse)
    head = (row * group + offs_m // lq).to(tl.int64)
    tok = (offs_m % lq).to(tl.int64)
    tl.store(out_ptr + head[:, None] * stride_oh + tok[:, None] * stride_ol + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])
    if tl.program_id(2) == 0:
        tl.store(lse_ptr + row.to(tl.int64) * num_m + offs_m, lse, mask=m_valid)
    if TALLY:
        if (tl.program_id(0) == 0) & (tl.program_id(2) == 0):
            tally_row(indptr_ptr, row, fresh_ptr, m_rows, m_rows, kept_ptr, elements_ptr, n_elements, read_ptr,
                      FOLLOW, BLOCK_F, BLOCK_E)
        if HAS_SCORES:
            parts = tl.num_programs(0) * tl.num_programs(2)
            span = tl.cdiv(tl.cdiv(n_units, parts), BLOCK_U) * BLOCK_U
            start = (tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)) * span
            running_max(scores_ptr, best_ptr, row, start, start + span, n_units, stride_scores, stride_best, BLOCK_U)
