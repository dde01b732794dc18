"""Squeezed Attention, single level: k-means key clusters, a centroid lookup against one global threshold."""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.calibrate import threshold_at, weighted_thresholds
from engine.config import SPARSITY_GRID, IndexSettings
from engine.kmeans import spherical_kmeans
from engine.policies.base import CalibrationSet, LayerIndex, Lookup, Policy, group_rows
from kernels.dispatch import Backend
from kernels.layout import group_starts
from kernels.reference import row_scores


def per_token_scores(q: torch.Tensor, index: LayerIndex, scale: float, rows: int, backend: Backend) -> torch.Tensor:
    """Calibration view of eq. 1: S for every query token, averaged over the query heads of a row.

    q: [Hq, Nc, D] -> [rows, Nc, C].
    """
    return row_scores(backend.centroid_log_scores(q, index["centroids"], index["counts"], scale), rows)


def row_counts(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """counts [Hkv, C] -> [rows, C]: each row's KV head's cluster sizes."""
    return counts.repeat_interleave(rows // counts.shape[0], dim=0)


def weighted_samples(s: torch.Tensor, counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration samples: every (row, token, cluster) score, weighted by the cluster's keys.

    s: [rows, Nc, C]; counts: [Hkv, C] -> (scores [rows * Nc * C], weights, same shape, float32).
    """
    return s.reshape(-1), row_counts(counts, rows)[:, None, :].expand_as(s).reshape(-1).float()


class SqueezePolicy(Policy):
    name: ClassVar[str] = "squeeze"

    def build(self, keys: torch.Tensor, settings: IndexSettings, index: LayerIndex) -> LayerIndex:
        k = settings.num_centroids(keys.shape[1])
        result = spherical_kmeans(keys, k, iters=settings.kmeans_iters, seed=settings.seed)
        return {
            "labels": result.labels,  # [Hkv, Lc]
            "centroids": result.centroids.to(keys.dtype),  # [Hkv, C, D]
            "counts": result.counts,  # [Hkv, C]
            "key_starts": group_starts(result.labels, k),  # [Hkv, C + 1] cluster ranges of the permuted keys
        }

    def calibrate(self, layers: list[CalibrationSet], scale: float, settings: IndexSettings) -> dict[str, torch.Tensor]:
        from kernels.dispatch import REFERENCE  # calibration runs once; the reference is exact

        scores, weights = [], []
        for layer in layers:
            hq, hkv = layer.queries.shape[0], layer.index["counts"].shape[0]
            rows = group_rows(settings, hq, hkv)
            s = per_token_scores(layer.queries, layer.index, scale, rows, REFERENCE)  # [rows, Nc, C]
            sample, weight = weighted_samples(s, layer.index["counts"], rows)
            scores.append(sample)
            weights.append(weight)
        return {"threshold": weighted_thresholds(torch.cat(scores), torch.cat(weights), SPARSITY_GRID)}

    def thresholds(self, calibration: dict[str, torch.Tensor], sparsity: float) -> tuple[float, ...]:
        return (threshold_at(calibration["threshold"], sparsity),)

    def lookup(self, q, index, thresholds, scale, settings, backend) -> Lookup:
        """The selection is of positions in the layer's K/V stored permuted by cluster (kernels.layout.ClusterLayout);
        index["key_starts"] says where each cluster lies."""
        hq, hkv = q.shape[0], index["counts"].shape[0]
        rows = group_rows(settings, hq, hkv)
        keep, score, selection = backend.cluster_select(q, index["centroids"], index["counts"], scale, thresholds[0],
                                                        rows, index["key_starts"], index["labels"].shape[1],
                                                        settings.dense_tail)
        c, d = index["centroids"].shape[1:]
        read = torch.full((hkv,), float(c * (d + 1)), device=q.device)  # every centroid and its count
        return Lookup(
            selection=selection,
            clusters=keep,
            index_elements=read,
            scores=score,
        )
