"""Reference of the sparse attention (kernels/jit/sparse.py): attention over each row's selected keys, and the
dense attention the kernel's dense mode computes."""

from __future__ import annotations

import torch

from kernels.reference._common import NEG_INF, _grouped, _softmax_out, _ungrouped
from kernels.selection import Selection


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of every query over every key, with an optional boolean mask.

    mask: [Lq, Lk] or [Hq, Lq, Lk] bool, True where the query may attend.
    Returns out [Hq, Lq, D] float32, lse [Hq, Lq] float32.
    """
    hq, lq, _ = q.shape
    hkv, lk, _ = k.shape
    if lk == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full((hq, lq), NEG_INF, dtype=torch.float32)
    qg = _grouped(q.float(), hkv)  # [Hkv, G*Lq, D]
    scores = torch.matmul(qg, k.float().transpose(1, 2)) * scale  # [Hkv, G*Lq, Lk]
    if mask is not None:
        full = mask.expand(hq, lq, lk)
        scores = scores.masked_fill(~_grouped(full, hkv), NEG_INF)
    out, lse = _softmax_out(scores, v)
    return _ungrouped(out, hq), _ungrouped(lse, hq)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over only the keys its row selects (reads just those keys).

    Every query token of a row uses the same selection. Rows are query heads or KV heads (see Selection).
    Returns out [Hq, Lq, D] float32, lse [Hq, Lq] float32.
    """
    hq, lq, _ = q.shape
    hkv = k.shape[0]
    rows = selection.rows
    if rows not in (hq, hkv) or hq % rows:
        raise ValueError(f"selection has {rows} rows; expected Hq={hq} or Hkv={hkv}")
    idx, valid = selection.padded()  # [R, W]
    kv_head = torch.arange(rows, device=q.device) * hkv // rows  # [R]
    ks = k[kv_head[:, None], idx].float()  # [R, W, D]
    vs = v[kv_head[:, None], idx].float()
    qg = _grouped(q.float(), rows)  # [R, G*Lq, D]
    scores = torch.matmul(qg, ks.transpose(1, 2)) * scale  # [R, G*Lq, W]
    scores = scores.masked_fill(~valid[:, None, :], NEG_INF)
    if idx.shape[1] == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full((hq, lq), NEG_INF, dtype=torch.float32)
    out, lse = _softmax_out(scores, vs)
    return _ungrouped(out, hq), _ungrouped(lse, hq)
