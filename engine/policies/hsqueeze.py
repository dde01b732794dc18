"""Squeezed Attention, hierarchical: coarse level-1 centroids prune, level-2 scores over the survivors decide (eq. 2, 3)."""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.calibrate import threshold_at, weighted_thresholds
from engine.config import LEVEL1_PRUNE, SPARSITY_GRID, IndexSettings
from engine.kmeans import spherical_kmeans
from engine.policies.base import CalibrationSet, LayerIndex, Lookup, Policy, group_rows
from engine.policies.squeeze import row_counts
from kernels.dispatch import Backend
from kernels.reference import clusters_to_keys, reduce_scores, row_scores, select_clusters


def level1_prune(sparsity: float) -> float:
    """Fraction of keys the level-1 threshold rules out for a target sparsity (never more than the target)."""
    return min(sparsity, LEVEL1_PRUNE)


def _level2_allowed(level1_keep: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """level1_keep [rows, ..., C1] bool, parent [Hkv, C2] -> [rows, ..., C2]: level-2 clusters under a survivor."""
    rows, hkv = level1_keep.shape[0], parent.shape[0]
    par = parent.repeat_interleave(rows // hkv, dim=0)  # [rows, C2]
    par = par.view(rows, *([1] * (level1_keep.dim() - 2)), -1).expand(*level1_keep.shape[:-1], -1)
    return torch.gather(level1_keep, -1, par)


class HierarchicalSqueezePolicy(Policy):
    name: ClassVar[str] = "hsqueeze"

    def build(self, keys: torch.Tensor, settings: IndexSettings, index: LayerIndex) -> LayerIndex:
        """Cluster the level-2 centroids (from `squeeze`) into level-1 centroids, weighted by their sizes."""
        c2 = index["centroids"]  # [Hkv, C2, D]
        k1 = min(c2.shape[1], settings.num_centroids(keys.shape[1], settings.level1_ratio))
        result = spherical_kmeans(c2, k1, iters=settings.kmeans_iters, seed=settings.seed, weights=index["counts"])
        counts1 = torch.zeros_like(result.counts)
        counts1.scatter_add_(1, result.labels, index["counts"])  # keys under each level-1 centroid
        return {
            "l1_centroids": result.centroids.to(keys.dtype),  # [Hkv, C1, D] key-weighted means
            "l1_counts": counts1,  # [Hkv, C1]
            "l1_parent": result.labels,  # [Hkv, C2] level-1 cluster of each level-2 cluster
        }

    def _scores(self, q, index, t1: float, scale, rows, backend, per_token: bool):
        """Level-1 survivors and level-2 S over them. Returns (S2 [rows, (Lq,) C2], allowed2 same shape)."""
        hq = q.shape[0]
        log1 = backend.centroid_log_scores(q, index["l1_centroids"], index["l1_counts"], scale)  # [Hq, Lq, C1]
        s1 = row_scores(log1, rows) if per_token else reduce_scores(log1, rows)  # [rows, (Lq,) C1]
        keep1 = select_clusters(s1, t1) & (row_counts(index["l1_counts"], rows).view(rows, *([1] * (s1.dim() - 2)), -1) > 0)
        allowed2 = _level2_allowed(keep1, index["l1_parent"])  # [rows, (Lq,) C2]
        allowed_hq = allowed2.repeat_interleave(hq // rows, dim=0)
        log2 = backend.centroid_log_scores(q, index["centroids"], index["counts"], scale, allowed=allowed_hq)
        s2 = row_scores(log2, rows) if per_token else reduce_scores(log2, rows)
        return s2, allowed2

    def calibrate(self, layers: list[CalibrationSet], scale: float, settings: IndexSettings) -> dict[str, torch.Tensor]:
        from kernels.dispatch import REFERENCE

        # Level 1: the threshold that rules out min(s, LEVEL1_PRUNE) of the keys.
        s1_all, w1_all = [], []
        for layer in layers:
            hq, hkv = layer.queries.shape[0], layer.index["l1_counts"].shape[0]
            rows = group_rows(settings, hq, hkv)
            log1 = REFERENCE.centroid_log_scores(layer.queries, layer.index["l1_centroids"], layer.index["l1_counts"], scale)
            s1 = row_scores(log1, rows)
            s1_all.append(s1.reshape(-1))
            w1_all.append(row_counts(layer.index["l1_counts"], rows)[:, None, :].expand_as(s1).reshape(-1))
        t1 = weighted_thresholds(torch.cat(s1_all), torch.cat(w1_all).float(), [level1_prune(s) for s in SPARSITY_GRID])
        # Level 2: for each grid point, the threshold over the survivors' scores (pruned clusters count as 0).
        t2 = []
        for i, sparsity in enumerate(SPARSITY_GRID):
            scores, weights = [], []
            for layer in layers:
                hq, hkv = layer.queries.shape[0], layer.index["counts"].shape[0]
                rows = group_rows(settings, hq, hkv)
                s2, allowed2 = self._scores(layer.queries, layer.index, float(t1[i]), scale, rows, REFERENCE, True)
                scores.append(torch.where(allowed2, s2, torch.zeros_like(s2)).reshape(-1))
                weights.append(row_counts(layer.index["counts"], rows)[:, None, :].expand_as(s2).reshape(-1))
            t2.append(float(weighted_thresholds(torch.cat(scores), torch.cat(weights).float(), [sparsity])[0]))
        return {"threshold_l1": t1, "threshold_l2": torch.tensor(t2, dtype=torch.float64)}

    def thresholds(self, calibration: dict[str, torch.Tensor], sparsity: float) -> tuple[float, ...]:
        return (threshold_at(calibration["threshold_l1"], sparsity), threshold_at(calibration["threshold_l2"], sparsity))

    def lookup(self, q, index, thresholds, scale, settings, backend) -> Lookup:
        hq, hkv = q.shape[0], index["counts"].shape[0]
        rows = group_rows(settings, hq, hkv)
        s2, allowed2 = self._scores(q, index, thresholds[0], scale, rows, backend, per_token=False)
        keep = allowed2 & select_clusters(s2, thresholds[1]) & (row_counts(index["counts"], rows) > 0)
        c1, d = index["l1_centroids"].shape[1:]
        survivors = allowed2.reshape(hkv, rows // hkv, -1).any(dim=1).sum(dim=1).float()  # [Hkv] level-2 read
        return Lookup(
            selection=clusters_to_keys(keep, index["labels"], settings.dense_tail),
            clusters=keep,
            index_elements=(c1 + survivors) * (d + 1),
        )
