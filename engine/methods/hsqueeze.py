"""Squeezed Attention, hierarchical: coarse level-1 centroids prune, level-2 scores over the survivors decide (eq. 2, 3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.attention.budget import byte_share, cut_room, cut_threshold
from engine.attention.method import (
    CalibrationSet,
    LayerIndex,
    LayerKeys,
    Lookup,
    Method,
    MethodSettings,
    Tensors,
    group_rows,
)
from engine.index.thresholds import SPARSITY_GRID, pooled_thresholds, prefill_windows, window_scores
from engine.methods.squeeze import (
    ThresholdPlan,
    centroid_elements,
    check_threshold_settings,
    cluster_points,
    code_step,
    cut_keys,
    cut_sizes,
    float_centroids,
    num_centroids,
    prefill_samples,
    row_counts,
    stored_centroids,
    threshold_plan,
    weighted_samples,
)
from kernels.backend import REFERENCE, Backend
from kernels.layout import ClusterLayout, group_starts
from kernels.reference.centroid import row_scores, select_clusters
from kernels.selection import FollowRows


@dataclass(frozen=True)
class HierarchicalSettings(MethodSettings):
    """level1_ratio: level-1 centroids as a fraction of the indexed keys (paper: 1%; at most squeeze's centroids)
    level1_prune: fraction of the keys the level-1 threshold rules out (paper: about half)
    kmeans, kmeans_iters, seed: the level-1 k-means' (of squeeze's centroids, weighted by their sizes); group,
        prefill_threshold: as squeeze's (SqueezeSettings)
    centroids: as squeeze's, for both levels ("int8": one byte each; level 2 is squeeze's centroids, stored again
        in this form whatever squeeze's own)
    level1: how a lookup at a number of keys picks level 1's survivors: "cut" (the best level-1 clusters holding
        1 - level1_prune of the keys, and at least level 2's: a cut of its own, like level 2's) or "threshold"
        (the calibrated level-1 threshold, as at a threshold plan: no cut of its own; level 2's cut still reads the
        budget, among fewer candidates where a question's scores prune more than the calibration's)
    """

    level1_ratio: float = 0.01
    level1_prune: float = 0.5
    kmeans: str = "query"
    kmeans_iters: int = 20
    seed: int = 0
    group: str = "kv"
    prefill_threshold: str = "calibrated"
    centroids: str = "int8"
    level1: str = "cut"

    def __post_init__(self) -> None:
        if self.level1 not in ("cut", "threshold"):
            raise ValueError(f"level1 must be 'cut' or 'threshold', got {self.level1!r}")
        if not 0 < self.level1_ratio <= 1:
            raise ValueError(f"level1_ratio must be in (0, 1], got {self.level1_ratio}")
        if not 0 <= self.level1_prune < 1:
            raise ValueError(f"level1_prune must be in [0, 1), got {self.level1_prune}")
        check_threshold_settings(self)


def level1_prune(sparsity: float, settings: HierarchicalSettings) -> float:
    """Fraction of keys the level-1 threshold rules out for a target sparsity (never more than the target)."""
    return min(sparsity, settings.level1_prune)


def _level2_allowed(level1_keep: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """level1_keep [rows, ..., C1] bool, parent [Hkv, C2] -> [rows, ..., C2]: level-2 clusters under a survivor."""
    rows, hkv = level1_keep.shape[0], parent.shape[0]
    par = parent.repeat_interleave(rows // hkv, dim=0)  # [rows, C2]
    par = par.view(rows, *([1] * (level1_keep.dim() - 2)), -1).expand(*level1_keep.shape[:-1], -1)
    return torch.gather(level1_keep, -1, par)


class HierarchicalSqueezePolicy(Method):
    """Squeezed Attention, hierarchical: squeeze's clusters (level 2) under coarse level-1 centroids."""

    name: ClassVar[str] = "hsqueeze"
    Settings: ClassVar[type] = HierarchicalSettings
    requires: ClassVar[tuple[str, ...]] = ("squeeze",)

    def build(self, layer: LayerKeys, required: dict[str, Tensors], prepared: Tensors) -> Tensors:
        """Cluster squeeze's centroids (level 2) into level-1 centroids, weighted by their sizes, then renumber the
        level-2 clusters so that each level-1 cluster's children are contiguous: the children of the kept level-1
        clusters are then ranges (kernels.layout). Returns its own renumbered labels/centroids/counts too."""
        index, settings = required["squeeze"], self.settings
        c2 = float_centroids(index)  # [Hkv, C2, D]
        k1 = min(c2.shape[1], num_centroids(layer.keys.shape[1], settings.level1_ratio))
        result = cluster_points(c2, k1, settings, layer.query_moment, weights=index["counts"])
        order = torch.argsort(result.labels, dim=1, stable=True)  # [Hkv, C2]: new id -> old id
        new_id = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order).contiguous())
        counts2 = torch.gather(index["counts"], 1, order)
        parent = torch.gather(result.labels, 1, order)  # [Hkv, C2], non-decreasing
        counts1 = torch.zeros_like(result.counts)
        counts1.scatter_add_(1, parent, counts2)  # keys under each level-1 centroid
        labels = torch.gather(new_id, 1, index["labels"])  # [Hkv, Lc] in the new numbering
        return {
            "labels": labels,
            "key_starts": group_starts(labels, c2.shape[1]),
            **stored_centroids(torch.gather(c2, 1, order[:, :, None].expand_as(c2)), settings, layer.keys.dtype),
            "counts": counts2,
            # [Hkv, C1, D] key-weighted means
            **stored_centroids(result.centroids, settings, layer.keys.dtype, prefix="l1_"),
            "l1_counts": counts1,  # [Hkv, C1]
            "l1_parent": parent,  # [Hkv, C2] level-1 cluster of each level-2 cluster
            "l1_child_starts": group_starts(parent, k1),  # [Hkv, C1 + 1] children of c: [starts[c], starts[c+1])
        }

    def _token_scores(self, q, index, t1: float, scale, rows, backend):
        """Calibration view: per token, the level-1 survivors and level-2 S over them.
        Returns (S2 [rows, Lq, C2], allowed2 [rows, Lq, C2] bool)."""
        hq = q.shape[0]
        log1 = backend.kernel("centroid").centroid_log_scores(q, index["l1_centroids"], index["l1_counts"], scale,
                                                              step=code_step(index, "l1_"))
        s1 = row_scores(log1, rows)
        keep1 = select_clusters(s1, t1) & (row_counts(index["l1_counts"], rows)[:, None, :] > 0)
        allowed2 = _level2_allowed(keep1, index["l1_parent"])  # [rows, Lq, C2]
        allowed_hq = allowed2.repeat_interleave(hq // rows, dim=0)
        log2 = backend.kernel("centroid").centroid_log_scores(q, index["centroids"], index["counts"], scale,
                                                              allowed=allowed_hq, step=code_step(index))
        return row_scores(log2, rows), allowed2

    def _window_scores(self, q, index, t1: float, scale, rows, windows, backend):
        """Prefill calibration view: each window of calibration tokens looked up as a question's prefill is: level-1
        survivors by the window's prefill score (max of token mean and last token), level-2 S over the survivors'
        children (eq. 3), reduced the same way. Returns (S2 [rows, W, C2], allowed2 [rows, W, C2] bool)."""
        hq = q.shape[0]
        log1 = backend.kernel("centroid").centroid_log_scores(q, index["l1_centroids"], index["l1_counts"], scale,
                                                              step=code_step(index, "l1_"))
        s1 = row_scores(log1, rows)
        keep1 = select_clusters(window_scores(s1, windows), t1) & (row_counts(index["l1_counts"], rows)[:, None, :] > 0)
        allowed2 = _level2_allowed(keep1, index["l1_parent"])  # [rows, W, C2]
        s2 = []
        for w, (a, b, _) in enumerate(windows):
            allowed_hq = allowed2[:, w].repeat_interleave(hq // rows, dim=0)  # [Hq, C2], the same for every token
            log2 = backend.kernel("centroid").centroid_log_scores(q[:, a:b], index["centroids"], index["counts"],
                                                                  scale, allowed=allowed_hq, step=code_step(index))
            s2.append(window_scores(row_scores(log2, rows), [(0, b - a, 1.0)])[:, 0])
        return torch.stack(s2, dim=1), allowed2

    def calibrate(self, layers: list[CalibrationSet], scale: float) -> Tensors:
        """Decode's "threshold_l1" / "threshold_l2" from every calibration token's S; with settings.prefill_threshold
        = "calibrated" also the question prefill's "threshold_l1_prefill" / "threshold_l2_prefill" from the prefill
        score of windows of the calibration tokens (engine.index.thresholds.prefill_windows), each level as squeeze
        calibrates its two."""
        settings = self.settings
        # Level 1: the threshold that rules out min(s, settings.level1_prune) of the keys.
        l1_sparsities = [level1_prune(s, settings) for s in SPARSITY_GRID]
        prefill = settings.prefill_threshold == "calibrated"
        s1_all, w1_all, p1_all, pw1_all = [], [], [], []
        for layer in layers:
            hq, hkv = layer.queries.shape[0], layer.index["l1_counts"].shape[0]
            rows = group_rows(settings.group, hq, hkv)
            log1 = REFERENCE.kernel("centroid").centroid_log_scores(
                layer.queries, layer.index["l1_centroids"], layer.index["l1_counts"], scale,
                step=code_step(layer.index, "l1_"))
            s1 = row_scores(log1, rows)
            sample, weight = weighted_samples(s1, layer.index["l1_counts"], rows)
            s1_all.append(sample)
            w1_all.append(weight)
            if prefill:
                sample, weight = prefill_samples(s1, layer.index["l1_counts"], rows, prefill_windows(s1.shape[1]))
                p1_all.append(sample)
                pw1_all.append(weight)
        t1 = pooled_thresholds(list(zip(s1_all, w1_all)), l1_sparsities)
        t1p = pooled_thresholds(list(zip(p1_all, pw1_all)), l1_sparsities) if prefill else None
        # Level 2: for each grid point, the threshold over the survivors' scores (pruned clusters count as 0). The
        # survivors depend on the level-1 threshold alone, which most grid points share (those past level1_prune):
        # the scores are taken once per distinct level-1 threshold, for all its grid points at once.
        out = {"threshold_l1": t1, "threshold_l2": self._level2_thresholds(layers, t1, scale, False)}
        if prefill:
            out.update(threshold_l1_prefill=t1p, threshold_l2_prefill=self._level2_thresholds(layers, t1p, scale, True))
        return out

    def _level2_thresholds(self, layers: list[CalibrationSet], t1: torch.Tensor, scale: float,
                           prefill: bool) -> torch.Tensor:
        """[len(SPARSITY_GRID)] float64: at each grid point, the level-2 threshold pooled over the layers' samples of
        the survivors of t1 at that point (a question's windows with `prefill`, else single tokens)."""
        t2 = torch.zeros(len(SPARSITY_GRID), dtype=torch.float64)
        for level1 in sorted({float(t) for t in t1}):
            points = [i for i, t in enumerate(t1) if float(t) == level1]
            scores, weights = [], []
            for layer in layers:
                hq, hkv = layer.queries.shape[0], layer.index["counts"].shape[0]
                rows = group_rows(self.settings.group, hq, hkv)
                if prefill:
                    windows = prefill_windows(layer.queries.shape[1])
                    s2, allowed2 = self._window_scores(layer.queries, layer.index, level1, scale, rows, windows,
                                                       REFERENCE)
                    per_score = torch.tensor([w for _, _, w in windows], dtype=torch.float32, device=s2.device)
                    sample, weight = weighted_samples(torch.where(allowed2, s2, torch.zeros_like(s2)),
                                                      layer.index["counts"], rows, per_score)
                else:
                    s2, allowed2 = self._token_scores(layer.queries, layer.index, level1, scale, rows, REFERENCE)
                    sample, weight = weighted_samples(torch.where(allowed2, s2, torch.zeros_like(s2)),
                                                      layer.index["counts"], rows)
                scores.append(sample)
                weights.append(weight)
            pooled = pooled_thresholds(list(zip(scores, weights)), [SPARSITY_GRID[i] for i in points])
            t2[points] = pooled.to(torch.float64).cpu()
        return t2

    def plan_keys(self, calibration: Tensors, budget: float, decode_keys: float, prefill_keys: float) -> ThresholdPlan:
        """decode's (T1, T2) and the question prefill's (its own where calibrated, else decode's)."""
        return threshold_plan(calibration, budget, decode_keys, prefill_keys, ("threshold_l1", "threshold_l2"))

    def lookup(self, q: torch.Tensor, layer: LayerIndex, plan: ThresholdPlan, scale: float, backend: Backend,
               positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               follow: FollowRows | None = None) -> Lookup:
        """Level 1 over all C1 centroids; level 2 only over the kept level-1 clusters' children (eq. 3); the
        layer's K/V are stored permuted by cluster (`layout`), layer["key_starts"] says where."""
        hq, hkv = q.shape[0], layer["counts"].shape[0]
        rows = group_rows(self.settings.group, hq, hkv)
        c2 = layer["centroids"].shape[1]
        t1, t2 = plan.at(q.shape[1])
        centroid = backend.kernel("centroid")
        cut = cut_room(plan, q, follow) if rows == hkv else None
        exact = cut is not None and q.device.type == "cpu"  # the CPU cuts between whole clusters (a sort); a GPU
        # inside the lookups' kernels (whole bins of the scores' histogram)
        keys1 = None
        if cut is not None and self.settings.level1 == "cut":  # the best level-1 clusters up to the keys level 1
            # keeps at this room (at least level 2's)
            room = cut[0]
            share = 1.0 - level1_prune(1.0 - room, self.settings)
            keys1 = cut_keys(room, layer, hkv, q.shape[2], hkv * centroid_elements(layer, q.element_size()),
                             cut[1]).at_least(share * hkv * layer.indexed)  # at least level 2's keys and this share
        if exact and keys1 is not None:
            keep1, score1 = centroid.cluster_keep(q, layer["l1_centroids"], layer["l1_counts"], scale, 0.0, rows,
                                                  step=code_step(layer, "l1_"), valid=valid)
            keep1 = keep1 & (score1 > cut_threshold(score1, layer["l1_counts"], keys1.value(device=q.device)))
            candidates = backend.kernel("compact").expand_groups(keep1, layer["l1_child_starts"], c2)
        else:
            _, _, candidates = centroid.cluster_select(q, layer["l1_centroids"], layer["l1_counts"], scale, t1, rows,
                                                       layer["l1_child_starts"], c2, step=code_step(layer, "l1_"),
                                                       valid=valid, keys=keys1)  # level-2 ids
        key_size = q.element_size()  # q has the keys' dtype in the engine
        # [Hkv] elements read: level 1's centroids, and the level-2 ones scored (an affine count of the candidates,
        # written by the level-2 score pass on a GPU: no launches of its own)
        base = centroid_elements(layer, key_size, "l1_") + centroid_elements(layer, key_size, scored=0)
        per = centroid_elements(layer, key_size, scored=1) - centroid_elements(layer, key_size, scored=0)
        # the room's keys, less what this level-2 lookup reads of the index (its elements, counted by its kernels)
        keys2 = None if cut is None else cut_keys(cut[0], layer, hkv, q.shape[2], 0.0, cut[1],
                                                  per_read=1.0 / (2 * q.shape[2]))
        if exact:  # the candidates' best level-2 clusters up to the room's keys
            keep, score, read = centroid.cluster_keep_among(q, layer["centroids"], layer["counts"], scale, 0.0, rows,
                                                            candidates, step=code_step(layer), valid=valid,
                                                            read=(base, per))
            keep = keep & (score > cut_threshold(score, cut_sizes(layer, keys2) * keep, keys2.value(read, q.device)))
            selection = backend.kernel("compact").expand_groups(keep, layer["key_starts"], layer.indexed, layer.tail)
        else:  # (a GPU's cut sums the kept keys per block for the expansion as it decides them)
            keep, score, read, selection = centroid.cluster_select_among(
                q, layer["centroids"], layer["counts"], scale, t2 if cut is None else 0.0, rows, candidates,
                layer["key_starts"], layer.indexed, layer.tail, step=code_step(layer), valid=valid, read=(base, per),
                keys=keys2)
        return Lookup(selection=selection, index_elements=read, units=keep, scores=score, sizes=layer["counts"])

    def reads(self, q: torch.Tensor, layer: LayerIndex, plans: list[ThresholdPlan], scale: float,
              positions: torch.Tensor | None = None) -> list[float]:
        """Method.reads with level 1 scored once for every plan and level 2 once per distinct level-1 threshold
        (the survivors' children set its denominator): the keys of the level-2 clusters any row of a KV head keeps,
        the dense tail once per KV head, the level-1 centroids and the scored level-2 ones, as read_fraction counts
        the lookup's selection (tests/engine/test_budget.py holds it to the lookups')."""
        hq, hkv, d = q.shape[0], layer["counts"].shape[0], q.shape[2]
        rows = group_rows(self.settings.group, hq, hkv)
        ref, counts, key_size = REFERENCE.kernel("centroid"), layer["counts"], q.element_size()
        _, s1 = ref.cluster_keep(q, layer["l1_centroids"], layer["l1_counts"], scale, 0.0, rows,
                                 step=code_step(layer, "l1_"))  # [rows, C1]
        nonempty1, nonempty2 = row_counts(layer["l1_counts"], rows) > 0, row_counts(counts, rows) > 0
        level2: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
        out = []
        for plan in plans:
            t1, t2 = plan.at(q.shape[1])
            if t1 not in level2:
                allowed = _level2_allowed(select_clusters(s1, t1) & nonempty1, layer["l1_parent"])  # [rows, C2]
                _, s2 = ref.cluster_keep(q, layer["centroids"], counts, scale, 0.0, rows, allowed=allowed,
                                         step=code_step(layer))
                level2[t1] = allowed, s2
            allowed, s2 = level2[t1]
            keep = select_clusters(s2, t2) & nonempty2 & allowed
            union = keep.reshape(hkv, rows // hkv, -1).any(dim=1)  # [Hkv, C2]: a row of the head keeps it
            keys = float((counts * union).sum()) + hkv * layer.tail
            survivors = allowed.reshape(hkv, -1).sum(dim=1).double()  # [Hkv] level-2 centroids scored
            index = hkv * centroid_elements(layer, key_size, "l1_") + float(
                centroid_elements(layer, key_size, scored=survivors).sum())
            out.append(byte_share(keys, index, hkv, layer.num_keys, d))
        return out

    def layout(self, layer: LayerIndex) -> ClusterLayout:
        return ClusterLayout.from_labels(layer["labels"], layer["counts"].shape[1], layer.tail)

    def unit_labels(self, layer: LayerIndex) -> torch.Tensor:
        return layer["labels"]
