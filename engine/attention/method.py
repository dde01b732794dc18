"""The method contract: what a sparse-attention method is to the engine.

A method is one module registered by name (engine.methods.REGISTRY). It has
- its own frozen settings (`Settings`): only what it builds, so only they enter its cache key;
- `requires`: the methods whose artifacts its `build` reads (built first, passed in by name);
- `prepare(lm, preparation)`: artifacts learned once per model (stored apart from documents; none by default), with
  progress and a checkpoint to resume from (`Preparation`); `prepare_key()`: the settings they depend on;
- `build(layer, required, prepared)`: its index of one global layer, at ingest or later from the stored K/V;
- `calibrate(layers, scale)`: once per context, from every global layer's calibration queries (the engine adds
  the measured reads of its lookups, engine.attention.budget);
- `plan_keys(calibration, budget, decode_keys, prefill_keys)`: the typed `StepPlan` that keeps those fractions of
  the indexed keys in each phase; `plan(calibration, budget)`, common to all, maps a KV budget (the share of the
  fixed K/V bytes a step reads, index included) to them, so a budget means the same for every method and phase;
- `lookup(q, layer, plan, scale, backend)`: at every step, a `Lookup` whose `Selection` the one sparse-attention
  kernel reads; graph-capturable (static shapes, no host synchronisation);
- `layout(layer)`: the order in which its selections see the layer's fixed K/V (None: positions).

Artifact names (engine.index.artifacts) put every method in its own namespace: `{method}.layer{i}.{name}` and
`{method}.calib.{name}`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import ClassVar

import torch

from engine.attention.budget import keys_for, read_fraction
from kernels.backend import REFERENCE, Backend
from kernels.layout import ClusterLayout
from kernels.selection import FollowRows, Selection

Tensors = dict[str, torch.Tensor]  # artifacts by name


@dataclass(frozen=True)
class MethodSettings:
    """A method's own settings (subclasses: frozen dataclasses validated in __post_init__). `as_dict` is what its
    index's cache key holds."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepPlan:
    """What a method does at one budget, decided on the host once per turn and read by every lookup of the turn.
    Hashable: a captured decode step is keyed by its plan.

    budget: the share of the fixed context's K/V bytes a step is asked to read, index included (1 - sparsity)
    """

    budget: float

    def describe(self) -> str:
        """One line for the UI (what the turn's lookup used)."""
        return f"budget {self.budget:.0%}"

    def retrieval_threshold(self) -> float | None:
        """The score above which a decode step keeps a unit (the explanations' "retrieved by the answer"), or None
        for a plan that keeps its best units whatever their scores (top-K)."""
        return None


@dataclass
class LayerIndex:
    """One global layer's index of one method, as a lookup sees it.

    tensors: the method's artifacts of the layer by their short names (plus its model-level ones of the layer)
    num_keys: rows of the layer's fixed K/V (the indexed rows, then the dense rows)
    tail: the last `tail` rows, read by every step of every method: the dense rows (the context's sink and its last
        tokens: engine.attention.rows)
    """

    tensors: Tensors
    num_keys: int
    tail: int
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key, make: Callable[[], object]):
        """What a method derives from this index and a plan (a value of `key`), made once and kept with the index:
        a selection that does not depend on the step's queries (DuoAttention's) is then made at the turn's first
        step and reused by every later one, and by a captured decode step (no kernel left to replay)."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    def elements(self, heads: int, count: float, device: torch.device) -> torch.Tensor:
        """[heads] float32, each `count`: a lookup's index elements read per KV head where they are the same at
        every step (Lookup.index_elements; made once: no launch per step)."""
        return self.memo(("elements", heads, float(count), device),
                         lambda: torch.full((heads,), float(count), device=device))

    @property
    def indexed(self) -> int:
        """Rows of the fixed K/V that the index covers (the first ones: tokens sink .. L - dense tail, in order)."""
        return self.num_keys - self.tail

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors


@dataclass
class LayerKeys:
    """What `build` gets of one global layer: keys [Hkv, Lc, D] (as the attention sees them, RoPE applied) of the
    indexed part of the fixed context, in token order, tokens first .. first + Lc - 1; the `tail` dense rows
    (engine.attention.rows) are not in it; query_moment [Hkv, D, D]: the second moment of the layer's unit queries over
    the context (engine.index.kmeans.query_moment), or None where a caller has none."""

    layer_idx: int
    keys: torch.Tensor
    tail: int
    first: int = 0  # the position of the first row's token (the context's sink rows, when any, are dense rows)
    query_moment: torch.Tensor | None = None


@dataclass
class Lookup:
    """What a lookup decided for one layer and one step.

    selection: keys of the fixed K/V to attend to (positions in the method's layout); None only for full attention
    index_elements: [Hkv] elements of index metadata read per KV head (centroids, counts, bounds); [0] for full
        attention
    units: [rows, U] bool the retrieval units kept (clusters, pages), or None
    scores: [rows, U] float32 the units' scores (reduced over the step), or None
    sizes: [Hkv, U] keys in each unit (the retrieved-units report), or None
    """

    selection: Selection | None
    index_elements: torch.Tensor
    units: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    sizes: torch.Tensor | None = None

    def read_fraction(self, head_dim: int, num_keys: int) -> float:
        """The share of the fixed K/V bytes this step reads, index elements included (engine.attention.budget)."""
        return read_fraction(self.selection, self.index_elements, head_dim, num_keys)


@dataclass
class CalibrationSet:
    """One global layer's index of the method being calibrated and its calibration queries (q: [Hq, Nc, D]) at
    `positions` [Nc] int64 (None: the context's last Nc tokens, as an ingest captures them)."""

    index: LayerIndex
    queries: torch.Tensor
    positions: torch.Tensor | None = None

    def query_positions(self) -> torch.Tensor:
        """[Nc] int64 on the queries' device."""
        if self.positions is not None:
            return self.positions.to(self.queries.device)
        n = self.queries.shape[1]
        return torch.arange(self.index.num_keys - n, self.index.num_keys, device=self.queries.device)


@dataclass
class Preparation:
    """What `Method.prepare` may use besides the model: `progress(done, total, message)`, and a checkpoint: `load()`
    the state a stopped preparation saved ({} when none), `save(state)` to keep one (named tensors)."""

    progress: Callable[[int, int, str], None] = lambda done, total, message: None
    load: Callable[[], Tensors] = dict
    save: Callable[[Tensors], None] = lambda state: None


class Method(ABC):
    """A sparse-attention method (see the module docstring). An instance carries its settings."""

    name: ClassVar[str]
    Settings: ClassVar[type[MethodSettings]] = MethodSettings
    requires: ClassVar[tuple[str, ...]] = ()
    sparse: ClassVar[bool] = True
    follows: ClassVar[bool] = True  # its steps also read the follow rows (engine.attention.follow) when the session has them
    unit: ClassVar[str] = "cluster"  # what a lookup keeps, in the UI's words
    # Its lookup's kernels are one cluster_select of the backend's centroid family and write nothing but what
    # `lookup` returns: a batched step may plan them and launch them later, with other sequences'
    # (engine.attention.later)
    batched_lookup: ClassVar[bool] = False
    # Bumped when what the method builds or calibrates changes meaning: contexts built before rebuild its index and
    # calibration on their next question (it is part of the build key: engine.serve.service.Engine.build_key)
    revision: ClassVar[int] = 0

    def __init__(self, settings: MethodSettings | None = None):
        settings = self.Settings() if settings is None else settings
        if not isinstance(settings, self.Settings):
            raise TypeError(f"{self.name} takes {self.Settings.__name__}, got {type(settings).__name__}")
        self.settings = settings

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings!r})"

    def build_entry(self) -> dict:
        """Its part of a build key (engine.serve.service.Engine.build_key): its settings, and its revision where it
        has one."""
        return {**self.settings.as_dict(), **({"revision": self.revision} if self.revision else {})}

    @staticmethod
    def built_settings(entry: dict) -> dict:
        """The settings a build key's entry holds (build_entry's, its revision left out)."""
        return {k: v for k, v in entry.items() if k != "revision"}

    def prepare(self, lm, preparation: Preparation | None = None) -> Tensors:
        """Artifacts learned once per model (`layer{i}.{name}` for a layer's): none by default."""
        return {}

    @classmethod
    def learns_per_model(cls) -> bool:
        """Whether the method makes model-level artifacts (it overrides `prepare`, itself or through a parent)."""
        return cls.prepare is not Method.prepare

    def prepare_key(self) -> dict:
        """The settings `prepare` depends on (the key of its artifacts in the store): all of them by default."""
        return self.settings.as_dict()

    def preparation_work(self) -> float:
        """What `prepare` costs, in tokens of a document's ingest (its prefill and index build) with the same model on
        the same machine: it should take this many times an ingest's seconds per token (0: nothing is learned)."""
        return 0.0

    def stand_in(self, layers: list[int], num_kv_heads: int, head_dim: int) -> Tensors:
        """Model-level artifacts of the right shapes where no model is at hand (a synthetic context's tests), made
        without training; none by default."""
        return {}

    @abstractmethod
    def build(self, layer: LayerKeys, required: dict[str, Tensors], prepared: Tensors) -> Tensors:
        """The method's index of one global layer. required: each method of `requires` -> its artifacts of the layer;
        prepared: this method's model-level artifacts of the layer."""

    @abstractmethod
    def calibrate(self, layers: list[CalibrationSet], scale: float) -> Tensors:
        """Once per context, from every global layer's calibration queries (what `plan` maps a budget with)."""

    def plan(self, calibration: Tensors, budget: float, reserve: tuple[float, float] = (0.0, 0.0)) -> StepPlan:
        """The turn's plan at `budget`, the share of the fixed context's K/V bytes a step reads (index included), on
        the host: each phase's key fraction from the calibrated reads (engine.attention.budget), then plan_keys.
        A calibration without them (made by hand, or by a tool that skips them) reads the budget as key fractions.
        reserve: (decode, prefill) shares of the bytes that the engine reads besides the method's selection in each
        phase (engine.attention.follow), left out of what the method may read (at least the fewest keys it keeps).
        A plan with a `room` field gets those shares there: its lookups may cut their own scores to them."""
        budget = check_budget(budget)
        if budget >= 1.0:  # every key (what the index costs on top is the price of asking for all)
            return self.plan_keys(calibration, 1.0, 1.0, 1.0)
        room = (max(budget - reserve[0], 1e-6), max(budget - reserve[1], 1e-6))
        decode = keys_for(calibration["budget_decode"], room[0]) if "budget_decode" in calibration else room[0]
        prefill = keys_for(calibration["budget_prefill"], room[1]) if "budget_prefill" in calibration else \
            (decode if "budget_decode" in calibration else room[1])
        plan = self.plan_keys(calibration, budget, decode, prefill)
        if any(f.name == "room" for f in fields(plan)):  # its lookups cut to it (engine.attention.budget.exact_room)
            plan = replace(plan, room=room)
        return plan

    @abstractmethod
    def plan_keys(self, calibration: Tensors, budget: float, decode_keys: float, prefill_keys: float) -> StepPlan:
        """The plan that keeps about `decode_keys` of the indexed keys at a decode step and `prefill_keys` at a
        question's prefill (fractions in (0, 1]); `budget` is what the plan reports (StepPlan.budget)."""

    @abstractmethod
    def lookup(self, q: torch.Tensor, layer: LayerIndex, plan: StepPlan, scale: float, backend: Backend,
               positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               follow: FollowRows | None = None) -> Lookup:
        """q: [Hq, Lq, D] the step's queries (Lq > 1: the question's prefill), RoPE applied; positions: [Lq] int64
        on q's device, their positions (a method that works on de-RoPE'd queries needs them; the engine always
        passes them); valid: [1] int64 on q's device, how many of the Lq tokens are real, the first ones (a question
        padded to a captured length: a score pooled over the step's tokens must count the real ones only; None:
        all of them); follow: the rows the step reads besides its selection (engine.attention.follow), for a lookup
        that cuts its scores to the budget left (None: the plan's reserve for them). No host synchronisation."""

    def reads(self, q: torch.Tensor, layer: LayerIndex, plans: list[StepPlan], scale: float,
              positions: torch.Tensor | None = None) -> list[float]:
        """The share of the fixed K/V bytes one step of q reads under each of `plans` (engine.attention.budget's
        read_fraction of its reference lookup): what the budget's calibration measures, ~2,300 steps per method. A
        method whose scores do not depend on the plan may score once for all of them; it must give these values."""
        return [self.lookup(q, layer, plan, scale, REFERENCE, positions).read_fraction(q.shape[2], layer.num_keys)
                for plan in plans]

    def layout(self, layer: LayerIndex) -> ClusterLayout | None:
        """The order of the fixed K/V that this method's selections index (None: original positions)."""
        return None

    def unit_labels(self, layer: LayerIndex) -> torch.Tensor | None:
        """[Hkv, indexed] int64: the unit (cluster, page) of each indexed key in original order (explanations)."""
        return None


def group_rows(group: str, hq: int, hkv: int) -> int:
    """Rows of a selection: one per KV head (shared by its query heads: group "kv") or one per query head."""
    return hkv if group == "kv" else hq


def check_budget(budget: float) -> float:
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    return float(budget)
