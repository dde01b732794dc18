"""Reference of the follow part of a step's attention (kernels/jit/follow.py): attention over the follow rows that a
row's selection does not already hold, to be merged with the selection's own attention by log-sum-exp.

The follow rows are token positions (engine.attention.follow); a layer stores its indexed tokens first (row = position -
`first`, rows [0, indexed)) and a method may keep them in its own order (`order`: the row of each stored indexed
row in the layout the K/V are in). Rows past the indexed ones (the dense rows) are read by every step already.
"""

from __future__ import annotations

import torch

from kernels.reference._common import NEG_INF, _grouped, _ungrouped
from kernels.reference.merge import merge_attention
from kernels.selection import Selection, contains


def follow_rows(positions: torch.Tensor, first: int, indexed: int, order: torch.Tensor | None,
                num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [M] int64 (token positions, -1: none) -> ([Hkv, M] int64 rows of the layer's K/V, [Hkv, M] bool
    valid: an indexed token's). order: [Hkv, indexed] int32 or None (rows as stored)."""
    stored = positions.to(torch.int64) - first
    valid = (positions >= 0) & (stored >= 0) & (stored < indexed)
    stored = stored.clamp(0, max(indexed - 1, 0)).expand(num_kv_heads, -1)
    rows = stored if order is None else order.gather(1, stored).to(torch.int64)
    return rows, valid.expand(num_kv_heads, -1)


def follow_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
    positions: torch.Tensor,
    first: int,
    indexed: int,
    order: torch.Tensor | None,
    scale: float,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of each selection row's queries over its follow rows that it does not select (each row of
    `selection` sorted; `positions` without repeats).

    q: [Hq, Lq, D]; k, v: [Hkv, N, D]; selection: R = Hkv or Hq rows (row r: KV head r * Hkv // R, query heads
    r * Hq // R ..); positions: [M] int64 token positions, -1 for none; order: [Hkv, indexed] int32 or None;
    prior: (out [Hq, Lq, D], lse [Hq, Lq]) float32, the selection's own attention, or None.
    Returns out [Hq, Lq, D] float32, lse [Hq, Lq] float32 (-inf, out 0, where a row has no fresh rows) and fresh
    [R, M] bool (the rows each selection row reads here: valid and not selected); with a prior, out and lse are
    over the union of the selection and the fresh rows (the prior merged in by log-sum-exp; the GPU kernel writes
    them into the prior's tensors).
    """
    hq, lq, d = q.shape
    hkv = k.shape[0]
    r = selection.rows
    rows, valid = follow_rows(positions, first, indexed, order, hkv)  # [Hkv, M]
    head = torch.arange(r, device=q.device) * hkv // r
    rows, valid = rows[head], valid[head]  # [R, M]
    fresh = valid & ~contains(selection, rows)
    keys = k[head[:, None], rows].float()  # [R, M, D]
    values = v[head[:, None], rows].float()
    scores = torch.matmul(_grouped(q.float(), r), keys.transpose(1, 2)) * scale  # [R, G * Lq, M]
    scores = scores.masked_fill(~fresh[:, None, :], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [R, G * Lq]
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out, lse = _ungrouped(torch.matmul(probs, values), hq), _ungrouped(lse, hq)
    if prior is not None:
        out, lse = merge_attention([(prior[0].float(), prior[1].float()), (out, lse)])
    return out, lse, fresh
