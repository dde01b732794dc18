"""Helpers shared by the references: GQA grouping of query heads, the softmax with its log-sum-exp, the one-byte
formats' decoding (Quest's page bounds, squeeze's centroids), and a step's pooling over its real tokens."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
CODES = 255  # one-byte formats: codes 0..255 per (KV head, dim), uint8, with an offset and a step per (KV head, dim)


def dequantize(codes: torch.Tensor, offset: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """uint8 codes [Hkv, N, D] with offset, step [Hkv, D] float32 -> float32 values [Hkv, N, D]."""
    return offset[:, None] + step[:, None] * codes.float()


def token_mean_and_last(x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, Lq, ...] -> (its mean over the tokens, its last token's) [N, ...], over the first valid[0] tokens only
    (valid: [1] int64 on x's device, a question padded to a captured length: the padding counts in neither; None:
    every token). No host synchronisation."""
    if valid is None:
        return x.mean(dim=1), x[:, -1]
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    real = (torch.arange(x.shape[1], device=x.device) < valid).to(x.dtype).view(shape)
    return (x * real).sum(dim=1) / valid.to(x.dtype), x.index_select(1, (valid - 1).clamp(min=0)).squeeze(1)


def _grouped(q: torch.Tensor, rows: int) -> torch.Tensor:
    """[Hq, Lq, D] -> [rows, (Hq // rows) * Lq, D]: the query heads that share a row, stacked along the tokens."""
    hq, lq, d = q.shape
    return q.reshape(rows, (hq // rows) * lq, d)


def _ungrouped(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[rows, G * Lq, ...] -> [Hq, Lq, ...]."""
    rows, glq = x.shape[:2]
    return x.reshape(hq, (rows * glq) // hq, *x.shape[2:])


def _softmax_out(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: [R, M, N] float32 with -inf where masked; v: [R, N, D] -> out [R, M, D], lse [R, M]."""
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.matmul(probs, v.float())
    return out, lse
