"""Typed wrapper of a decode step's follow rows (kernels/jit/suffix.py): two launches, where the reference's
matches, top-k, concatenation and sort are some seventy kernels (per replayed decode step of every sparse method).

`follow_step` has the signature and semantics of `kernels.reference.suffix.follow_step`; the block kernel scores the
context's positions and keeps each block's best, the merge kernel takes the best of those, adds the question's rows,
sorts them and marks the repeats. A context of more than MAX_BLOCKS blocks, or a step's rows past MAX_ROWS, goes to
the reference."""

from __future__ import annotations

import torch
import triton

from kernels.jit.suffix import suffix_block_kernel, suffix_merge_kernel
from kernels.launch import dependent_launch
from kernels.reference import suffix as reference

BLOCK = 1024  # context positions per program of the block kernel
MAX_CANDIDATES = 1 << 14  # candidates the one merge program reads (16K: 2M positions at 8 rows a step)
MAX_ROWS = 1024
MAX_NGRAM = 8

shifted = reference.shifted  # (the family's views: the kernels compute them inside)
suffix_scores = reference.suffix_scores
unique_rows = reference.unique_rows


def follow_step(ids: torch.Tensor, indexed_next: torch.Tensor, recent: torch.Tensor, token: torch.Tensor,
                question: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n, ngram, q = ids.numel(), recent.numel(), question.numel()
    top = out.numel() - q
    if top < 1 or q < 1:
        raise ValueError(f"out [{out.numel()}] must hold at least one step row and the question's {q} (>= 1)")
    if any(t.dtype != torch.int64 for t in (ids, recent, question, out)) or indexed_next.dtype != torch.bool:
        raise ValueError("ids, recent, question and out must be int64, indexed_next bool")
    blocks = triton.cdiv(n, BLOCK)
    if (blocks * top > MAX_CANDIDATES or out.numel() > MAX_ROWS or ngram > MAX_NGRAM or n < top
            or not all(t.is_contiguous() for t in (ids, indexed_next, recent, question, out))):
        return reference.follow_step(ids, indexed_next, recent, token, question, out)
    token = token.reshape(1).to(torch.int64)
    cand_score = torch.empty(blocks * top, dtype=torch.int64, device=ids.device)
    cand_at = torch.empty(blocks * top, dtype=torch.int64, device=ids.device)
    suffix_block_kernel[(blocks,)](ids, indexed_next.view(torch.uint8), recent, token, cand_score, cand_at, n,
                                   NGRAM=ngram, TOP=top, BLOCK=BLOCK, num_warps=4,
                                   **dependent_launch(ids.device))
    suffix_merge_kernel[(1,)](cand_score, cand_at, recent, token, question, out, n, blocks * top, q,
                              NGRAM=ngram, TOP=top, BLOCK_C=max(16, triton.next_power_of_2(blocks * top)),
                              BLOCK_O=max(16, triton.next_power_of_2(out.numel())),
                              BLOCK_G=max(2, triton.next_power_of_2(ngram)), num_warps=4,
                              **dependent_launch(ids.device))
    return out


__all__ = ["follow_step", "shifted", "suffix_scores", "unique_rows"]
