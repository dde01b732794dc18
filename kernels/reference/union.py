"""Reference of a decode step's whole attention (kernels/jit/union.py): a query over the union of the fixed
context's keys its row selects, the follow rows the selection does not hold and the new tokens its position sees,
written into the layer's output."""

from __future__ import annotations

import torch

from kernels.reference.causal import causal_attention
from kernels.reference.follow import follow_attention
from kernels.reference.sparse import attention_with_lse, sparse_attention
from kernels.selection import FollowRows, Selection


def union_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection | None,
    scale: float,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: int,
    follow: FollowRows | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q: [Hq, Lq, D]; k, v: [Hkv, N, D] the fixed context; selection: its keys each row reads (rows Hq or Hkv), or
    None for every key; k_new, v_new: [Hkv, n, D] the new tokens, slot j at position k_start + j, seen by query i
    iff k_start + j <= q_pos[i] (slots past the newest query's position are never read); follow: the follow rows,
    added to a selection (ignored without one or when it holds no position).
    Returns out [Hq, Lq, D] (written into `out`, any float dtype and strides, when given; float32 otherwise), lse
    [Hq, Lq] float32 (natural log) and fresh [R, M] bool (the follow rows each selection row read beyond its own
    keys), or None without follow rows.
    """
    if selection is None:
        fixed = attention_with_lse(q, k, v, scale)
    else:
        fixed = sparse_attention(q, k, v, selection, scale)
    fresh = None
    if selection is not None and follow is not None and follow.positions.numel():
        *fixed, fresh = follow_attention(q, k, v, selection, follow.positions, follow.first, follow.indexed,
                                         follow.order, scale, prior=fixed)
    out, lse = causal_attention(q, k_new, v_new, scale, q_pos, k_start, None, tuple(fixed), out)
    return out, lse, fresh
