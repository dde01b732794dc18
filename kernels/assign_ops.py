"""Typed wrapper of the nearest-centroid kernel (kernels/jit/assign.py): check, pick blocks, launch.

`nearest_centroid(points, centroids)` has the signature and semantics of `kernels.reference.assign.nearest_centroid`: the
k-means assignment without the [N, K] similarity matrix the reference computes chunk by chunk (at 128K keys and 5%
centroids, 13 GB per layer and iteration written and read back, and thousands of chunk launches at 512K). Head dims
the kernel does not take go to the reference.
"""

from __future__ import annotations

import torch
import triton

from kernels.checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from kernels.jit.assign import nearest_centroid_kernel
from kernels.launch import dependent_launch
from kernels.reference import assign as reference

# --- Knobs ---------------------------------------------------------------------------------------------------------
# A point tile stays in registers while the centroid tiles stream past it; head dim 256 halves the point tile.
BLOCK_N = 128
BLOCK_K = 64
LARGE_HEAD_DIM = 256
LARGE_BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 3


def nearest_centroid(points: torch.Tensor, centroids: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """points [H, N, D], centroids [H, K, D], bias [H, K] or None -> (labels [H, N] int64, best [H, N] float32): per
    point the centroid of the largest score, its inner product (computed in the points' dtype, centroids cast to it,
    float32 accumulation) plus its bias in float32 (the first on a tie), and that score."""
    if points.dim() != 3 or centroids.dim() != 3 or points.shape[0] != centroids.shape[0] \
            or points.shape[2] != centroids.shape[2]:
        raise ValueError(f"expected points [H, N, D] and centroids [H, K, D]; got {tuple(points.shape)}, "
                         f"{tuple(centroids.shape)}")
    if points.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"points must be one of {SUPPORTED_DTYPES}, got {points.dtype}")
    h, n, d = points.shape
    k = centroids.shape[1]
    if k == 0:
        raise ValueError("nearest_centroid needs at least one centroid")
    if bias is not None and tuple(bias.shape) != (h, k):
        raise ValueError(f"expected bias [H, K] = {(h, k)}; got {tuple(bias.shape)}")
    if d not in SUPPORTED_HEAD_DIMS:
        return reference.nearest_centroid(points, centroids, bias)
    x = points if points.stride(-1) == 1 else points.contiguous()
    c = centroids.to(points.dtype)
    c = c if c.stride(-1) == 1 else c.contiguous()
    labels = torch.empty(h, n, device=points.device, dtype=torch.int64)
    best = torch.empty(h, n, device=points.device, dtype=torch.float32)
    b = labels if bias is None else bias.float().contiguous()  # any tensor: not read without a bias
    block_n = LARGE_BLOCK_N if d >= LARGE_HEAD_DIM else BLOCK_N
    if h and n:
        nearest_centroid_kernel[(triton.cdiv(n, block_n), h)](
            x, c, b, labels, best, n, k, x.stride(0), x.stride(1), c.stride(0), c.stride(1),
            HEAD_DIM=d, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=NUM_WARPS, num_stages=NUM_STAGES, **dependent_launch(x.device),
        )
    return labels, best


__all__ = ["nearest_centroid"]
