"""Duo + Squeeze (neither paper has it): DuoAttention's streaming heads stay streaming (the context's first and last
tokens), its retrieval heads read through squeeze's centroid lookup instead of every key.

Built from both methods (`requires`): duo's ranks of the heads (gates trained once per model) and squeeze's clusters,
whose K/V layout (an inverted file) this method reads. A fixed share of the model's heads, `retrieval`, the highest
gates, are retrieval heads; the budget sets squeeze's global threshold for them (calibrated as squeeze's, the reads
measured with the streaming heads' windows: engine.attention.budget). A streaming head's window is its tokens'
places in squeeze's layout, found once at build. Every head's centroids are scored (one kernel for the layer) and
counted in what a step reads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from engine.attention.budget import KEYS_GRID, byte_share, cut_room, cut_threshold, less_follow
from engine.attention.method import (
    CalibrationSet,
    LayerIndex,
    LayerKeys,
    Lookup,
    Method,
    MethodSettings,
    Tensors,
    check_budget,
)
from engine.methods.duo.policy import Window
from engine.methods.squeeze import (
    SqueezePolicy,
    ThresholdPlan,
    centroid_elements,
    code_step,
    cut_sizes,
    kept_keys,
    threshold_plan,
)
from kernels.backend import Backend
from kernels.layout import ClusterLayout
from kernels.selection import Fixed, FollowRows, KeyCount

# what the lookup reads of squeeze's index (the codes' offsets and steps where its centroids are one-byte codes)
SQUEEZE_PARTS = ("labels", "centroids", "counts", "key_starts", "centroid_offset", "centroid_step")


@dataclass(frozen=True)
class DuoSqueezeSettings(MethodSettings):
    """retrieval: the share of the model's KV heads (highest gates first) that retrieve through squeeze's lookup;
    sink, recent: what a streaming head reads of the context (as duo's)."""

    retrieval: float = 0.5
    sink: int = 64
    recent: int = 256

    def __post_init__(self) -> None:
        if not 0.0 <= self.retrieval <= 1.0:
            raise ValueError(f"retrieval must be in [0, 1], got {self.retrieval}")
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink and recent must be at least 0, got {self.sink}, {self.recent}")


@dataclass(frozen=True)
class HeadThresholdPlan(ThresholdPlan):
    """squeeze's thresholds for the heads of rank < `retrieval_heads`; the others stream. heads: the model's KV heads
    over its global layers (what the retrieval heads are a share of)."""

    retrieval_heads: int = 0
    heads: int = 0

    def describe(self) -> str:
        return f"{self.retrieval_heads} retrieval head(s) at " + super().describe()


class DuoSqueezePolicy(Method):
    name: ClassVar[str] = "duo-squeeze"
    Settings: ClassVar[type] = DuoSqueezeSettings
    requires: ClassVar[tuple[str, ...]] = ("duo", "squeeze")
    batched_lookup: ClassVar[bool] = True  # one cluster_select

    def build(self, layer: LayerKeys, required: dict[str, Tensors], prepared: Tensors) -> Tensors:
        """squeeze's clusters and duo's ranks, and `window` [Hkv, W + tail] int32: each head's streaming keys as places
        in squeeze's layout (sorted), then the dense rows."""
        squeeze, duo = required["squeeze"], required["duo"]
        hkv, indexed = layer.keys.shape[:2]
        window = Window.of(self.settings, indexed, layer.tail)
        layout = ClusterLayout.from_labels(squeeze["labels"], squeeze["counts"].shape[1], layer.tail)
        device = layout.order.device
        tokens = torch.cat([torch.arange(window.front, device=device),
                            torch.arange(indexed - window.back, indexed, device=device)])
        place = torch.empty_like(layout.order)
        place.scatter_(1, layout.order, torch.arange(layout.order.shape[1], device=device).expand(hkv, -1).contiguous())
        rows = torch.sort(place[:, tokens], dim=1).values
        dense = torch.arange(indexed, indexed + layer.tail, device=device).expand(hkv, -1)
        return {**{k: squeeze[k] for k in SQUEEZE_PARTS if k in squeeze}, "rank": duo["rank"].clone(),
                "window": torch.cat([rows, dense], dim=1).to(torch.int32)}

    def calibrate(self, layers: list[CalibrationSet], scale: float) -> Tensors:
        """squeeze's thresholds (over every head's calibration queries) and "heads", the model's KV heads."""
        out = SqueezePolicy().calibrate(layers, scale)
        out["heads"] = torch.tensor(sum(int(layer.index["rank"].numel()) for layer in layers))
        return out

    def plan_keys(self, calibration: Tensors, budget: float, decode_keys: float,
                  prefill_keys: float) -> HeadThresholdPlan:
        plan = threshold_plan(calibration, budget, decode_keys, prefill_keys, ("threshold",))
        heads = int(calibration["heads"])
        retrieval = heads if check_budget(budget) >= 1.0 else round(self.settings.retrieval * heads)
        return HeadThresholdPlan(budget=plan.budget, decode=plan.decode, prefill=plan.prefill,
                                 retrieval_heads=retrieval, heads=heads)

    def lookup(self, q: torch.Tensor, layer: LayerIndex, plan: HeadThresholdPlan, scale: float,
               backend: Backend, positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               follow: FollowRows | None = None) -> Lookup:
        """squeeze's lookup for every KV head (one row each), the streaming heads' rows their windows instead
        (written by the lookup's expansion)."""
        hkv = layer["counts"].shape[0]
        (threshold,) = plan.at(q.shape[1])
        fixed, retrieval = layer.memo(("duo-squeeze", plan.retrieval_heads, q.device),
                                      lambda: streaming_heads(layer, plan.retrieval_heads, q.device))
        index = centroid_elements(layer, q.element_size())  # every head's centroids are scored, per KV head
        read = layer.elements(hkv, index, q.device)
        cut = cut_room(plan, q, follow)
        # the retrieval heads' best clusters up to their share of the room (retrieval_keys), or the plan's threshold
        keys = None if cut is None else retrieval_keys(plan, layer, cut, index, q.shape[2])
        centroid = backend.kernel("centroid")
        if keys is not None and q.device.type == "cpu":  # the exact cut between whole clusters
            keep, score = centroid.cluster_keep(q, layer["centroids"], layer["counts"], scale, 0.0, hkv,
                                                step=code_step(layer), valid=valid)
            keep = keep & (score > cut_threshold(score, cut_sizes(layer, keys) * retrieval,
                                                 keys.value(device=q.device, heads=retrieval.sum())))
            selection = backend.kernel("compact").expand_groups(keep, layer["key_starts"], layer.indexed, layer.tail,
                                                                fixed=fixed)
        else:  # a GPU's cut inside the lookup's kernels (the streaming heads' clusters out of it), or the threshold
            keep, score, selection = centroid.cluster_select(
                q, layer["centroids"], layer["counts"], scale, threshold, hkv, layer["key_starts"], layer.indexed,
                layer.tail, fixed=fixed, step=code_step(layer), valid=valid, keys=keys)
        units = keep & retrieval if q.shape[1] > 1 else None  # listed for a prefill only (the recorder's): a decode
        # step's would be a launch for nothing
        return Lookup(selection=selection, index_elements=read, units=units, scores=score, sizes=layer["counts"])

    def reads(self, q: torch.Tensor, layer: LayerIndex, plans: list[HeadThresholdPlan], scale: float,
              positions: torch.Tensor | None = None) -> list[float]:
        """Method.reads with one scoring of q for every plan: a retrieval head reads its kept clusters' keys and the
        dense tail (squeeze.kept_keys), a streaming head its window (dense rows included), and every head's
        centroids are read, as read_fraction counts the lookup's selection (tests/engine/test_budget.py)."""
        hkv, d = layer["counts"].shape[0], q.shape[2]
        kept = kept_keys(q, layer, [plan.at(q.shape[1])[0] for plan in plans], scale, hkv)  # [F, Hkv]
        rank = layer["rank"].to(kept.device)
        index = hkv * float(centroid_elements(layer, q.element_size()))
        out = []
        for plan, keys in zip(plans, kept):
            streaming = rank >= plan.retrieval_heads
            total = torch.where(streaming, layer["window"].shape[1], keys).sum()
            out.append(byte_share(float(total), index, hkv, layer.num_keys, d))
        return out

    def layout(self, layer: LayerIndex) -> ClusterLayout:
        return ClusterLayout.from_labels(layer["labels"], layer["counts"].shape[1], layer.tail)

    def unit_labels(self, layer: LayerIndex) -> torch.Tensor:
        return layer["labels"]


def retrieval_keys(plan: HeadThresholdPlan, layer: LayerIndex, cut: tuple, index: float, head_dim: int) -> KeyCount:
    """The keys each retrieval head's clusters may hold so that the model's heads together read the room, as a
    count per retrieval KV head (KeyCount.per_head: the cut multiplies it by the layer's retrieval heads): every head
    reads its index (`index` elements) and the step's follow rows (cut = (room, follow rows):
    engine.attention.budget.cut_room; each indexed one once per KV head), a streaming head its window, a retrieval
    head its clusters and the dense rows; the streaming heads' unread share goes to the retrieval heads (a layer of
    streaming heads alone reads less than the room, so the others read more). At least KEYS_GRID's fewest."""
    room, follow = cut
    heads, retrieving = plan.heads, plan.retrieval_heads
    per_head = room * layer.num_keys - index / (2 * head_dim)  # keys a head may read on average, less follow rows
    window = layer["window"].shape[1]  # a streaming head's keys, its dense rows included
    keys = (heads * per_head - (heads - retrieving) * window) / max(retrieving, 1) - layer.tail
    # each follow row: once per KV head, spread over the retrieval heads as the rest is
    count = replace(less_follow(keys, 1, follow), per_listed=heads / max(retrieving, 1), per_head=True)
    return count.at_least(KEYS_GRID[-1] * layer.indexed)


def streaming_heads(layer: LayerIndex, retrieval_heads: int, device: torch.device) -> tuple[Fixed, torch.Tensor]:
    """The layer's streaming heads (rank >= retrieval_heads) reading their windows, and retrieval [Hkv, 1] bool
    (the heads whose kept clusters are read), on `device`: made once per plan (LayerIndex.memo)."""
    streaming = layer["rank"].to(device) >= retrieval_heads
    return Fixed(layer["window"].to(device), streaming), ~streaming[:, None]
