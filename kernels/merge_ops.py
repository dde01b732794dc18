"""Typed wrapper of the merge kernel (kernels/jit/merge.py): two partial attentions -> one, written in place.

`merge_attention(parts, out=None)` has the signature and semantics of `kernels.reference.merge.merge_attention`; with two
parts it is one kernel launch (the reference's stack, log-sum-exp, weights and sums are a dozen), and it can write
the result straight into the caller's tensor in the caller's dtype and layout (the engine's attention output,
[Lq, Hq, D] in the model's dtype, seen as [Hq, Lq, D]). Other part counts go to the reference.
"""

from __future__ import annotations

import torch
import triton

from kernels.jit.merge import merge_two_kernel
from kernels.launch import dependent_launch
from kernels.reference import merge as reference

BLOCK_ROWS = 16  # (head, token) rows per program; a decode step of 32 heads is 2 programs


def _unit_d(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]],
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """parts: [(out [H, L, D] fp32, lse [H, L] fp32)] over disjoint key sets; out: optional [H, L, D] destination
    (any float dtype, any strides with a unit stride in D). Returns (out, lse [H, L] fp32) over the union."""
    if len(parts) != 2:
        return reference.merge_attention(parts, out)
    (out_a, lse_a), (out_b, lse_b) = parts
    h, lq, d = out_a.shape
    if out_b.shape != out_a.shape or lse_a.shape != (h, lq) or lse_b.shape != (h, lq):
        raise ValueError(f"parts disagree: {tuple(out_a.shape)} {tuple(lse_a.shape)}, {tuple(out_b.shape)} "
                         f"{tuple(lse_b.shape)}")
    if d & (d - 1):
        return reference.merge_attention(parts, out)
    if out is None:
        out = torch.empty(h, lq, d, device=out_a.device, dtype=torch.float32)
    elif out.shape != out_a.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be [H, L, D] = {tuple(out_a.shape)} with a unit stride in D; got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    out_a, out_b = _unit_d(out_a), _unit_d(out_b)
    lse_a, lse_b = lse_a.float().contiguous(), lse_b.float().contiguous()
    lse = torch.empty(h, lq, device=out_a.device, dtype=torch.float32)
    n = h * lq
    if n:
        merge_two_kernel[(triton.cdiv(n, BLOCK_ROWS),)](
            out_a, lse_a, out_b, lse_b, out, lse, n, lq,
            out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_R=BLOCK_ROWS, num_warps=4, **dependent_launch(out.device),
        )
    return out, lse


__all__ = ["merge_attention"]
