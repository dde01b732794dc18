"""Reference of a step's statistics added into a turn's sums on the device (kernels/jit/tally.py)."""

from __future__ import annotations

import torch


def tally_step(indptr: torch.Tensor, elements: torch.Tensor, kept: torch.Tensor, read: torch.Tensor,
               fresh: torch.Tensor | None = None, scores: torch.Tensor | None = None,
               best: torch.Tensor | None = None) -> None:
    """Add one lookup's statistics into running sums, in place.

    indptr: [R + 1] int, the selection's row offsets (row r keeps indptr[r + 1] - indptr[r] keys);
    elements: [E] numbers, the index elements the lookup read; fresh: [R, M] bool or None, the follow rows each row
    read besides its selection; scores: [R, U] or None, the lookup's unit scores.
    kept: [R] float32 += each row's kept keys (+ its fresh follow rows); read: [1] float32 += sum(elements);
    best: [R, U] float32 = max(best, scores) where scores are given.
    """
    counts = (indptr[1:] - indptr[:-1]).to(kept.dtype)
    if fresh is not None:
        counts = counts + fresh.sum(dim=1).to(kept.dtype)
    kept.add_(counts)
    read.add_(elements.to(read.dtype).sum())
    if scores is not None:
        torch.maximum(best, scores.to(best.dtype), out=best)
