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
    Returns out [Hq, Lq, D] float32, lse [Hq, Lq] float32 (out 0, lse -inf for a query that sees no key).
    On the CPU through torch's fused flash attention (`_fused_cpu`: the engine's CPU path, no [Lq, Lk] score matrix
    per head), elsewhere the explicit softmax (`_explicit`); tests/kernels/test_reference.py holds both to a naive one.
    """
    hq, lq, _ = q.shape
    hkv, lk, _ = k.shape
    if lk == 0 or lq == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full((hq, lq), NEG_INF, dtype=torch.float32)
    if q.device.type == "cpu" and _FUSED_CPU is not None:
        return _fused_cpu(q, k, v, scale, mask)
    return _explicit(q, k, v, scale, mask)


# torch's CPU flash attention with its log-sum-exp: (out [B, H, Lq, D], lse [B, H, Lq]); None where a build lacks it
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _explicit(q, k, v, scale, mask=None):
    """attention_with_lse by its definition: the [Hkv, G*Lq, Lk] float32 scores, masked, then the softmax."""
    hq, lq, _ = q.shape
    hkv, lk, _ = k.shape
    qg = _grouped(q.float(), hkv)  # [Hkv, G*Lq, D]
    scores = torch.matmul(qg, k.float().transpose(1, 2)) * scale  # [Hkv, G*Lq, Lk]
    if mask is not None:
        full = mask.expand(hq, lq, lk)
        scores = scores.masked_fill(~_grouped(full, hkv), NEG_INF)
    out, lse = _softmax_out(scores, v)
    return _ungrouped(out, hq), _ungrouped(lse, hq)


def _fused_cpu(q, k, v, scale, mask=None):
    """attention_with_lse through torch's fused CPU kernel (blocked online softmax, float32): the query heads of a
    KV head read its K/V (expanded to [1, Hq, Lk, D]); the mask as an additive bias; a query that sees no key gets
    out 0 and lse -inf (the kernel's lse would be 0 there). 2-3x sooner than `_explicit` on 2 cores for a
    1K-token chunk, the same within float32 rounding (~1e-6)."""
    hq, lq, d = q.shape
    hkv, lk, _ = k.shape

    def per_query_head(x: torch.Tensor) -> torch.Tensor:  # [Hkv, Lk, D] -> [1, Hq, Lk, D]
        return x.float()[:, None].expand(hkv, hq // hkv, lk, d).reshape(1, hq, lk, d)

    bias = None
    if mask is not None:
        mask = mask.expand(lq, lk) if mask.dim() == 2 else mask.expand(hq, lq, lk)  # e.g. [Hq, 1, Lk] for all tokens
        bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, NEG_INF)
        bias = bias.reshape(1, -1, lq, lk)  # [1, 1 or Hq, Lq, Lk]
    out, lse = _FUSED_CPU(q.float()[None], per_query_head(k), per_query_head(v), 0.0, False, attn_mask=bias,
                          scale=scale)
    out, lse = out[0], lse[0]  # [Hq, Lq, D], [Hq, Lq]
    if mask is not None:
        blind = ~mask.any(dim=-1).expand(hq, lq)  # [Hq, Lq]: queries that see no key
        if bool(blind.any()):
            out = out.masked_fill(blind[..., None], 0.0)
            lse = lse.masked_fill(blind, NEG_INF)
    return out, lse


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
