"""Typed wrapper of the one-pass attention of a decode step (kernels/jit/union.py): check, plan, launch.

`union_attention(...)` has the signature and semantics of `kernels.reference.union.union_attention` and never
synchronises with the host. Where the sparse kernels would split the keys over persistent workers (a decode step:
G * Lq <= kernels.sparse_ops.DECODE_MAX_M), the selection's keys, the new tokens and the follow rows are items of one
split-KV launch and one merge writes the layer's output: two launches where the sparse, follow and causal kernels
took four. Otherwise (a question's prefill: its grids fill the GPU on their own) it runs those three in turn.
`union_attention_batch(calls)`: several sequences' steps, those of one kind in one split and one merge launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from kernels import causal_ops, follow_ops, sparse_ops, tally_ops
from kernels.backend import TRITON
from kernels.checks import LOG2E, check_qkv
from kernels.jit.union import union_attn_fwd_kernel, union_merge_kernel
from kernels.launch import dependent_launch
from kernels.reference import union as reference
from kernels.reference.union import UnionCall, check_batch
from kernels.selection import FollowRows, Selection, StepTally
from kernels.tables import Keep, batch_tables

NEW_ITEMS_EXPECTED = 1  # items a row's new tokens take in a typical step (a question and an answer: < a chunk)
# Registers per thread of the split launch: the selection's loop alone needs 152 (D 128, 4 warps: Triton 3.6 for
# sm_90), the short items' code took the whole kernel to 226, so an SM held two workers instead of
# sparse_ops.DECODE_WORKERS_PER_SM = 3 (65536 / (3 * 128) = 170). Capped at 168, three fit (a few bytes spill).
MAX_REGISTERS = 168
# A heavier selection than the plan's cut on the device into one wave of longer items (kernels/jit/union.py
# fitted_plan). H200, 8B shape, 128K, 10%: DuoAttention's step 5.41 -> 5.05 ms, the others unchanged
# (engine/bench/README.md). A benchmark's switch (squeeze bench e2e --no-fit-items).
FIT_ITEMS = True


@dataclass
class _Call:
    """One union_attention call checked and planned: its tensors as the kernels read them, its partial buffers and
    the values its launches take (split, merge)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    q_pos: torch.Tensor
    follow_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # positions, order, fresh (dummies without)
    part_out: torch.Tensor
    part_lse: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    fresh: torch.Tensor | None
    tally_args: tuple[torch.Tensor, ...]  # kept, read, elements, scores, best (dummies without)
    scores: torch.Tensor | None
    cfg: sparse_ops.SparseAttentionConfig
    rows: int
    hkv: int
    workers: int
    spread: int
    num_keys: int
    k_start: int
    first: int
    indexed: int
    m_rows: int
    stride_order: int
    scale: float
    dense: bool
    has_order: bool
    n_elements: int

    @property
    def num_m(self) -> int:
        return self.q.shape[0] // self.rows * self.q.shape[1]

    @property
    def dense_len(self) -> int:
        return self.num_keys if self.dense else 0

    @property
    def follows(self) -> bool:
        return self.fresh is not None

    @property
    def merge_block_m(self) -> int:
        return min(self.cfg.merge_block_m, triton.next_power_of_2(self.num_m))

    @property
    def tallied(self) -> bool:
        return self.tally_args[0] is not self.lse  # (a call without a tally passes lse as every dummy)

    @property
    def n_units(self) -> int:
        return self.scores.shape[1] if self.scores is not None else 0

    @property
    def stride_scores(self) -> int:
        return self.scores.stride(0) if self.scores is not None else 0

    @property
    def stride_best(self) -> int:
        return self.tally_args[4].stride(0) if self.scores is not None else 0

    def split_pointers(self) -> tuple[torch.Tensor, ...]:
        """Row of SPLIT_POINTERS."""
        return (self.q, self.k, self.v, self.indptr, self.indices, self.k_new, self.v_new, self.q_pos,
                *self.follow_args, self.part_out, self.part_lse)

    def split_params(self) -> list[int]:
        """Row of SPLIT_PARAMS (the K/V head strides first: those a BATCHED launch takes as aligned)."""
        return [self.k.stride(0), self.v.stride(0), self.k_new.stride(0), self.v_new.stride(0), self.stride_order,
                self.cfg.chunk, self.k_start, self.k_new.shape[1], self.first, self.indexed, self.m_rows, self.spread,
                self.dense_len]

    def merge_pointers(self) -> tuple[torch.Tensor, ...]:
        """Row of MERGE_POINTERS."""
        return (self.part_out, self.part_lse, self.indptr, self.q_pos, self.out, self.lse, self.follow_args[2],
                *self.tally_args)

    def merge_params(self) -> list[int]:
        """Row of MERGE_PARAMS."""
        return [self.cfg.chunk, self.k_start, self.k_new.shape[1], self.m_rows, self.n_elements, self.n_units,
                self.stride_scores, self.stride_best, self.spread, self.dense_len, self.out.stride(0),
                self.out.stride(1)]

    def kind(self) -> tuple:
        """What calls launched together must share: shapes, dtypes, tiles, the constexprs and the strides that are
        kernel arguments (the rest differ per call: SPLIT_PARAMS, MERGE_PARAMS)."""
        cfg = self.cfg
        return (tuple(self.q.shape), self.q.dtype, self.k.dtype, self.indices.dtype, self.rows, self.hkv, self.dense,
                self.follows, self.has_order, self.tallied, self.scores is not None,
                cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.merge_block_i, self.merge_block_m,
                self.q.stride(), self.k.stride()[1:], self.v.stride()[1:], self.k_new.stride()[1:],
                self.v_new.stride()[1:], self.q_pos.stride(0), self.out.dtype, self.scale)


# Row b of a batched launch's tables (kernels/jit/union.py reads them by these positions)
SPLIT_POINTERS = ("q", "k", "v", "indptr", "indices", "k_new", "v_new", "q_pos", "positions", "order", "fresh",
                  "part_out", "part_lse")
SPLIT_PARAMS = ("stride_kh", "stride_vh", "stride_nkh", "stride_nvh", "stride_order", "chunk", "k_start", "n_new",
                "first", "indexed", "m_rows", "spread", "dense_len")
MERGE_POINTERS = ("part_out", "part_lse", "indptr", "q_pos", "out", "lse", "fresh", "kept", "read", "elements",
                  "scores", "best")
SPLIT_TILES = ("q", "k", "v", "k_new", "v_new", "part_out", "part_lse")  # the entries taken as aligned (ALIGNED)
MERGE_TILES = ("part_out", "part_lse", "out", "lse")
MERGE_PARAMS = ("chunk", "k_start", "n_new", "m_rows", "n_elements", "n_units", "stride_scores", "stride_best",
                "spread", "dense_len", "stride_oh", "stride_ol")


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
    share: int = 1,
    tiles: sparse_ops.DecodeTiles = sparse_ops.DecodeTiles(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """kernels.reference.union.union_attention's signature and semantics: share, the launches that run at once on
    streams of their own (a batched step's sequences), each planned for 1 / share of the GPU's workers (items share
    times longer: together they fill the GPU once, where each planned for all of it queues behind the others);
    tiles: the split launch's (sparse_ops.DecodeTiles: the defaults unless a benchmark sweeps them)."""
    if share < 1:
        raise ValueError(f"share must be at least 1, got {share}")
    call = _prepare(q, k, v, selection, scale, k_new, v_new, q_pos, k_start, follow, out, tally, tiles, share)
    if call is None:
        return reference.union_in_turn(TRITON, q, k, v, selection, scale, k_new, v_new, q_pos, k_start, follow, out,
                                       tally)
    _launch([call])
    return call.out, call.lse, call.fresh.view(torch.bool) if call.fresh is not None else None


def union_attention_batch(calls: Sequence[UnionCall], keep: Keep = None,
                          tiles: sparse_ops.DecodeTiles = sparse_ops.DecodeTiles(),
                          ) -> list[torch.Tensor | None]:
    """Each call's union_attention (written into its out, its tally added) for several sequences over contexts of
    their own (a batched decode step): calls of one kind (_Call.kind: the model's shapes and dtypes, a selection or
    every key, follow rows or none, a tally or none) share one split launch and one merge launch, the GPU's workers
    shared out between them, each sequence's tensors and values read from a row of a table (SPLIT_POINTERS, ...);
    a call of another kind, or one union_attention would not take, runs on its own. keep: where the tables' host
    copies go, to live as long as a CUDA graph that captured their upload (None: the caller keeps nothing, an eager
    call). Returns each call's fresh follow rows (union_attention's third result)."""
    check_batch(calls)
    share = max(1, len(calls))
    prepared = [_prepare(*call.args(), tiles, share) for call in calls]
    fresh: list[torch.Tensor | None] = [None] * len(calls)
    groups: dict[tuple, list[int]] = {}
    for i, (call, got) in enumerate(zip(calls, prepared)):
        if got is None:  # as union_attention runs such a call
            fresh[i] = reference.union_in_turn(TRITON, *call.args())[2]
        else:
            groups.setdefault(got.kind(), []).append(i)
    for members in groups.values():
        _launch([prepared[i] for i in members], keep)
        for i in members:
            fresh[i] = prepared[i].fresh.view(torch.bool) if prepared[i].fresh is not None else None
    return fresh


def _prepare(q, k, v, selection, scale, k_new, v_new, q_pos, k_start, follow, out, tally,
             tiles: sparse_ops.DecodeTiles, share: int) -> _Call | None:
    """A call checked and planned for 1 / share of the GPU's workers, its buffers allocated; None where the kernels
    do not take it (a question's prefill, an odd head dimension, no keys: the ops in turn)."""
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
        return None
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
    sms = max(1, sparse_ops.num_sms(q.device) // share)
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
    tally_args, scores = _tally_args(tally, selection, lse)
    return _Call(q, k, v, indptr, indices, k_new, v_new, q_pos, follow_args, part_out, part_lse, out, lse, fresh,
                 tally_args, scores, cfg, rows, hkv, workers, max(1, workers - rows * extra), num_keys, int(k_start),
                 first, indexed, m_rows, stride_order, scale, selection is None, order is not None,
                 tally.elements.numel() if tally is not None else 0)


def _launch(calls: list[_Call], keep: Keep = None) -> None:
    """The split launch and the merge launch of calls of one kind (_Call.kind): one call as it is, several
    BATCHED, their tensors and values in tables."""
    c = calls[0]
    batched = len(calls) > 1
    hq, lq, d = c.q.shape
    workers = max(x.workers for x in calls)
    block_r = max(2, triton.next_power_of_2(c.rows))
    m_rows = max(x.m_rows for x in calls)
    constexprs = dict(HEAD_DIM=d, BLOCK_M=c.cfg.block_m, BLOCK_N=c.cfg.block_n, BLOCK_R=block_r,
                      BLOCK_K=max(16, triton.next_power_of_2(max(m_rows, 1))), EXACT_FP32=c.q.dtype == torch.float32,
                      DENSE=c.dense, FOLLOW=c.follows, HAS_ORDER=c.has_order, PROBES=follow_ops.PROBES,
                      ROUNDS=max(follow_ops.search_rounds(x.num_keys) for x in calls), FIT=FIT_ITEMS)
    batch = batch_tables(calls, _Call.split_pointers, _Call.split_params, (SPLIT_POINTERS, SPLIT_PARAMS), c.q.device,
                         keep, hinted=lambda x: x.split_params()[:4], int32=False, tiles=SPLIT_TILES) if batched else {}
    union_attn_fwd_kernel[(triton.cdiv(c.num_m, c.cfg.block_m), workers, len(calls))](
        c.q, c.k, c.v, c.indptr, c.indices, c.k_new, c.v_new, c.q_pos, *c.follow_args, c.part_out, c.part_lse,
        *c.q.stride(), *c.k.stride(), *c.v.stride(), *c.k_new.stride(), *c.v_new.stride(), c.q_pos.stride(0),
        c.stride_order, c.rows, c.hkv, hq // c.rows, lq, c.cfg.chunk, c.scale * LOG2E, c.k_start, c.k_new.shape[1],
        c.first, c.indexed, c.m_rows, c.spread, dense_len=c.dense_len, **constexprs,
        num_warps=c.cfg.num_warps, num_stages=c.cfg.num_stages, **_register_cap(c.q.device),
        **dependent_launch(c.q.device), **batch,
    )
    block_d = min(d, sparse_ops.MERGE_BLOCK_D)
    batch = batch_tables(calls, _Call.merge_pointers, _Call.merge_params, (MERGE_POINTERS, MERGE_PARAMS), c.q.device,
                         keep, hinted=lambda x: x.out.stride()[:2], int32=False, tiles=MERGE_TILES) if batched else {}
    union_merge_kernel[(triton.cdiv(c.num_m, c.merge_block_m), c.rows * len(calls), d // block_d)](
        c.part_out, c.part_lse, c.indptr, c.q_pos, c.out, c.lse, c.follow_args[2], *c.tally_args,
        c.rows, hq // c.rows, lq, c.cfg.chunk, c.k_start, c.k_new.shape[1], c.q_pos.stride(0), c.out.stride(0),
        c.out.stride(1), c.m_rows, c.n_elements, c.n_units, c.stride_scores, c.stride_best, c.spread,
        HEAD_DIM=d, BLOCK_M=c.merge_block_m, BLOCK_I=c.cfg.merge_block_i, BLOCK_D=block_d, BLOCK_R=block_r,
        DENSE=c.dense, FOLLOW=c.follows, TALLY=c.tallied, HAS_SCORES=c.scores is not None,
        dense_len=c.dense_len, FIT=FIT_ITEMS, BLOCK_N=c.cfg.block_n, num_warps=sparse_ops.MERGE_WARPS,
        **dependent_launch(c.q.device), **batch,
    )


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


__all__ = ["UnionCall", "check_batch", "union_attention", "union_attention_batch", "union_in_turn"]
