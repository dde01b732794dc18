"""A call's new K/V appended to a layer's buffers at a device-side count: the @triton.jit kernel (wrapper:
kernels/append_ops.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior
from kernels.tables import table_pointer, table_stride


@triton.jit
def append_tokens_kernel(
    k_ptr, v_ptr, kb_ptr, vb_ptr, count_ptr,
    n, rows,
    stride_kh, stride_kn, stride_vh, stride_vn, stride_kbh, stride_kbn, stride_vbh, stride_vbn,
    stride_kb=0, stride_vb=0,  # BATCHED: the step of k / v from one sequence's rows to the next's
    table_ptr=None,  # BATCHED: [B, TABLE_W] int64, sequence b's kb, vb, count addresses (APPEND_POINTERS)
    params_ptr=None,  # BATCHED: [B, PARAMS_W] int64, its buffers' strides (APPEND_PARAMS)
    HEAD_DIM: tl.constexpr = 128, BLOCK_R: tl.constexpr = 16,
    PDL: tl.constexpr = False,  # kernels/launch.py
    BATCHED: tl.constexpr = False,
    TABLE_W: tl.constexpr = 3,
    PARAMS_W: tl.constexpr = 4,
    ALIGNED: tl.constexpr = False,  # BATCHED: the buffers' addresses (APPEND_TILES) and strides 16-aligned
):
    """One program: rows = Hkv * n (row r = head r // n, token r % n) of k / v [Hkv, n, HEAD_DIM] (unit stride in D)
    stored at slot count + token of kb / vb [Hkv, capacity, HEAD_DIM], BLOCK_R rows at a time; then count += n (the
    one program reads count before any store and writes it last: no other program races it). BATCHED: grid (B,),
    program b copies rows b of k / v [B, Hkv, n, HEAD_DIM] into sequence b's buffers and count, read from row b of
    the tables (the first sequence's, passed as kb / vb / count, give the dtypes)."""
    wait_prior(PDL)
    release_next(PDL)
    if BATCHED:
        b = tl.program_id(0)
        k_ptr += b.to(tl.int64) * stride_kb
        v_ptr += b.to(tl.int64) * stride_vb
        at = table_ptr + b * TABLE_W
        kb_ptr = table_pointer(at, 0, kb_ptr, ALIGNED)
        vb_ptr = table_pointer(at, 1, vb_ptr, ALIGNED)
        count_ptr = table_pointer(at, 2, count_ptr)
        values = params_ptr + b * PARAMS_W
        stride_kbh = table_stride(values, 0, ALIGNED)
        stride_kbn = table_stride(values, 1, ALIGNED)
        stride_vbh = table_stride(values, 2, ALIGNED)
        stride_vbn = table_stride(values, 3, ALIGNED)
    base = tl.load(count_ptr)
    d = tl.arange(0, HEAD_DIM)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ok = r < rows
        head = (r // n).to(tl.int64)
        tok = (r % n).to(tl.int64)
        slot = base + tok
        key = tl.load(k_ptr + head[:, None] * stride_kh + tok[:, None] * stride_kn + d[None, :], mask=ok[:, None])
        tl.store(kb_ptr + head[:, None] * stride_kbh + slot[:, None] * stride_kbn + d[None, :],
                 key.to(kb_ptr.dtype.element_ty), mask=ok[:, None])
        value = tl.load(v_ptr + head[:, None] * stride_vh + tok[:, None] * stride_vn + d[None, :], mask=ok[:, None])
        tl.store(vb_ptr + head[:, None] * stride_vbh + slot[:, None] * stride_vbn + d[None, :],
                 value.to(vb_ptr.dtype.element_ty), mask=ok[:, None])
    tl.store(count_ptr, base + n)
