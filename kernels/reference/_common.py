"""Helpers shared by the references: GQA grouping of query heads, the softmax with its log-sum-exp, and the one-byte
formats' decoding (Quest's page bounds, squeeze's centroids)."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
CODES = 255  # one-byte formats: codes 0..255 per (KV head, dim), uint8, with an offset and a step per (KV head, dim)


def dequantize(codes: torch.Tensor, offset: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """uint8 codes [Hkv, N, D] with offset, step [Hkv, D] float32 -> float32 values [Hkv, N, D]."""
    return offset[:, None] + step[:, None] * codes.float()


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
