"""Reference of the best-buckets pick (kernels/jit/buckets.py): a score threshold that reaches a number of keys."""

from __future__ import annotations

import torch


def take_best(score: torch.Tensor, sizes: torch.Tensor, budget: float) -> torch.Tensor:
    """score [H, C] float32, sizes [H, C] int64 keys per bucket -> keep [H, C] bool: the buckets scoring at least
    tau, where tau is the highest bucket score whose buckets at or above it hold at least `budget` keys (every
    bucket where none does). The buckets best first until the budget, the one that reaches it included; buckets
    tied at tau all kept. O(C^2) per row, no sort."""
    if score.shape != sizes.shape or score.dim() != 2:
        raise ValueError(f"score and sizes must be [H, C] alike, got {tuple(score.shape)}, {tuple(sizes.shape)}")
    held = ((score[:, None, :] >= score[:, :, None]) * sizes[:, None, :].to(torch.float32)).sum(-1)  # [H, C]
    reach = torch.where(held >= budget, score, torch.full_like(score, float("-inf"))).amax(-1)
    tau = torch.maximum(reach, score.amin(-1))
    return score >= tau[:, None]
