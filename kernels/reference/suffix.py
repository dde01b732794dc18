"""Reference of a decode step's follow rows (kernels/jit/suffix.py): the tokens after the latest occurrences of the
longest suffix of the turn's recent tokens, with the question's rows, each once (engine.attention.follow)."""

from __future__ import annotations

import torch


def shifted(x: torch.Tensor, j: int) -> torch.Tensor:
    """x shifted right by j, -1 in front."""
    out = torch.full_like(x, -1)
    if j < x.numel():
        out[j:] = x[: x.numel() - j]
    return out


def suffix_scores(ids: torch.Tensor, indexed_next: torch.Tensor, recent: torch.Tensor) -> torch.Tensor:
    """[L] int64: for each position p of the context ids [L] int64, the length m of the longest suffix of recent
    [ngram] int64 (-1 in front where the turn has fewer tokens) that ends at p (ids[p - i] == recent[-1 - i] for
    i < m), scored m * (L + 1) + p (the longest, then the latest first) where m > 0 and indexed_next[p]; else -1."""
    n = ids.numel()
    match = ids == recent[-1]
    length = match.to(torch.int64)
    for j in range(1, recent.numel()):  # the token j back must match too
        match = match & (shifted(ids, j) == recent[-1 - j])
        length = length + match.to(torch.int64)
    position = torch.arange(n, device=ids.device)
    return torch.where((length > 0) & indexed_next, length * (n + 1) + position, -1)


def unique_rows(positions: torch.Tensor) -> torch.Tensor:
    """positions [M] int64 sorted, each once (-1 for a repeat): the attention reads a row once."""
    out, _ = positions.sort()
    out[1:] = torch.where(out[1:] == out[:-1], -1, out[1:])
    return out


def follow_step(ids: torch.Tensor, indexed_next: torch.Tensor, recent: torch.Tensor, token: torch.Tensor,
                question: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One decode step's follow rows, in place, with no host synchronisation.

    ids: [L] int64 the context's tokens; indexed_next: [L] bool, whether the token after each position is an
    indexed row; recent: [ngram] int64 the turn's last tokens (-1 in front), shifted by one and `token` [1] int64
    (the step's input) appended, in place; question: [Q] int64 the question's rows the step reads again (Q >= 1);
    out: [D + Q] int64, D >= 1 the rows a step adds: the positions after the D best-scored positions of
    suffix_scores (-1 where none or past the context) with the question's, sorted, each once (unique_rows).
    Returns out."""
    recent.copy_(torch.cat([recent[1:], token.reshape(1).to(recent.dtype)]))
    n, d = ids.numel(), out.numel() - question.numel()
    score = suffix_scores(ids, indexed_next, recent)
    k = min(d, n)
    best, at = score.topk(k)
    if k < d:  # a context shorter than d: pad to the static size
        best = torch.cat([best, torch.full((d - k,), -1, dtype=best.dtype, device=ids.device)])
        at = torch.cat([at, torch.zeros(d - k, dtype=at.dtype, device=ids.device)])
    mine = torch.where((best >= 0) & (at + 1 < n), at + 1, -1)
    out.copy_(unique_rows(torch.cat([mine, question])))
    return out
