"""A call's new K/V appended to a layer's buffers at a device-side count: the @triton.jit kernel (wrapper:
kernels/append_ops.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior


@triton.jit
def append_tokens_kernel(
    k_ptr, v_ptr, kb_ptr, vb_ptr, count_ptr,
    n, rows,
    stride_kh, stride_kn, stride_vh, stride_vn, stride_kbh, stride_kbn, stride_vbh, stride_vbn,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """One program: rows = Hkv * n (row r = head r // n, token r % n) of k / v [Hkv, n, HEAD_DIM] (unit stride in D)
    stored at slot count + token of kb / vb [Hkv, capacity, HEAD_DIM], BLOCK_R rows at a time; then count += n (the
    one program reads count before any store and writes it last: no other program races it)."""
    wait_prior(PDL)
    release_next(PDL)
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
