"""Squeezed Attention, single level: k-means key clusters, a centroid lookup against one global threshold."""

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
    StepPlan,
    Tensors,
    check_budget,
    group_rows,
)
from engine.index.kmeans import KMeansResult, metric_kmeans, query_metric, spherical_kmeans
from engine.index.thresholds import SPARSITY_GRID, pooled_thresholds, prefill_windows, threshold_at, window_scores
from kernels.backend import REFERENCE, Backend
from kernels.layout import ClusterLayout, group_starts
from kernels.reference.centroid import dequantize_centroids, quantize_centroids, row_scores, select_clusters
from kernels.selection import FollowRows, KeyCount

GROUPS = ("kv", "query")
CENTROIDS = ("exact", "int8")
PREFILL_THRESHOLDS = ("calibrated", "decode")
KMEANS = ("query", "cosine")


def check_threshold_settings(settings) -> None:
    """The settings squeeze and hsqueeze share: kmeans, kmeans_iters, group, prefill_threshold, centroids."""
    if settings.kmeans not in KMEANS:
        raise ValueError(f"kmeans must be one of {KMEANS}, got {settings.kmeans!r}")
    if settings.kmeans_iters < 1:
        raise ValueError(f"kmeans_iters must be at least 1, got {settings.kmeans_iters}")
    if settings.group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {settings.group!r}")
    if settings.prefill_threshold not in PREFILL_THRESHOLDS:
        raise ValueError(f"prefill_threshold must be one of {PREFILL_THRESHOLDS}, got {settings.prefill_threshold!r}")
    if settings.centroids not in CENTROIDS:
        raise ValueError(f"centroids must be one of {CENTROIDS}, got {settings.centroids!r}")


@dataclass(frozen=True)
class SqueezeSettings(MethodSettings):
    """centroid_ratio: centroids as a fraction of the indexed keys (paper: 5%)
    kmeans: how keys are clustered: "query" (default): Euclidean k-means under the metric of the layer's queries
        (engine.index.kmeans.query_metric of the context's query moment: a key's distance to its centroid is the error of
        the logit the centroid stands in for); "cosine": spherical k-means (also where a build has no moment)
    kmeans_iters: most Lloyd iterations; seed: k-means initialisation seed
    group: "kv": one selection per KV head from the mean of its query heads' scores (each selected key is read once
        per GQA group); "query": one per query head (the paper's MHA form)
    prefill_threshold: the question prefill's threshold (Lq > 1 tokens, scored by max(mean over the tokens of S,
        the last token's S)): "calibrated" (default): its own, calibrated on that score over windows of the
        calibration queries, so that a question reads its budget too; "decode": the decode step's (the union of the
        two terms then reads up to twice the budget)
    centroids: "int8" (default: one byte per element, per KV head and dim an offset and a step:
        kernels.reference.centroid.quantize_centroids; the lookup reads half the bytes of bf16 centroids, a quarter
        of float32 ones, and a budget leaves that much more to keys) or "exact" (the keys' dtype, as the paper)
    """

    centroid_ratio: float = 0.05
    kmeans: str = "query"
    kmeans_iters: int = 20
    seed: int = 0
    group: str = "kv"
    prefill_threshold: str = "calibrated"
    centroids: str = "int8"

    def __post_init__(self) -> None:
        if not 0 < self.centroid_ratio <= 1:
            raise ValueError(f"centroid_ratio must be in (0, 1], got {self.centroid_ratio}")
        check_threshold_settings(self)


@dataclass(frozen=True)
class ThresholdPlan(StepPlan):
    """A turn of a threshold method: decode's thresholds (one per level of the lookup) and the question prefill's;
    room: (decode, prefill) shares of the fixed K/V bytes the method's lookups may read (the budget less what the
    engine reads besides), where each lookup cuts its own scores to read that (`cut_room`); None: the thresholds
    alone (a plan made from key fractions, as the budget's calibration makes them)."""

    decode: tuple[float, ...]
    prefill: tuple[float, ...]
    room: tuple[float, float] | None = None

    def describe(self) -> str:
        th = ", ".join(f"{x:.3g}" for x in self.decode)
        if self.room is not None:  # (cut_room: on a GPU, whole bins of the scores' histogram)
            return (f"its best clusters up to {self.room[1]:.1%} of the K/V bytes in the question's lookups, "
                    f"{self.room[0]:.1%} in the answer's")
        if self.prefill != self.decode:
            th += " (prefill " + ", ".join(f"{x:.3g}" for x in self.prefill) + ")"
        return f"threshold {th}"

    def retrieval_threshold(self) -> float:
        """Decode's threshold of the last level (the one that decides which units' keys are read)."""
        return self.decode[-1]

    def at(self, lq: int) -> tuple[float, ...]:
        """The thresholds of a step of `lq` query tokens (Lq > 1: the question's prefill)."""
        return self.prefill if lq > 1 else self.decode


def cut_keys(room: float, layer: LayerIndex, hkv: int, head_dim: int, index: float,
             follow: FollowRows | None = None, per_read: float = 0.0) -> KeyCount:
    """The keys a lookup's units may hold to read `room` of the layer's fixed K/V bytes (byte_share inverted): less
    the index elements it reads (index: over every KV head; per_read: less that many keys per element a candidate
    list's lookup reads itself, 1 / (2 x head_dim) of a key each), the dense tail of every row (rows == Hkv) and the
    step's follow rows (less_follow); at least the fewest keys a plan keeps (KEYS_GRID's last share of the indexed
    keys), where the index and the tail alone take more than the room. A count the lookup works out where it runs
    (KeyCount.value on the CPU)."""
    keys = room * hkv * layer.num_keys - index / (2 * head_dim) - hkv * layer.tail
    count = replace(less_follow(keys, hkv, follow), per_read=per_read)
    return count.at_least(KEYS_GRID[-1] * hkv * layer.indexed)


def cut_sizes(layer: LayerIndex, keys: KeyCount) -> torch.Tensor:
    """[Hkv, C]: each cluster's keys as a CPU's exact cut counts them, less the step's follow rows it holds
    (KeyCount.held): keys takes every follow row out, and one inside a kept cluster is read with it, not again."""
    return layer["counts"] - keys.held(layer["key_starts"])


def num_centroids(indexed: int, ratio: float) -> int:
    """Centroids for `indexed` keys at `ratio`: at least 1, at most `indexed`."""
    return max(1, min(indexed, round(indexed * ratio)))


def threshold_plan(calibration: Tensors, budget: float, decode_keys: float, prefill_keys: float,
                   names: tuple[str, ...]) -> ThresholdPlan:
    """The plan of a threshold method: each name's calibrated grid at key sparsity 1 - decode_keys; the prefill's
    from `{name}_prefill` at 1 - prefill_keys where the calibration has them, else decode's."""
    def sparsity(keys: float) -> float:
        return min(max(1.0 - check_budget(keys), 0.0), SPARSITY_GRID[-1])

    decode = tuple(threshold_at(calibration[n], sparsity(decode_keys)) for n in names)
    prefill = tuple(threshold_at(calibration[f"{n}_prefill"], sparsity(prefill_keys)) for n in names) \
        if all(f"{n}_prefill" in calibration for n in names) else decode
    return ThresholdPlan(budget=check_budget(budget), decode=decode, prefill=prefill)


def cluster_points(points: torch.Tensor, k: int, settings, moment: torch.Tensor | None,
                   weights: torch.Tensor | None = None) -> KMeansResult:
    """k-means of points [Hkv, N, D] into k clusters per head as `settings` (kmeans, kmeans_iters, seed) say: for
    "query", under the metric of the layer's query moment [Hkv, D, D] (LayerKeys.query_moment) where there is one."""
    if settings.kmeans == "query" and moment is not None:
        metric = query_metric(moment.to(points.device))
        return metric_kmeans(points, k, metric, iters=settings.kmeans_iters, seed=settings.seed, weights=weights)
    return spherical_kmeans(points, k, iters=settings.kmeans_iters, seed=settings.seed, weights=weights)


def stored_centroids(centroids: torch.Tensor, settings, dtype: torch.dtype, prefix: str = "") -> Tensors:
    """What an index keeps of its clusters' centroids [Hkv, C, D] (settings.centroids), under `prefix`:
    {"centroids": in `dtype`, the keys'}, or one-byte codes with "centroid_offset" and "centroid_step"
    (quantize_centroids)."""
    stored = quantize_centroids(centroids) if settings.centroids == "int8" else {"centroids": centroids.to(dtype)}
    return {prefix + name: t for name, t in stored.items()}


def code_step(index, prefix: str = "") -> torch.Tensor | None:
    """The step [Hkv, D] of index[prefix + "centroids"] where they are one-byte codes (the lookup kernels' `step`:
    they score the codes with q scaled by it), else None."""
    name = f"{prefix}centroid_step"
    return index[name] if name in index else None


def float_centroids(index, prefix: str = "") -> torch.Tensor:
    """index[prefix + "centroids"] as float32 [Hkv, C, D] (one-byte codes dequantized)."""
    c = index[f"{prefix}centroids"]
    if f"{prefix}centroid_step" in index:
        return dequantize_centroids(c, index[f"{prefix}centroid_offset"], index[f"{prefix}centroid_step"])
    return c.float()


def centroid_elements(index, key_size: int, prefix: str = "", scored: int | torch.Tensor | None = None):
    """Elements of the keys' dtype (key_size bytes) a lookup reads of each KV head's centroids and counts: every
    one of the C centroids, or `scored` of them; with one-byte codes, a byte each, plus the offsets and steps."""
    c, d = index[f"{prefix}centroids"].shape[1:]
    n = c if scored is None else scored
    if f"{prefix}centroid_step" in index:
        return n * (d / key_size + 1) + 2 * d * 4 / key_size
    return n * (d + 1)


def per_token_scores(q: torch.Tensor, index: LayerIndex, scale: float, rows: int, backend: Backend) -> torch.Tensor:
    """Calibration view of eq. 1: S for every query token, averaged over the query heads of a row.

    q: [Hq, Nc, D] -> [rows, Nc, C].
    """
    log_s = backend.kernel("centroid").centroid_log_scores(q, index["centroids"], index["counts"], scale,
                                                           step=code_step(index))
    return row_scores(log_s, rows)


def row_counts(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """counts [Hkv, C] -> [rows, C]: each row's KV head's cluster sizes."""
    return counts.repeat_interleave(rows // counts.shape[0], dim=0)


def weighted_samples(s: torch.Tensor, counts: torch.Tensor, rows: int,
                     token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration samples: every (row, token, cluster) score, weighted by the cluster's keys (times the token's
    weight, when given: the prefill calibration's windows).

    s: [rows, Nc, C]; counts: [Hkv, C]; token_weights: [Nc] or None -> (scores [rows * Nc * C], weights, same shape,
    float32).
    """
    weights = row_counts(counts, rows)[:, None, :].expand_as(s).float()
    if token_weights is not None:
        weights = weights * token_weights.to(weights)[None, :, None]
    return s.reshape(-1), weights.reshape(-1)


def prefill_samples(per_token: torch.Tensor, counts: torch.Tensor, rows: int,
                    windows: list[tuple[int, int, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill calibration samples: the prefill lookup's score of every (row, window, cluster), weighted by the
    cluster's keys and the window's weight. per_token: [rows, Nc, C] S; windows: engine.index.thresholds.prefill_windows."""
    weights = torch.tensor([w for _, _, w in windows], dtype=torch.float32, device=per_token.device)
    return weighted_samples(window_scores(per_token, windows), counts, rows, weights)


def kept_keys(q: torch.Tensor, layer: LayerIndex, thresholds: list[float], scale: float, rows: int) -> torch.Tensor:
    """[F, Hkv]: the keys each KV head reads under each of the F thresholds, q [Hq, Lq, D] scored once (the reference
    lookup): the keys of the clusters any of its rows keeps (select_clusters), then its dense tail."""
    hkv = layer["counts"].shape[0]
    counts = layer["counts"]  # [Hkv, C]
    _, score = REFERENCE.kernel("centroid").cluster_keep(q, layer["centroids"], counts, scale, 0.0, rows,
                                                         step=code_step(layer))  # [rows, C]
    nonempty = (counts > 0).repeat_interleave(rows // hkv, dim=0)  # [rows, C]
    keep = torch.stack([select_clusters(score, t) for t in thresholds]) & nonempty  # [F, rows, C]
    union = keep.reshape(len(thresholds), hkv, rows // hkv, -1).any(dim=2)  # [F, Hkv, C]: a row of the head keeps it
    return (counts * union).sum(dim=2) + layer.tail


class SqueezePolicy(Method):
    """Squeezed Attention, one level: k-means clusters of the keys, a centroid lookup against one global
    threshold; the fixed K/V stored as an inverted file (each cluster's keys contiguous)."""

    name: ClassVar[str] = "squeeze"
    Settings: ClassVar[type] = SqueezeSettings
    batched_lookup: ClassVar[bool] = True  # one cluster_select

    def build(self, layer: LayerKeys, required: dict[str, Tensors], prepared: Tensors) -> Tensors:
        s = self.settings
        k = num_centroids(layer.keys.shape[1], s.centroid_ratio)
        result = cluster_points(layer.keys, k, s, layer.query_moment)
        return {
            "labels": result.labels,  # [Hkv, Lc]
            **stored_centroids(result.centroids, s, layer.keys.dtype),  # [Hkv, C, D]
            "counts": result.counts,  # [Hkv, C]
            "key_starts": group_starts(result.labels, k),  # [Hkv, C + 1] cluster ranges of the permuted keys
        }

    def calibrate(self, layers: list[CalibrationSet], scale: float) -> Tensors:
        """"threshold": decode's, from every calibration token's S (a token keeps about 1 - s of the keys); with
        prefill_threshold = "calibrated" also "threshold_prefill": the question prefill's, from the prefill score
        (max of the token mean and the last token) of windows of the calibration tokens
        (engine.index.thresholds.prefill_windows), so that a question keeps about 1 - s of the keys too."""
        scores, weights, p_scores, p_weights = [], [], [], []
        for layer in layers:
            hq, hkv = layer.queries.shape[0], layer.index["counts"].shape[0]
            rows = group_rows(self.settings.group, hq, hkv)
            s = per_token_scores(layer.queries, layer.index, scale, rows, REFERENCE)  # [rows, Nc, C]; exact, once
            sample, weight = weighted_samples(s, layer.index["counts"], rows)
            scores.append(sample)
            weights.append(weight)
            if self.settings.prefill_threshold == "calibrated":
                sample, weight = prefill_samples(s, layer.index["counts"], rows, prefill_windows(s.shape[1]))
                p_scores.append(sample)
                p_weights.append(weight)
        out = {"threshold": pooled_thresholds(list(zip(scores, weights)), SPARSITY_GRID)}
        if p_scores:
            out["threshold_prefill"] = pooled_thresholds(list(zip(p_scores, p_weights)), SPARSITY_GRID)
        return out

    def plan_keys(self, calibration: Tensors, budget: float, decode_keys: float, prefill_keys: float) -> ThresholdPlan:
        return threshold_plan(calibration, budget, decode_keys, prefill_keys, ("threshold",))

    def lookup(self, q: torch.Tensor, layer: LayerIndex, plan: ThresholdPlan, scale: float, backend: Backend,
               positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               follow: FollowRows | None = None) -> Lookup:
        """The selection is of positions in the layer's K/V stored permuted by cluster (`layout`);
        layer["key_starts"] says where each cluster lies."""
        hq, hkv = q.shape[0], layer["counts"].shape[0]
        rows = group_rows(self.settings.group, hq, hkv)
        (threshold,) = plan.at(q.shape[1])
        index = centroid_elements(layer, q.element_size())  # every centroid and its count, per KV head
        read = layer.elements(hkv, index, q.device)
        cut = cut_room(plan, q, follow) if rows == hkv else None
        keys = None if cut is None else cut_keys(cut[0], layer, hkv, q.shape[2], hkv * index, cut[1])
        centroid = backend.kernel("centroid")
        if keys is not None and q.device.type == "cpu":  # the exact cut between whole clusters (a sort: nothing
            # beside the CPU's step)
            keep, score = centroid.cluster_keep(q, layer["centroids"], layer["counts"], scale, 0.0, rows,
                                                step=code_step(layer), valid=valid)
            keep = keep & (score > cut_threshold(score, cut_sizes(layer, keys), keys.value(device=q.device)))
            selection = backend.kernel("compact").expand_groups(keep, layer["key_starts"], layer.indexed, layer.tail)
        else:  # the plan's threshold, or a GPU's cut inside the lookup's kernels (whole bins of the scores)
            keep, score, selection = centroid.cluster_select(
                q, layer["centroids"], layer["counts"], scale, threshold, rows, layer["key_starts"], layer.indexed,
                layer.tail, step=code_step(layer), valid=valid, keys=keys)
        return Lookup(selection=selection, index_elements=read, units=keep, scores=score, sizes=layer["counts"])

    def reads(self, q: torch.Tensor, layer: LayerIndex, plans: list[ThresholdPlan], scale: float,
              positions: torch.Tensor | None = None) -> list[float]:
        """Method.reads with one scoring of q for every plan (a cluster's score does not depend on the threshold):
        the keys of the clusters any row of a KV head keeps, the dense tail once per KV head, and the centroids,
        as read_fraction counts the lookup's selection (tests/engine/test_budget.py holds it to the lookups')."""
        hq, hkv, d = q.shape[0], layer["counts"].shape[0], q.shape[2]
        rows = group_rows(self.settings.group, hq, hkv)
        keys = kept_keys(q, layer, [plan.at(q.shape[1])[0] for plan in plans], scale, rows).sum(dim=1)  # [F]
        index = hkv * float(centroid_elements(layer, q.element_size()))
        return [byte_share(float(k), index, hkv, layer.num_keys, d) for k in keys.tolist()]

    def layout(self, layer: LayerIndex) -> ClusterLayout:
        return ClusterLayout.from_labels(layer["labels"], layer["counts"].shape[1], layer.tail)

    def unit_labels(self, layer: LayerIndex) -> torch.Tensor:
        return layer["labels"]
