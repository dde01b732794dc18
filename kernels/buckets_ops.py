"""Typed wrapper of the best-buckets kernel (kernels/jit/buckets.py): `take_best(score, sizes, budget)` has the
signature and semantics of `kernels.reference.buckets.take_best`, in one launch (a sort, a gather, a prefix sum and a
scatter in torch: torch.sort alone of 8 rows of 1,024 is tens of microseconds), no host synchronisation."""

from __future__ import annotations

import torch
import triton

from kernels.jit.buckets import take_best_kernel
from kernels.reference import buckets as reference

BLOCK_T = 16  # candidate scores per step: a [16, C] tile
WARPS = 4


def take_best(score: torch.Tensor, sizes: torch.Tensor, budget: float) -> torch.Tensor:
    if score.shape != sizes.shape or score.dim() != 2:
        raise ValueError(f"score and sizes must be [H, C] alike, got {tuple(score.shape)}, {tuple(sizes.shape)}")
    if score.dtype != torch.float32 or sizes.dtype != torch.int64:
        raise TypeError(f"score must be float32 and sizes int64, got {score.dtype}, {sizes.dtype}")
    h, c = score.shape
    keep = torch.empty(h, c, dtype=torch.bool, device=score.device)
    if h and c:
        take_best_kernel[(h,)](score.contiguous(), sizes.contiguous(), keep, c, float(budget),
                               BLOCK_C=max(16, triton.next_power_of_2(c)), BLOCK_T=BLOCK_T, num_warps=WARPS)
    return keep


__all__ = ["take_best", "reference"]
