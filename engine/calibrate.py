"""One global threshold per target sparsity, from the calibration queries of every layer and head."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.config import SPARSITY_GRID

MAX_CALIBRATION_SCORES = 1 << 25  # scores kept for the quantile; larger sets are subsampled with a fixed seed


def weighted_thresholds(scores: torch.Tensor, weights: torch.Tensor, sparsities: Sequence[float]) -> torch.Tensor:
    """Thresholds T_s such that clusters with score <= T_s hold a fraction s of the total weight (keys).

    scores: [M] estimated attention S of (row, query, cluster) triples; weights: [M] keys in each cluster.
    A cluster is kept when S > T, so T_s prunes about a fraction s of the keys. s = 0 gives T = 0 (keep all).
    Returns [len(sparsities)] float64.
    """
    scores, weights = scores.reshape(-1).double(), weights.reshape(-1).double()
    if scores.numel() > MAX_CALIBRATION_SCORES:
        gen = torch.Generator().manual_seed(0)
        pick = torch.randperm(scores.numel(), generator=gen)[:MAX_CALIBRATION_SCORES].to(scores.device)
        scores, weights = scores[pick], weights[pick]
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    cum = torch.cumsum(weights[order], dim=0)
    total = cum[-1]
    out = []
    for s in sparsities:
        if s <= 0:
            out.append(0.0)
            continue
        i = int(torch.searchsorted(cum, s * total).clamp(max=cum.numel() - 1))
        out.append(float(sorted_scores[i]))
    return torch.tensor(out, dtype=torch.float64)


def threshold_at(thresholds: torch.Tensor, sparsity: float, grid: Sequence[float] = SPARSITY_GRID) -> float:
    """Map a sparsity to its threshold by interpolating the calibrated grid (log-linear between positive points)."""
    if not 0.0 <= sparsity <= grid[-1]:
        raise ValueError(f"sparsity must be in [0, {grid[-1]}], got {sparsity}")
    values = thresholds.tolist()
    for i in range(len(grid) - 1):
        lo, hi = grid[i], grid[i + 1]
        if lo <= sparsity <= hi:
            t = (sparsity - lo) / (hi - lo)
            a, b = values[i], values[i + 1]
            if t in (0.0, 1.0):  # exactly a calibrated point
                return a if t == 0.0 else b
            if a > 0 and b > 0:
                return math.exp((1 - t) * math.log(a) + t * math.log(b))
            return (1 - t) * a + t * b
    return values[-1]
