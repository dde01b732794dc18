"""Typed wrapper of the follow-part kernel (kernels/jit/follow.py): check, launch.

`follow_attention(...)` has the signature and semantics of `kernels.reference.follow.follow_attention` and never
synchronises with the host: one launch per call, a grid of (selection rows, query blocks); a decode step's is one
program per row. The follow rows' mapping to the layer's K/V (engine.attention.follow's token positions through the layer's
layout), the test against the selection (a 16-ary search in each row's sorted indices) and, given a `prior` (the
selection's own attention), the merge with it happen in the kernel, which then writes over the prior's tensors.
"""

from __future__ import annotations

import torch
import triton

from kernels.checks import LOG2E, check_qkv
from kernels.jit.follow import follow_attn_kernel
from kernels.launch import dependent_launch
from kernels.reference import follow as reference
from kernels.selection import Selection

BLOCK_M = 16  # queries per program (tl.dot needs 16): a decode step's group of query heads fits in one
PREFILL_BLOCK_M = 64
PROBES = 16  # entries a search round reads per follow row (the round cuts the range 16-fold)


def search_rounds(n: int) -> int:
    """Rounds of PROBES-ary search that narrow a row of up to n entries to one place."""
    rounds, span = 1, max(n, 1)
    while span > 1:
        span = -(-span // PROBES)
        rounds += 1
    return rounds


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
    check_qkv(q, k, v)
    hq, lq, d = q.shape
    hkv, n = k.shape[:2]
    r = selection.rows
    if r not in (hq, hkv) or positions.dim() != 1:
        raise ValueError(f"selection rows must be Hq = {hq} or Hkv = {hkv} and positions [M]; got {r} rows, "
                         f"positions {tuple(positions.shape)}")
    if order is not None and (order.shape != (hkv, indexed) or order.dtype != torch.int32):
        raise ValueError(f"order must be int32 [{hkv}, {indexed}], got {order.dtype} {tuple(order.shape)}")
    if prior is not None and (prior[0].shape != (hq, lq, d) or prior[1].shape != (hq, lq)
                              or prior[0].dtype != torch.float32 or prior[1].dtype != torch.float32):
        raise ValueError(f"prior must be float32 out [{hq}, {lq}, {d}] and lse [{hq}, {lq}]; got "
                         f"{prior[0].dtype} {tuple(prior[0].shape)}, {prior[1].dtype} {tuple(prior[1].shape)}")
    if d & (d - 1) or d < 16:
        return reference.follow_attention(q, k, v, selection, positions, first, indexed, order, scale, prior)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    m = positions.numel()
    if prior is None:
        out = torch.zeros(hq, lq, d, device=q.device, dtype=torch.float32)
        lse = torch.full((hq, lq), float("-inf"), device=q.device, dtype=torch.float32)
    else:  # merged in place: the kernel reads each query's prior and writes the union's over it
        out = prior[0] if prior[0].stride(-1) == 1 else prior[0].contiguous()
        lse = prior[1].contiguous()
    if m == 0 or lq == 0:
        return out, lse, torch.zeros(r, m, device=q.device, dtype=torch.bool)
    fresh = torch.empty(r, m, device=q.device, dtype=torch.int8)  # the kernel writes every entry
    heads_per_row = hq // r
    n_q = heads_per_row * lq
    block_m = BLOCK_M if n_q <= BLOCK_M else PREFILL_BLOCK_M
    block_k = max(16, triton.next_power_of_2(m))
    order_arg = order if order is not None else positions  # not read without HAS_ORDER
    follow_attn_kernel[(r, triton.cdiv(n_q, block_m))](
        q, k, v, selection.indptr, selection.indices, positions.to(torch.int64).contiguous(), order_arg,
        out, lse, fresh,
        scale * LOG2E, first, indexed, lq, n_q, m, r, hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        order.stride(0) if order is not None else 0,
        HEADS_PER_ROW=heads_per_row, HAS_ORDER=order is not None, HAS_PRIOR=prior is not None, PROBES=PROBES,
        ROUNDS=search_rounds(n), BLOCK_M=block_m, BLOCK_K=block_k, HEAD_DIM=d, num_warps=4,
        **dependent_launch(q.device),
    )
    return out, lse, fresh.view(torch.bool)


follow_rows = reference.follow_rows  # the rows' mapping (the kernel does it itself; the family's view of it)

__all__ = ["follow_attention", "follow_rows"]
