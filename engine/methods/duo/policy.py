"""DuoAttention (Xiao et al., 2024): retrieval heads read every key, streaming heads only the attention sink and
the most recent tokens; which heads retrieve is learned once per model (engine.methods.duo.gates: one gate per global layer and
KV head, trained on synthetic passkeys with the model frozen).

Deployment (section 2.3, sizes of section 3.5): the heads are ranked by gate over the whole model, highest first.
A budget fills them in that order: every head reads its streaming window (the context's first `sink` tokens and
its last `recent` ones; the new tokens are read by every head anyway), then heads become retrieval heads (every key)
while the budget lasts, and the head at the boundary reads as many more recent keys as what is left pays for. So a
budget reads what it says whatever the number of heads (the paper binarises at a gate quantile: the same heads, but
a budget then moves in steps of one head). Where the streaming windows alone would read more than the budget (a
document of a few thousand tokens: 64 + 256 keys are a tenth of 3K), every window shrinks to what the budget pays
for, the sink and the recent keys in proportion (the sink keeps its first SINK_KEEP keys while it can).
Both phases read the same keys. The selection depends on the plan only, not on the step's queries: it is made once
per layer and plan (LayerIndex.memo) and costs no lookup after the turn's first step; no index bytes are read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from engine.attention.budget import KEYS_GRID, exact_room
from engine.attention.method import (
    CalibrationSet,
    LayerIndex,
    LayerKeys,
    Lookup,
    Method,
    MethodSettings,
    Preparation,
    StepPlan,
    Tensors,
    check_budget,
)
from engine.index.artifacts import layer_name
from engine.methods.duo.data import GateData
from engine.methods.duo.gates import GateTraining, rank_heads, timed, train_gates
from kernels.backend import Backend
from kernels.selection import FollowRows, Selection, entry_rows

TRAINING_PREFIX = "train_"  # the settings the gates depend on (with `seed`): the key of the stored gates
# A training token (the full-attention and the gated forward, the backward) costs about two tokens of an ingest:
# the defaults' 100 steps trained in 17 min on 2 CPU cores with the embedded model, which ingests 3.4 ms per token.
INGEST_TOKENS_PER_TRAINING_TOKEN = 2.0
CORPUS_SPARE = 4  # corpus tokens read for training: this many times the longest haystack (the haystacks' offsets vary)
SINK_KEEP = 4  # a window shrunk to a budget keeps at least this many sink keys (StreamingLLM's four initial tokens)


@dataclass(frozen=True)
class DuoSettings(MethodSettings):
    """sink, recent: what a streaming head reads of the context (section 3.5: 64 and 256). train_*: how the gates
    are trained (engine.methods.duo.gates.GateTraining, engine.methods.duo.data.GateData: steps, learning rate, L1 weight, the
    streaming window while training, the haystacks' lengths, passkeys per sequence and words per passkey); seed:
    the training sequences'. Only train_* and seed are the key of the stored gates."""

    sink: int = 64
    recent: int = 256
    train_steps: int = 100
    train_lr: float = 0.02
    train_reg: float = 0.05
    train_sink: int = 128
    train_recent: int = 256
    train_min_tokens: int = 1000
    train_max_tokens: int = 2048
    train_passkeys: int = 5
    train_words: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink and recent must be at least 0, got {self.sink}, {self.recent}")
        self.training()  # validates the training settings

    def training(self) -> GateTraining:
        data = GateData(min_tokens=self.train_min_tokens, max_tokens=self.train_max_tokens,
                        passkeys=self.train_passkeys, words=self.train_words)
        return GateTraining(steps=self.train_steps, lr=self.train_lr, reg=self.train_reg, sink=self.train_sink,
                            recent=self.train_recent, data=data, seed=self.seed)


@dataclass(frozen=True)
class HeadPlan(StepPlan):
    """The heads of rank < `full` read every key; the head of rank `full` reads `extra` more recent keys than its
    streaming window; the others their window, fitted into `fit` of the indexed keys (Window.of). heads: the
    model's KV heads at global layers; room: as ThresholdPlan's (engine.attention.budget.exact_room: on the CPU a
    step's own follow rows are counted and the rest of the budget goes to the heads)."""

    full: int = 0
    extra: int = 0
    fit: float = 1.0
    heads: int = 0
    room: tuple[float, float] | None = None

    def describe(self) -> str:
        fitted = f", streaming windows fitted to {self.fit:.3f} of the keys" if self.fit < 1.0 else ""
        return (f"{self.full} retrieval head(s)" + (f", one with {self.extra} more recent keys" if self.extra else "")
                + fitted)


@dataclass(frozen=True)
class Window:
    """The indexed keys a streaming head reads: the first `front` and the last `back` (of `indexed`)."""

    front: int
    back: int
    indexed: int

    @classmethod
    def of(cls, settings: DuoSettings, indexed: int, tail: int, fit: float = 1.0) -> "Window":
        """The sink's keys and the recent ones not already in the dense tail (engine.attention.rows: the context's last
        `tail` rows are read by every step; a context sink, when one is set, adds its rows too), both shrunk in
        proportion where they hold more than `fit` of the indexed keys (the sink keeps SINK_KEEP while it can)."""
        front = min(settings.sink, indexed)
        back = min(max(settings.recent - tail, 0), indexed - front)
        room = int(fit * indexed)
        if front + back > room:
            kept = min(front, max(min(SINK_KEEP, room), round(room * front / (front + back))))
            front, back = kept, max(room - kept, 0)
        return cls(front=front, back=back, indexed=indexed)

    @property
    def keys(self) -> int:
        return self.front + self.back

    def head_keys(self, rank: torch.Tensor, plan: HeadPlan) -> torch.Tensor:
        """rank [...] int64 -> [...] int64: the indexed keys each head reads under `plan` (the front, then the back)."""
        boundary = min(self.back + plan.extra, self.indexed - self.front)
        back = torch.where(rank == plan.full, torch.full_like(rank, boundary), torch.full_like(rank, self.back))
        return torch.where(rank < plan.full, torch.full_like(rank, self.indexed), self.front + back)


class DuoPolicy(Method):
    name: ClassVar[str] = "duo"
    Settings: ClassVar[type] = DuoSettings
    unit: ClassVar[str] = "head"
    revision: ClassVar[int] = 1  # streaming windows fitted to the budget: the budget curves of older builds differ

    def prepare_key(self) -> dict:
        return {f.name: getattr(self.settings, f.name) for f in fields(self.settings)
                if f.name.startswith(TRAINING_PREFIX) or f.name == "seed"}

    def preparation_work(self) -> float:
        """The training's sequences (steps of the mean length) at INGEST_TOKENS_PER_TRAINING_TOKEN each."""
        mean = (self.settings.train_min_tokens + self.settings.train_max_tokens) / 2
        return self.settings.train_steps * mean * INGEST_TOKENS_PER_TRAINING_TOKEN

    def prepare(self, lm, preparation: Preparation | None = None) -> Tensors:
        """Train the gates (engine.methods.duo.gates) on the corpus (engine.text.corpus); `layer{i}.gates` [Hkv] float32 and
        `layer{i}.rank` [Hkv] int64 (the head's place in the model's order, highest gate first)."""
        from engine.text.corpus import corpus_ids

        prep = preparation or Preparation()
        training = self.settings.training()
        corpus = corpus_ids(lm.tokenizer, CORPUS_SPARE * training.data.max_tokens)
        gates = train_gates(lm, training, corpus, state=prep.load() or None, save=prep.save,
                            progress=timed(prep.progress, training.steps))
        return gate_artifacts(list(lm.global_layers), gates)

    def stand_in(self, layers: list[int], num_kv_heads: int, head_dim: int) -> Tensors:
        """Gates spread evenly over [0, 1] (interleaved over the layers), as trained ones would rank the heads."""
        n = len(layers) * num_kv_heads
        gates = torch.linspace(1.0, 0.0, n).view(num_kv_heads, len(layers)).t().contiguous()
        return gate_artifacts(layers, gates)

    def build(self, layer: LayerKeys, required: dict[str, Tensors], prepared: Tensors) -> Tensors:
        """The gates this context is built with (a copy of the model's, so that a retrained model's contexts are
        rebuilt: they are part of its key through the settings)."""
        if "gates" not in prepared or "rank" not in prepared:
            raise ValueError("duo needs its trained gates (`squeeze train duo`, or the app's first use of the method)")
        return {"gates": prepared["gates"].clone(), "rank": prepared["rank"].clone()}

    def calibrate(self, layers: list[CalibrationSet], scale: float) -> Tensors:
        """What a step reads is known without queries: "heads" (every global layer's KV heads) and "indexed" (keys
        per head before the dense rows), and the exact budget curves at KEYS_GRID (the same in both phases)."""
        first = layers[0].index
        heads = sum(int(layer.index["rank"].numel()) for layer in layers)
        calibration = {"heads": torch.tensor(heads), "indexed": torch.tensor(first.indexed),
                       "tail": torch.tensor(first.tail)}
        ranks = torch.arange(heads)
        curve = []
        for keys in KEYS_GRID:
            plan = self.plan_keys(calibration, keys, keys, keys)
            window = Window.of(self.settings, first.indexed, first.tail, plan.fit)
            read = float(window.head_keys(ranks, plan).sum()) + heads * first.tail
            curve.append(read / (heads * first.num_keys))
        curve = torch.tensor(curve, dtype=torch.float64)
        return {**calibration, "budget_decode": curve, "budget_prefill": curve.clone()}

    def plan_keys(self, calibration: Tensors, budget: float, decode_keys: float, prefill_keys: float) -> HeadPlan:
        """`decode_keys` of all heads' indexed keys: every streaming window first, then whole heads in gate order,
        the rest to the next head's recent keys."""
        heads, indexed = int(calibration["heads"]), int(calibration["indexed"])
        keys = check_budget(decode_keys)
        fit = 1.0 if Window.of(self.settings, indexed, int(calibration["tail"])).keys <= keys * indexed else keys
        window = Window.of(self.settings, indexed, int(calibration["tail"]), fit)
        left = max(0.0, keys * heads * indexed - heads * window.keys)
        cost = indexed - window.keys  # one more retrieval head
        full = heads if cost == 0 else min(heads, int(left // cost))
        extra = 0 if full >= heads else int(round(left - full * cost))
        return HeadPlan(budget=check_budget(budget), full=full, extra=min(extra, cost), fit=fit, heads=heads)

    def lookup(self, q: torch.Tensor, layer: LayerIndex, plan: HeadPlan, scale: float, backend: Backend,
               positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               follow: FollowRows | None = None) -> Lookup:
        """One row per KV head; the same selection at every step of the plan (made at the first), or, where the
        step counts its own follow rows (exact_room: on the CPU), the plan the rest of the budget pays for."""
        hkv = layer["rank"].numel()
        cut = exact_room(plan, q, follow, hkv)
        if cut is not None and plan.budget < 1.0:
            step_plan = self.step_plan(plan, layer, *cut, hkv)
            window = Window.of(self.settings, layer.indexed, layer.tail, step_plan.fit)
            return Lookup(selection=head_selection(layer, window, step_plan, q.device),
                          index_elements=layer.elements(hkv, 0.0, q.device))
        selection = layer.memo(("duo", plan.full, plan.extra, plan.fit, q.device),
                               lambda: head_selection(layer, Window.of(self.settings, layer.indexed, layer.tail,
                                                                       plan.fit), plan, q.device))
        return Lookup(selection=selection, index_elements=layer.elements(hkv, 0.0, q.device))

    def step_plan(self, plan: HeadPlan, layer: LayerIndex, room: float, besides, hkv: int) -> HeadPlan:
        """The plan one step's `room` (a share of the fixed K/V) pays for once the dense rows and the keys it reads
        besides (its follow rows, `besides` over its hkv heads) are counted: the same heads first, in gate order."""
        calibration = {"heads": plan.heads, "indexed": layer.indexed, "tail": layer.tail}  # (what plan_keys reads)
        keys = (room * layer.num_keys - layer.tail - float(besides) / hkv) / layer.indexed
        keys = min(1.0, max(keys, 1.0 / (layer.indexed * max(plan.heads, 1))))
        return replace(self.plan_keys(calibration, plan.budget, keys, keys), room=plan.room)


def gate_artifacts(layers: list[int], gates: torch.Tensor) -> Tensors:
    """gates [G, Hkv] of `layers` -> `layer{i}.gates` and `layer{i}.rank` (rank_heads)."""
    rank = rank_heads(gates)
    out = {}
    for row, i in enumerate(layers):
        out[layer_name(i, "gates")] = gates[row].float().clone()
        out[layer_name(i, "rank")] = rank[row].clone()
    return out


def head_selection(layer: LayerIndex, window: Window, plan: HeadPlan, device: torch.device) -> Selection:
    """Each KV head's keys (rows = Hkv): a retrieval head every key; the others the window's first and last indexed
    keys, then the dense rows. Made on `device` without host synchronisation (the rows' lengths come from the
    ranks on the device; the buffer is sized from the plan)."""
    rank = layer["rank"].to(device)
    hkv, num_keys, tail = rank.numel(), layer.num_keys, layer.tail
    count = window.head_keys(rank, plan) + tail  # [Hkv]
    front = torch.where(rank < plan.full, torch.full_like(rank, num_keys), torch.full_like(rank, window.front))
    indptr, row, offset = entry_rows(count, min(hkv, plan.full + 1) * num_keys + hkv * (window.keys + tail))
    keys = torch.where(offset < front[row], offset, num_keys - count[row] + offset)
    return Selection(indptr=indptr, indices=keys.clamp(0, num_keys - 1).to(torch.int32), num_keys=num_keys)
