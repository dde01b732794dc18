"""Nearest centroid by inner product (k-means' assignment step): the @triton.jit kernel (wrapper:
kernels/assign_ops.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior


@triton.jit
def nearest_centroid_kernel(
    x_ptr, c_ptr, bias_ptr, label_ptr, best_ptr,
    n, k,
    stride_xh, stride_xn, stride_ch, stride_ck,
    HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """Program (i, h): points i * BLOCK_N .. of head h against every centroid of head h, BLOCK_K at a time.

    x: [H, N, HEAD_DIM] points, c: [H, K, HEAD_DIM] centroids (one dtype, unit stride in D), with HAS_BIAS bias
    [H, K] fp32 contiguous (added to each centroid's products: -|c|^2 / 2 makes the largest score the nearest
    centroid in Euclidean distance) -> label [H * N] int64 (the first centroid of the largest score), best [H * N]
    fp32 (that score, fp32 accumulation; INPUT_PRECISION "ieee" for fp32 points, which tl.dot would otherwise round
    to tf32).
    The [N, K] score matrix is never written: each tile's maximum folds into a running (best, label) per point.
    """
    wait_prior(PDL)
    release_next(PDL)
    pid_n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_n < n
    x = tl.load(x_ptr + h * stride_xh + offs_n[:, None].to(tl.int64) * stride_xn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_N, D]
    best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    label = tl.zeros([BLOCK_N], dtype=tl.int32)
    for start in range(0, k, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        col_ok = offs_k < k
        c = tl.load(c_ptr + h * stride_ch + offs_k[None, :].to(tl.int64) * stride_ck + offs_d[:, None],
                    mask=col_ok[None, :], other=0.0)  # [D, BLOCK_K]
        s = tl.dot(x, c, input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_K] fp32
        if HAS_BIAS:
            s += tl.load(bias_ptr + h * k + offs_k, mask=col_ok, other=0.0)[None, :]
        s = tl.where(col_ok[None, :], s, float("-inf"))
        tile_best = tl.max(s, axis=1)
        tile_label = tl.argmax(s, axis=1) + start
        better = tile_best > best  # strict: an earlier tile keeps a tie
        label = tl.where(better, tile_label, label)
        best = tl.where(better, tile_best, best)
    out = h * n + offs_n
    tl.store(label_ptr + out, label.to(tl.int64), mask=row_ok)
    tl.store(best_ptr + out, best, mask=row_ok)
