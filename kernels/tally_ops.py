"""Typed wrapper of the statistics kernel (kernels/jit/tally.py): one launch per lookup where the reference's
counts, sums, adds and maximum are eight to ten (each a kernel of a replayed decode step, per global layer).

`tally_step` has the signature and semantics of `kernels.reference.tally.tally_step`."""

from __future__ import annotations

import torch
import triton

from kernels.jit.tally import tally_step_kernel
from kernels.launch import dependent_launch

BLOCK_U = 1024  # units per program of the running max
BLOCK_M = 64  # follow rows per pass of the count
BLOCK_E = 128  # index elements per pass of the sum


def check_sums(rows: int, elements: torch.Tensor, kept: torch.Tensor, read: torch.Tensor,
               scores: torch.Tensor | None, best: torch.Tensor | None) -> None:
    """The sums a step's statistics are added into, as the kernels read them (tally_step_kernel, and the union's
    merge: kernels/union_ops.py): ValueError otherwise."""
    if (kept.dtype != torch.float32 or read.dtype != torch.float32 or kept.numel() != rows or kept.stride(-1) != 1
            or read.numel() != 1 or not elements.is_contiguous()):
        raise ValueError(f"kept must be [{rows}] and read [1] fp32 with unit strides, elements contiguous")
    if scores is not None and (best is None or best.dtype != torch.float32 or best.shape != scores.shape
                               or scores.shape[0] != rows or best.stride(-1) != 1 or scores.stride(-1) != 1):
        raise ValueError(f"best must be an fp32 tensor of the scores' shape [{rows}, U], both with a unit stride in "
                         "the units")


def tally_step(indptr: torch.Tensor, elements: torch.Tensor, kept: torch.Tensor, read: torch.Tensor,
               fresh: torch.Tensor | None = None, scores: torch.Tensor | None = None,
               best: torch.Tensor | None = None) -> None:
    rows = indptr.numel() - 1
    check_sums(rows, elements, kept, read, scores, best)
    if fresh is not None:
        if fresh.shape[0] != rows:
            raise ValueError(f"fresh must have {rows} rows, got {tuple(fresh.shape)}")
        fresh = fresh.view(torch.int8) if fresh.dtype == torch.bool and fresh.stride(-1) == 1 else \
            fresh.contiguous().to(torch.int8)
    units = scores.shape[1] if scores is not None else 0
    grid = (max(1, triton.cdiv(units, BLOCK_U)), rows if scores is not None else 1)
    tally_step_kernel[grid](
        indptr, elements, kept, read, fresh if fresh is not None else indptr,
        scores if scores is not None else kept, best if best is not None else kept,
        elements.numel(), fresh.shape[1] if fresh is not None else 0, fresh.stride(0) if fresh is not None else 0,
        units, scores.stride(0) if scores is not None else 0, best.stride(0) if best is not None else 0,
        ROWS=rows, BLOCK_E=BLOCK_E, BLOCK_M=BLOCK_M, BLOCK_U=BLOCK_U,
        HAS_FRESH=fresh is not None, HAS_SCORES=scores is not None, num_warps=4,
        **dependent_launch(indptr.device),
    )


__all__ = ["check_sums", "tally_step"]
