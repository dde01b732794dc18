"""Reference of the causal (and sliding-window) attention over consecutive positions (kernels/jit/causal.py)."""

from __future__ import annotations

import torch

from kernels.reference.sparse import attention_with_lse


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor,
    k_start: int,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention over keys at consecutive positions, causal and optionally within a sliding window.

    q: [Hq, Lq, D]; k, v: [Hkv, Lk, D]; q_pos: [Lq] int64 on q's device, the absolute position of each query;
    key j sits at position k_start + j. Query i attends key j iff k_pos <= q_pos[i] and, with a window,
    k_pos > q_pos[i] - window.
    Returns out [Hq, Lq, D] float32, lse [Hq, Lq] float32 (out 0, lse -inf for a query that sees no key).
    Masked values still enter the product with probability 0, so k and v must be finite everywhere here.
    """
    k_pos = k_start + torch.arange(k.shape[1], device=q.device)  # [Lk]
    mask = k_pos[None, :] <= q_pos[:, None]  # [Lq, Lk]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return attention_with_lse(q, k, v, scale, mask)
