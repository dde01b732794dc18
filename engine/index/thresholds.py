"""One global threshold per target sparsity, from the calibration queries of every layer and head."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

MAX_CALIBRATION_SCORES = 1 << 25  # scores kept for the quantile; larger sets are subsampled with a fixed seed
WINDOWS_PER_LENGTH = 8  # prefill calibration: windows of each question length taken from the calibration queries


# Calibrated sparsities: a requested sparsity maps to its threshold by interpolation between these points.
SPARSITY_GRID = (0.0, 0.3, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.97, 0.98, 0.99)


def weighted_thresholds(scores: torch.Tensor, weights: torch.Tensor, sparsities: Sequence[float]) -> torch.Tensor:
    """Thresholds T_s such that clusters with score <= T_s hold a fraction s of the total weight (keys).

    scores: [M] estimated attention S of (row, query, cluster) triples; weights: [M] keys in each cluster.
    A cluster is kept when S > T, so T_s prunes about a fraction s of the keys. s = 0 gives T = 0 (keep all).
    Returns [len(sparsities)] float64.
    """
    scores, weights = scores.reshape(-1), weights.reshape(-1)
    if scores.numel() > MAX_CALIBRATION_SCORES:  # a uniform sample (with replacement), drawn where the scores are
        gen = torch.Generator(device=scores.device).manual_seed(0)
        pick = torch.randint(scores.numel(), (MAX_CALIBRATION_SCORES,), generator=gen, device=scores.device)
        scores, weights = scores[pick], weights[pick]
    scores, weights = scores.double(), weights.double()
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


def pooled_thresholds(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], sparsities: Sequence[float],
                      max_samples: int = MAX_CALIBRATION_SCORES) -> torch.Tensor:
    """`weighted_thresholds` of the concatenated (scores, weights) parts (one per layer), without concatenating
    them when they hold more than `max_samples` scores: each part then gives a uniform sample (with replacement,
    drawn where it lies) in proportion to its size, and only the samples are joined. At 128K tokens the parts of
    one calibration hold ~170M scores (the Llama-3-8B shape), whose concatenation cost gigabytes of GPU memory
    at the ingest's peak. Parts under the limit are used whole, as before."""
    total = sum(scores.numel() for scores, _ in parts)
    if total <= max_samples:
        return weighted_thresholds(torch.cat([s.reshape(-1) for s, _ in parts]),
                                   torch.cat([w.reshape(-1) for _, w in parts]), sparsities)
    picked_scores, picked_weights = [], []
    for i, (scores, weights) in enumerate(parts):
        n = scores.numel() * max_samples // total
        gen = torch.Generator(device=scores.device).manual_seed(i)
        pick = torch.randint(scores.numel(), (n,), generator=gen, device=scores.device)
        picked_scores.append(scores.reshape(-1)[pick])
        picked_weights.append(weights.reshape(-1)[pick])
    return weighted_thresholds(torch.cat(picked_scores), torch.cat(picked_weights), sparsities)


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


def prefill_windows(n: int, per_length: int = WINDOWS_PER_LENGTH) -> list[tuple[int, int, float]]:
    """Stand-ins for questions among n calibration tokens: (start, end, weight) windows [start, end).

    Lengths 2, 4, 8, ... below n, and n itself (a question's prefill lookup scores S by max(token mean, last token),
    whose kept fraction at a fixed threshold grows with the question's length and levels off beyond a few dozen
    tokens); of each length up to `per_length` windows with evenly spaced ends, the last ending at n. Each window
    weighs 1 / (windows of its length), so every length counts the same. n = 1 gives the one token, as a decode.
    """
    if n < 1:
        raise ValueError(f"need at least one calibration token, got {n}")
    if n == 1:
        return [(0, 1, 1.0)]
    lengths, w = [], 2
    while w < n:
        lengths.append(w)
        w *= 2
    lengths.append(n)
    out = []
    for w in lengths:
        count = min(per_length, n - w + 1)
        ends = sorted({n - round(i * (n - w) / max(count - 1, 1)) for i in range(count)})
        out += [(end - w, end, 1.0 / len(ends)) for end in ends]
    return out


def window_scores(per_token: torch.Tensor, windows: Sequence[tuple[int, int, float]]) -> torch.Tensor:
    """The prefill lookup's score (kernels.reference.reduce_scores) of each window: per_token [rows, Nc, C] S ->
    [rows, W, C] max(mean of S over the window's tokens, S of its last token)."""
    return torch.stack([torch.maximum(per_token[:, a:b].mean(dim=1), per_token[:, b - 1]) for a, b, _ in windows], dim=1)
