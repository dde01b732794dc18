"""Reference of a decode step's whole attention (kernels/jit/union.py): a query over the union of the fixed
context's keys its row selects, the follow rows the selection does not hold and the new tokens its position sees,
written into the layer's output. `union_in_turn` composes it from a backend's sparse, follow and causal ops (the
reference's own, and what the GPU wrapper runs where its one-pass kernel does not apply)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.backend import REFERENCE, Backend
from kernels.selection import FollowRows, Selection, StepTally


@dataclass(frozen=True)
class UnionCall:
    """One sequence's union_attention arguments in a batched decode step (union_attention_batch); `out` is where its
    output goes (required there)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    selection: Selection | None
    scale: float
    k_new: torch.Tensor
    v_new: torch.Tensor
    q_pos: torch.Tensor
    k_start: int
    follow: FollowRows | None = None
    out: torch.Tensor | None = None
    tally: StepTally | None = None

    def args(self) -> tuple:
        """union_attention's arguments, in its order."""
        return (self.q, self.k, self.v, self.selection, self.scale, self.k_new, self.v_new, self.q_pos, self.k_start,
                self.follow, self.out, self.tally)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q: [Hq, Lq, D]; k, v: [Hkv, N, D] the fixed context; selection: its keys each row reads (rows Hq or Hkv), or
    None for every key; k_new, v_new: [Hkv, n, D] the new tokens, slot j at position k_start + j, seen by query i
    iff k_start + j <= q_pos[i] (slots past the newest query's position are never read); follow: the follow rows,
    added to a selection (ignored without one or when it holds no position).
    Returns out [Hq, Lq, D] (written into `out`, any float dtype and strides, when given; float32 otherwise), lse
    [Hq, Lq] float32 (natural log) and fresh [R, M] bool (the follow rows each selection row read beyond its own
    keys), or None without follow rows.
    tally: the step's statistics to add (kernels.selection.StepTally; a selection's rows only), or None.
    share: how many such calls run at once on a GPU (its kernels plan for their share of the workers); no effect here.
    """
    return union_in_turn(REFERENCE, q, k, v, selection, scale, k_new, v_new, q_pos, k_start, follow, out, tally)


def union_attention_batch(calls: Sequence[UnionCall], keep: list | None = None) -> list[torch.Tensor | None]:
    """Each call's union_attention, written into its out (several sequences' decode steps, each over its own
    context). keep: the GPU kernels' (kernels/union_ops.py). Returns each call's fresh follow rows."""
    check_batch(calls)
    return [union_attention(*call.args())[2] for call in calls]


def check_batch(calls: Sequence[UnionCall]) -> None:
    """Every call of a batch gives its out."""
    if any(call.out is None for call in calls):
        raise ValueError("each call of a batch gives the tensor its output goes to (out)")


def union_in_turn(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: Selection | None,
                  scale: float, k_new: torch.Tensor, v_new: torch.Tensor, q_pos: torch.Tensor, k_start: int,
                  follow: FollowRows | None = None, out: torch.Tensor | None = None,
                  tally: StepTally | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`union_attention` as `backend`'s ops one after another: the sparse (or dense) attention over the fixed
    context, the follow part merged into it, the new tokens' causal part merged into that and written to `out`;
    then the step's statistics added (backend's tally_step)."""
    if tally is not None and selection is None:
        raise ValueError("a step's tally counts a selection's keys: every key has none")
    sparse = backend.kernel("sparse")
    if selection is None:
        fixed = sparse.attention_with_lse(q, k, v, scale)
    else:
        fixed = sparse.sparse_attention(q, k, v, selection, scale)
    fresh = None
    if selection is not None and follow is not None and follow.positions.numel():
        *fixed, fresh = backend.kernel("follow").follow_attention(q, k, v, selection, follow.positions, follow.first,
                                                                  follow.indexed, follow.order, scale, prior=fixed)
    out, lse = backend.kernel("causal").causal_attention(q, k_new, v_new, scale, q_pos, k_start, None, tuple(fixed),
                                                         out)
    if tally is not None:
        backend.kernel("tally").tally_step(selection.indptr, tally.elements, tally.kept, tally.read, fresh,
                                           tally.scores, tally.best)
    return out, lse, fresh
