"""Reference of the log-sum-exp merge of partial attentions (kernels/jit/merge.py)."""

from __future__ import annotations

import torch


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]],
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions over disjoint key sets by log-sum-exp.

    parts: [(out [H, L, D], lse [H, L])]; out: optional [H, L, D] tensor the result is written into (any dtype and
    strides: the caller's layout). Returns (out, lse) over the union of the key sets (out float32 when not given).
    """
    lses = torch.stack([lse for _, lse in parts])  # [P, H, L]
    total = torch.logsumexp(lses, dim=0)  # [H, L]
    safe_total = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    weights = torch.exp(lses - safe_total[None])  # [P, H, L]; exp(-inf) = 0 for empty parts
    merged = sum(w[..., None] * o for w, (o, _) in zip(weights, parts))
    if out is None:
        return merged, total
    out.copy_(merged)
    return out, total
