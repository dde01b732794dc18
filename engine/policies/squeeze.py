"""Squeezed Attention, single level: k-means key clusters, a centroid lookup against one global threshold."""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.calibrate import pooled_thresholds, prefill_windows, threshold_at, window_scores
from engine.config import SPARSITY_GRID, IndexSettings
from engine.kmeans import spherical_kmeans
from engine.policies.base import CalibrationSet, LayerIndex, Lookup, Policy, group_rows, step_thresholds
from kernels.backend import Backend
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
    cluster's keys and the window's weight. per_token: [rows, Nc, C] S; windows: engine.calibrate.prefill_windows."""
    weights = torch.tensor([w for _, _, w in windows], dtype=torch.float32, device=per_token.device)
    return weighted_samples(window_scores(per_token, windows), counts, rows, weights)


class SqueezePolicy(Policy):
    name: ClassVar[str] = "squeeze"
    levels: ClassVar[int] = 1

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
        """"threshold": decode's, from every calibration token's S (a token keeps about 1 - s of the keys); with
        settings.prefill_threshold = "calibrated" also "threshold_prefill": the question prefill's, from the prefill
        score (max of the token mean and the last token) of windows of the calibration tokens
        (engine.calibrate.prefill_windows), so that a question keeps about 1 - s of the keys too, not the union of
        what its mean and its last token pass at decode's."""
        from kernels.backend import REFERENCE  # calibration runs once; the reference is exact

        scores, weights, p_scores, p_weights = [], [], [], []
        for layer in layers:
            hq, hkv = layer.queries.shape[0], layer.index["counts"].shape[0]
            rows = group_rows(settings, hq, hkv)
            s = per_token_scores(layer.queries, layer.index, scale, rows, REFERENCE)  # [rows, Nc, C]
            sample, weight = weighted_samples(s, layer.index["counts"], rows)
            scores.append(sample)
            weights.append(weight)
            if settings.prefill_threshold == "calibrated":
                sample, weight = prefill_samples(s, layer.index["counts"], rows, prefill_windows(s.shape[1]))
                p_scores.append(sample)
                p_weights.append(weight)
        out = {"threshold": pooled_thresholds(list(zip(scores, weights)), SPARSITY_GRID)}
        if p_scores:
            out["threshold_prefill"] = pooled_thresholds(list(zip(p_scores, p_weights)), SPARSITY_GRID)
        return out

    def thresholds(self, calibration: dict[str, torch.Tensor], sparsity: float) -> tuple[float, ...]:
        """(decode's T, the question prefill's T), or (decode's T,) for a calibration without the latter
        (prefill_threshold = "decode"), which `step_thresholds` then uses in both phases."""
        out = (threshold_at(calibration["threshold"], sparsity),)
        if "threshold_prefill" in calibration:
            out += (threshold_at(calibration["threshold_prefill"], sparsity),)
        return out

    def lookup(self, q, index, thresholds, scale, settings, backend) -> Lookup:
        """The selection is of positions in the layer's K/V stored permuted by cluster (kernels.layout.ClusterLayout);
        index["key_starts"] says where each cluster lies."""
        hq, hkv = q.shape[0], index["counts"].shape[0]
        rows = group_rows(settings, hq, hkv)
        (threshold,) = step_thresholds(thresholds, self.levels, q.shape[1], settings)
        keep, score, selection = backend.cluster_select(q, index["centroids"], index["counts"], scale, threshold,
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
