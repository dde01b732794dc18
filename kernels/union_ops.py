"""Typed wrapper of the one-pass attention of a decode step (kernels/jit/union.py): check, plan, launch.

`union_attention(...)` has the signature and semantics of `kernels.reference.union.union_attention` and never
synchronises with the host. Where the sparse kernels would split the keys over persistent workers (a decode step:
G * Lq <= kernels.sparse_ops.DECODE_MAX_M), the selection's keys, the new tokens and the follow rows are items of one
split-KV launch and one merge writes the layer's output: two launches where the sparse, follow and causal kernels
took four. Otherwise (a question's prefill: its grids fill the GPU on their own) it runs those three in turn.
"""

from __future__ import annotations

import torch
import triton

from kernels import causal_ops, follow_ops, sparse_ops, tally_ops
from kernels.backend import TRITON
from kernels.checks import LOG2E, check_qkv
from kernels.jit.union import union_attn_fwd_kernel, union_merge_kernel
from kernels.launch import dependent_launch
from kernels.reference import union as reference
from kernels.selection import FollowRows, Selection, StepTally

NEW_ITEMS_EXPECTED = 1  # items a row's new tokens take in a typical step (a question and an answer: < a chunk)
# Registers per thread of the split launch: the selection's loop alone needs 152 (D 128, 4 warps: Triton 3.6 for
# sm_90), the short items' code took the whole kernel to 226, so an SM held two workers instead of
# sparse_ops.DECODE_WORKERS_PER_SM = 3 (65536 / (3 * 128) = 170). Capped at 168, three fit (a few bytes spill).
MAX_REGISTERS = 168
# A heavier selection than the plan's cut on the device into one wave of longer items (kernels/jit/union.py
# fitted_plan). H200, 8B shape, 128K, 10%: DuoAttention's step 5.41 -> 5.05 ms, the others unchanged
# (engine/bench/README.md). A benchmark's switch (squeeze bench e2e --no-fit-items).
FIT_ITEMS = True


def union_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection | None,
    scale: float,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: int,
    follow: FollowRows | None = None,
    out: torch.Tensor | None = None,
    tally: StepTally | None = None,
    tiles: sparse_ops.DecodeTiles = sparse_ops.DecodeTiles(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """kernels.reference.union.union_attention's signature and semantics; tiles: the split launch's
    (sparse_ops.DecodeTiles: the defaults unless a benchmark sweeps them)."""
    check_qkv(q, k_new, v_new)
    hq, lq, d = q.shape
    hkv, n_new = k_new.shape[:2]
    rows = hkv if selection is None else selection.rows
    with_follow = selection is not None and follow is not None and follow.positions.numel() > 0
    num_m = hq // rows * lq
    if out is not None and (out.shape != (hq, lq, d) or out.stride(-1) != 1):
        raise ValueError(f"out must be [{hq}, {lq}, {d}] with a unit stride in D; got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    if num_m > sparse_ops.DECODE_MAX_M or d & (d - 1) or d < 16 or k.shape[1] == 0 or n_new == 0:
        return reference.union_in_turn(TRITON, q, k, v, selection, scale, k_new, v_new, q_pos, k_start, follow, out,
                                       tally)
    if selection is None:
        check_qkv(q, k, v)
        indptr = indices = k  # DENSE: neither is read
        capacity, num_keys = hkv * k.shape[1], k.shape[1]
    else:
        sparse_ops.check_selection(q, k, v, selection)
        indptr, indices = selection.indptr.contiguous(), selection.indices.contiguous()
        capacity, num_keys = indices.numel(), selection.num_keys
    if tuple(q_pos.shape) != (lq,) or q_pos.dtype not in causal_ops.POSITION_DTYPES or q_pos.device != q.device:
        raise ValueError(f"q_pos must be int32/int64 [{lq}] on {q.device}; got {q_pos.dtype} {tuple(q_pos.shape)} "
                         f"on {q_pos.device}")
    q = q.to(k.dtype)
    k_new, v_new = k_new.to(k.dtype), v_new.to(k.dtype)  # no-ops when they match
    if with_follow:  # the follow kernel reads rows of unit stride in D
        k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    extra = NEW_ITEMS_EXPECTED + int(with_follow)
    sms = sparse_ops.num_sms(q.device)
    cfg = sparse_ops.plan(num_m, rows, d, capacity, num_keys, sms, k.element_size(), dense=selection is None,
                          extra_items=extra, tiles=tiles)
    items = sparse_ops.max_items(capacity, rows, num_keys, cfg.chunk) + rows * (triton.cdiv(n_new, cfg.chunk)
                                                                                + int(with_follow))
    workers = max(1, min(items, tiles.workers_per_sm * sms))  # the plan's, counting these items too
    part_out = torch.empty(items, num_m, d, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(items, num_m, device=q.device, dtype=torch.float32)
    if out is None:
        out = torch.empty(hq, lq, d, device=q.device, dtype=torch.float32)
    lse = torch.empty(hq, lq, device=q.device, dtype=torch.float32)
    if with_follow:
        positions = follow.positions.to(torch.int64).contiguous()
        m_rows = positions.numel()
        fresh = torch.empty(rows, m_rows, device=q.device, dtype=torch.int8)  # every entry written
        order = follow.order
        if order is not None and (order.shape != (hkv, follow.indexed) or order.dtype != torch.int32):
            raise ValueError(f"order must be int32 [{hkv}, {follow.indexed}], got {order.dtype} {tuple(order.shape)}")
        follow_args = (positions, order if order is not None else positions, fresh)
        first, indexed, stride_order = follow.first, follow.indexed, order.stride(0) if order is not None else 0
    else:
        m_rows, fresh, order = 0, None, None
        follow_args = tuple(torch.empty(1, device=q.device, dtype=t)  # not read: pos, order, fresh
                            for t in (torch.int64, torch.int32, torch.int8))
        first = indexed = stride_order = 0
    block_r = max(2, triton.next_power_of_2(rows))
    dense_len = num_keys if selection is None else 0
    spread = max(1, workers - rows * extra)  # the workers the selection's items may take
    union_attn_fwd_kernel[(triton.cdiv(num_m, cfg.block_m), workers)](
        q, k, v, indptr, indices, k_new, v_new, q_pos, *follow_args, part_out, part_lse,
        *q.stride(), *k.stride(), *v.stride(), *k_new.stride(), *v_new.stride(), q_pos.stride(0), stride_order,
        rows, hkv, hq // rows, lq, cfg.chunk, scale * LOG2E, int(k_start), n_new, first, indexed, m_rows,
        spread,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r,
        BLOCK_K=max(16, triton.next_power_of_2(max(m_rows, 1))), EXACT_FP32=q.dtype == torch.float32,
        DENSE=selection is None, FOLLOW=with_follow, HAS_ORDER=order is not None, PROBES=follow_ops.PROBES,
        ROUNDS=follow_ops.search_rounds(num_keys), dense_len=dense_len, FIT=FIT_ITEMS,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_register_cap(q.device), **dependent_launch(q.device),
    )
    block_d = min(d, sparse_ops.MERGE_BLOCK_D)
    merge_block_m = min(cfg.merge_block_m, triton.next_power_of_2(num_m))
    tally_args, scores = _tally_args(tally, selection, lse)
    union_merge_kernel[(triton.cdiv(num_m, merge_block_m), rows, d // block_d)](
        part_out, part_lse, indptr, q_pos, out, lse, fresh if fresh is not None else follow_args[2], *tally_args,
        rows, hq // rows, lq, cfg.chunk, int(k_start), n_new, q_pos.stride(0), out.stride(0), out.stride(1),
        m_rows, tally.elements.numel() if tally is not None else 0, scores.shape[1] if scores is not None else 0,
        scores.stride(0) if scores is not None else 0, tally.best.stride(0) if scores is not None else 0,
        spread,
        HEAD_DIM=d, BLOCK_M=merge_block_m, BLOCK_I=cfg.merge_block_i, BLOCK_D=block_d, BLOCK_R=block_r,
        DENSE=selection is None, FOLLOW=with_follow, TALLY=tally is not None, HAS_SCORES=scores is not None,
        dense_len=dense_len, FIT=FIT_ITEMS, BLOCK_N=cfg.block_n, num_warps=sparse_ops.MERGE_WARPS,
        **dependent_launch(q.device),
    )
    return out, lse, fresh.view(torch.bool) if fresh is not None else None


def _tally_args(tally: StepTally | None, selection: Selection | None,
                dummy: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """The merge kernel's kept, read, elements, scores and best (dummies without a tally), checked as the tally
    kernel's (tally_ops.check_sums), and the scores it maxes (None: none)."""
    if tally is None:
        return (dummy,) * 5, None
    if selection is None:
        raise ValueError("a step's tally counts a selection's keys: every key has none")
    elements, scores = tally.elements.contiguous(), tally.scores
    tally_ops.check_sums(selection.rows, elements, tally.kept, tally.read, scores, tally.best)
    if scores is None:
        return (tally.kept, tally.read, elements, dummy, dummy), None
    return (tally.kept, tally.read, elements, scores, tally.best), scores


def _register_cap(device: torch.device) -> dict:
    """The launch option that caps the split kernel's registers (MAX_REGISTERS; none in the interpreter or at 0)."""
    return {"maxnreg": MAX_REGISTERS} if MAX_REGISTERS and device.type == "cuda" else {}


union_in_turn = reference.union_in_turn  # the same ops one after another (any backend's)


__all__ = ["union_attention", "union_in_turn"]
