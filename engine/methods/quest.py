"""Quest (Tang et al., 2024): pages of consecutive keys, each summarised by the element-wise minimum and maximum of
its keys; a query's page score is the upper bound sum_i max(q_i min_i, q_i max_i) of q . k over the page; a step
reads the top pages up to the plan's budget.

GQA: group "kv" (default) sums the bounds of a KV head's query heads and keeps one set of pages per KV head (each
page read once per group, as squeeze does); "query" keeps one set per query head (the union is what is read).
Prefill (Quest is published for decode): a question's page score is max(the bound of its tokens' mean, the bound
of its last token), summed over the row's heads, and the same number of pages is kept as at decode, so the
budget holds in both phases (kernels/jit/pages.py computes both terms in one pass over the bounds).
Bounds keep the keys' dtype; "int8" stores one byte each (rounded outwards, per KV head and dim over the context's
range: still an upper bound, half the bytes a step reads for its scores, but looser).
Pages are whole: a last partial page of the indexed keys is read at every step, like the dense tail, so that
every row reads the same number of keys (the selection's offsets follow from the shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.attention.budget import HELD_ROUNDS, byte_share, exact_room
from engine.attention.method import (
    LayerIndex,
    LayerKeys,
    Lookup,
    Method,
    MethodSettings,
    StepPlan,
    Tensors,
    check_budget,
    group_rows,
)
from kernels.backend import Backend
from kernels.reference.pages import quantize_bounds
from kernels.selection import FollowRows, rows_held

GROUPS = ("kv", "query")
BOUNDS = ("exact", "int8")


@dataclass(frozen=True)
class QuestSettings(MethodSettings):
    """page_size: consecutive keys per page (Quest: 16); group: "kv" or "query" (see the module docstring);
    bounds: "int8" (default: one byte per bound, rounded outwards: kernels.reference.pages.quantize_bounds; half
    the bytes a step reads for its page scores with bf16 keys, a quarter with float32 ones, a looser bound, and a
    budget leaves the bytes saved to pages) or "exact" (the keys' own dtype, as the paper)."""

    page_size: int = 16
    group: str = "kv"
    bounds: str = "int8"

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {self.group!r}")
        if self.bounds not in BOUNDS:
            raise ValueError(f"bounds must be one of {BOUNDS}, got {self.bounds!r}")


@dataclass(frozen=True)
class PagePlan(StepPlan):
    """A top-K turn: each step reads the best `keys` fraction of the pages (at least one), in both phases (the
    same pages read the same bytes in both); room: as ThresholdPlan's (engine.attention.budget.exact_room: on the
    CPU each lookup keeps the pages that read it, the step's follow rows counted)."""

    keys: float = 1.0
    room: tuple[float, float] | None = None

    def describe(self) -> str:
        if self.room is not None:  # (a GPU's lookups keep the top share: exact_room)
            return (f"its best pages up to {self.room[1]:.1%} of the K/V bytes in the question's lookups, "
                    f"{self.room[0]:.1%} in the answer's (top {self.keys:.1%} of the pages on a GPU)")
        return f"top {self.keys:.1%} of the pages"

    def pages(self, total: int) -> int:
        """Pages a step keeps out of `total` (a static shape: no host synchronisation)."""
        return 0 if total == 0 else max(1, min(total, round(self.keys * total)))


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys: [Hkv, L, D] -> (min [Hkv, P, D], max [Hkv, P, D]), P = ceil(L / page_size); the last page may be
    shorter (its bounds cover its own keys only)."""
    hkv, length, d = keys.shape
    pages = -(-length // page_size)
    pad = pages * page_size - length
    lo = F.pad(keys, (0, 0, 0, pad), value=float("inf")).view(hkv, pages, page_size, d).amin(dim=2)
    hi = F.pad(keys, (0, 0, 0, pad), value=float("-inf")).view(hkv, pages, page_size, d).amax(dim=2)
    return lo, hi


def room_pages(cut: tuple, layer: LayerIndex, q: torch.Tensor, pages: int, page: int, hkv: int,
               held: float = 0.0) -> int:
    """The pages each KV head keeps to read the room of cut = (room, keys read besides over the heads:
    engine.attention.budget.exact_room) beside its bounds and the keys past its full pages (the dense rows, a last
    partial page), `held` of those keys read besides being inside what it reads anyway (per KV head: the follow rows
    its pages hold, held_in_pages): the nearest whole number, at least one. On the CPU only (it reads the follow
    rows' count)."""
    room, besides = cut
    rest = layer.num_keys - pages * page
    keys = room * layer.num_keys - bound_elements(layer, q) / (2 * q.shape[2]) - rest - float(besides) / hkv + held
    return max(1, min(pages, round(keys / page)))


def held_in_pages(scores: torch.Tensor, k: int, follow: FollowRows, page: int) -> float:
    """The step's indexed follow rows that each KV head reads anyway, in its k best pages (scores [Hkv, P], as
    select_pages keeps them) or past its full pages, averaged over the heads: rows its count took out but does not
    read twice. Rows lie at their place in the layout (follow.order) or as stored."""
    hkv, pages = scores.shape
    # units: the full pages, then every key past them (read at every step)
    bounds = torch.cat([torch.arange(pages + 1, device=scores.device) * page,
                        torch.tensor([max(follow.indexed, pages * page)], device=scores.device)])
    held = rows_held(follow.positions, follow.first, follow.first + follow.indexed, follow.order,
                     bounds.expand(hkv, -1))  # [Hkv, P + 1]
    read = torch.zeros(hkv, pages + 1, dtype=torch.bool, device=scores.device)
    read[:, pages] = True
    read[:, :pages].scatter_(1, torch.topk(scores, k, dim=1, sorted=False).indices, True)
    return float((held * read).sum()) / hkv


def bound_elements(layer: LayerIndex, q: torch.Tensor) -> float:
    """What a lookup reads of one KV head's index: every page's two bounds (and, for one-byte codes, their offsets
    and steps), in elements of the keys' dtype: exact bounds have it; codes are counted against q's, which is the
    keys' dtype in the engine."""
    lo = layer["page_min"]
    pages, d = lo.shape[1:]
    quant = "bound_offset" in layer
    key_size = q.element_size() if quant else lo.element_size()
    return (pages * 2 * d * lo.element_size() + (2 * d * 4 if quant else 0)) / key_size


class QuestPolicy(Method):
    name: ClassVar[str] = "quest"
    Settings: ClassVar[type] = QuestSettings
    unit: ClassVar[str] = "page"

    def build(self, layer: LayerKeys, required: dict[str, Tensors], prepared: Tensors) -> Tensors:
        """The bounds of the full pages of the indexed keys (a last partial page is read at every step, as the
        dense tail is: every row then reads the same number of keys)."""
        page = self.settings.page_size
        full = layer.keys.shape[1] // page * page
        lo, hi = page_bounds(layer.keys[:, :full], page)
        if self.settings.bounds == "int8":
            return quantize_bounds(lo, hi)  # uint8 codes [Hkv, P, D], offset and step [Hkv, D]
        return {"page_min": lo, "page_max": hi}  # [Hkv, P, D] each

    def calibrate(self, layers, scale: float) -> Tensors:
        return {}  # top-K: a key fraction is a number of pages (the engine measures what the pages and bounds read)

    def plan_keys(self, calibration: Tensors, budget: float, decode_keys: float, prefill_keys: float) -> PagePlan:
        return PagePlan(budget=check_budget(budget), keys=check_budget(decode_keys))

    def lookup(self, q: torch.Tensor, layer: LayerIndex, plan: PagePlan, scale: float, backend: Backend,
               positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               follow: FollowRows | None = None) -> Lookup:
        """Page scores (one kernel), then the top pages and their keys (one kernel: k is a static shape, and every
        row reads the same number of keys)."""
        lo, hi = layer["page_min"], layer["page_max"]
        hkv, pages, d = lo.shape
        page = self.settings.page_size
        rows = group_rows(self.settings.group, q.shape[0], hkv)
        kernel = backend.kernel("pages")
        quant = "bound_offset" in layer
        offset, step = (layer["bound_offset"], layer["bound_step"]) if quant else (None, None)
        scores = kernel.page_scores(q, lo, hi, rows, offset, step, valid)  # [rows, P]
        cut = exact_room(plan, q, follow, hkv) if rows == hkv else None
        k = plan.pages(pages) if cut is None else room_pages(cut, layer, q, pages, page, hkv)
        if cut is not None and follow is not None and pages:  # the follow rows its pages hold are read once
            for _ in range(HELD_ROUNDS):
                k = room_pages(cut, layer, q, pages, page, hkv, held_in_pages(scores, k, follow, page))
        keep, selection = kernel.select_pages(scores, k, page, layer.num_keys)
        read = layer.elements(hkv, bound_elements(layer, q), q.device)
        sizes = None  # the statistics list a question's units only: a decode step saves the launch
        if q.shape[1] > 1:
            sizes = torch.full((hkv, pages), page, dtype=torch.int64, device=q.device)
        return Lookup(selection=selection, index_elements=read, units=keep, scores=scores, sizes=sizes)

    def reads(self, q: torch.Tensor, layer: LayerIndex, plans: list[PagePlan], scale: float,
              positions: torch.Tensor | None = None) -> list[float]:
        """Method.reads without a lookup where a row is a KV head (the default group): each reads its plan's
        pages(P) pages, every key past the full pages and every page's bounds, whatever q (rows of query heads
        read the union of their pages: their lookups are counted)."""
        lo = layer["page_min"]
        hkv, pages, d = lo.shape
        if group_rows(self.settings.group, q.shape[0], hkv) != hkv:
            return super().reads(q, layer, plans, scale, positions)
        index = hkv * bound_elements(layer, q)
        rest = layer.num_keys - pages * self.settings.page_size  # a last partial page and the dense rows
        return [byte_share(hkv * (plan.pages(pages) * self.settings.page_size + rest), index, hkv, layer.num_keys, d)
                for plan in plans]

    def unit_labels(self, layer: LayerIndex) -> torch.Tensor:
        """Page of each indexed key; the keys of a last partial page (read at every step) get the id P."""
        hkv, pages = layer["page_min"].shape[:2]
        labels = torch.arange(layer.indexed, device=layer["page_min"].device) // self.settings.page_size
        return labels.clamp(max=pages).expand(hkv, -1)
