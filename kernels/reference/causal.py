"""Reference of the causal (and sliding-window) attention over consecutive positions (kernels/jit/causal.py)."""

from __future__ import annotations

import torch

from kernels.reference.merge import merge_attention
from kernels.reference.sparse import attention_with_lse


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor,
    k_start: int,
    window: int | None = None,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention over keys at consecutive positions, causal and optionally within a sliding window.

    q: [Hq, Lq, D]; k, v: [Hkv, Lk, D]; q_pos: [Lq] int64 on q's device, the absolute position of each query;
    key j sits at position k_start + j. Query i attends key j iff k_pos <= q_pos[i] and, with a window,
    k_pos > q_pos[i] - window.
    Returns out [Hq, Lq, D] float32, lse [Hq, Lq] float32 (out 0, lse -inf for a query that sees no key).
    Masked values still enter the product with probability 0, so k and v must be finite everywhere here.
    prior: (out [Hq, Lq, D], lse [Hq, Lq]) float32, the attention of the same queries over other keys: the result is
    their union's (kernels.reference.merge.merge_attention); out: a tensor [Hq, Lq, D] (any float dtype and strides)
    the result is written into and returned.
    """
    k_pos = k_start + torch.arange(k.shape[1], device=q.device)  # [Lk]
    mask = k_pos[None, :] <= q_pos[:, None]  # [Lq, Lk]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    own = attention_with_lse(q, k, v, scale, mask)
    if prior is None and out is None:
        return own
    return merge_attention([prior, own] if prior is not None else [own], out)
