"""engine.index.thresholds: weighted quantile thresholds and their interpolation over the sparsity grid."""

from __future__ import annotations

import math

import pytest
import torch

from engine.index.thresholds import (
    SPARSITY_GRID,
    pooled_thresholds,
    prefill_windows,
    threshold_at,
    weighted_thresholds,
    window_scores,
)
from kernels.reference.centroid import reduce_scores, select_clusters


def scores_and_weights(m=400, seed=0):
    """Distinct positive scores (no ties) and integer weights 1..20 (sums are exact in float64)."""
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randperm(m, generator=g).double() + 1) / (10 * m) * torch.rand(1, generator=g).add(0.5)
    weights = torch.randint(1, 21, (m,), generator=g).double()
    return scores.float(), weights.float()


SPARSITIES = [0.05, 0.3, 0.5, 0.7, 0.9, 0.99]


def test_pruned_weight_fraction_is_within_one_element_of_target():
    scores, weights = scores_and_weights()
    total = weights.double().sum().item()
    thresholds = weighted_thresholds(scores, weights, SPARSITIES)
    assert thresholds.dtype == torch.float64 and thresholds.shape == (len(SPARSITIES),)
    for s, t in zip(SPARSITIES, thresholds.tolist()):
        at_t = scores.double() == t
        assert at_t.sum() == 1, "the threshold is one of the scores"
        pruned = weights.double()[scores.double() <= t].sum().item()  # kept means S > T
        below = pruned - weights.double()[at_t].item()  # pruned weight without the threshold's own element
        # T is the first score whose cumulative weight reaches s * total: within one element of the target, from above.
        assert below < s * total <= pruned, (s, below / total, pruned / total)
        assert abs(pruned / total - s) <= weights.max().item() / total


def test_pruned_fraction_with_the_lookup_rule():
    """Through select_clusters (kept iff S > T) the kept weight is about 1 - s."""
    scores, weights = scores_and_weights(m=1000, seed=1)
    total = weights.double().sum().item()
    for s, t in zip(SPARSITIES, weighted_thresholds(scores, weights, SPARSITIES).tolist()):
        kept = weights.double()[select_clusters(scores, t)].sum().item() / total
        assert abs(kept - (1 - s)) <= weights.max().item() / total


def test_zero_sparsity_gives_zero_and_keeps_everything():
    scores, weights = scores_and_weights(seed=2)
    thresholds = weighted_thresholds(scores, weights, [0.0, 0.5])
    assert thresholds[0].item() == 0.0
    assert select_clusters(scores, thresholds[0].item()).all()
    # Also when some scores are exactly zero (e.g. clusters pruned at level 1 in the hierarchical calibration).
    scores[:50] = 0.0
    assert weighted_thresholds(scores, weights, [0.0])[0].item() == 0.0
    assert select_clusters(scores, 0.0).all()


def test_monotone_in_sparsity():
    scores, weights = scores_and_weights(seed=3)
    grid = torch.linspace(0, 1, 101).tolist()
    thresholds = weighted_thresholds(scores, weights, grid)
    assert (thresholds[1:] >= thresholds[:-1]).all()
    assert thresholds[-1].item() == scores.double().max().item()  # s = 1 prunes everything
    full_grid = weighted_thresholds(scores, weights, SPARSITY_GRID)
    assert (full_grid[1:] >= full_grid[:-1]).all()


def test_uniform_weights_is_the_plain_quantile():
    scores = torch.arange(1, 101).float() / 100  # 0.01 .. 1.00
    weights = torch.ones(100)
    thresholds = weighted_thresholds(scores[torch.randperm(100)], weights, [0.1, 0.5, 0.9])
    # the 10th, 50th, 90th smallest: exactly s * 100 of the 100 unit-weight scores are <= T
    assert thresholds.tolist() == [scores[9].item(), scores[49].item(), scores[89].item()]


# ---------------------------------------------------------------- threshold_at

# A calibrated grid: 0 at sparsity 0 (keep all), then increasing positive thresholds.
GRID_THRESHOLDS = torch.tensor([0.0] + [1e-4 * 1.7**i for i in range(1, len(SPARSITY_GRID))], dtype=torch.float64)
# exp(log(T)) is T to within an ulp or two: the log-linear interpolation is not bit-exact at grid points (see the
# strict xfail below), so "exact" here means to 1e-12 relative.
GRID_RTOL = 1e-12


def test_threshold_at_grid_points():
    for s, t in zip(SPARSITY_GRID, GRID_THRESHOLDS.tolist()):
        assert math.isclose(threshold_at(GRID_THRESHOLDS, s), t, rel_tol=GRID_RTOL, abs_tol=0.0), s
    assert threshold_at(GRID_THRESHOLDS, 0.0) == 0.0


def test_threshold_at_grid_points_bit_exact():
    for s, t in zip(SPARSITY_GRID, GRID_THRESHOLDS.tolist()):
        assert threshold_at(GRID_THRESHOLDS, s) == t, s


def test_threshold_at_interpolates_between_neighbours():
    values = GRID_THRESHOLDS.tolist()
    for i in range(len(SPARSITY_GRID) - 1):
        lo, hi = SPARSITY_GRID[i], SPARSITY_GRID[i + 1]
        for frac in (0.25, 0.5, 0.9):
            s = lo + frac * (hi - lo)
            t = threshold_at(GRID_THRESHOLDS, s)
            assert values[i] <= t <= values[i + 1], (s, t)
            if values[i] > 0:  # log-linear between positive points: the geometric interpolation
                want = values[i] ** (1 - frac) * values[i + 1] ** frac
            else:  # linear from a zero threshold
                want = (1 - frac) * values[i] + frac * values[i + 1]
            # frac is recomputed from s in floating point by the code: agreement to ~1e-12 relative
            assert math.isclose(t, want, rel_tol=1e-9), (s, t, want)


def test_threshold_at_is_monotone_on_a_monotone_grid():
    sparsities = [SPARSITY_GRID[-1] * i / 199 for i in range(200)]
    values = [threshold_at(GRID_THRESHOLDS, s) for s in sparsities]
    assert all(b >= a for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("sparsity", [-0.01, -1.0, 0.995, 1.0, 2.0, float("nan")])
def test_threshold_at_rejects_out_of_range(sparsity):
    with pytest.raises(ValueError):
        threshold_at(GRID_THRESHOLDS, sparsity)


def test_threshold_at_accepts_the_range_ends():
    assert threshold_at(GRID_THRESHOLDS, 0.0) == 0.0
    assert math.isclose(threshold_at(GRID_THRESHOLDS, 0.99), GRID_THRESHOLDS[-1].item(), rel_tol=GRID_RTOL)


# ---------------------------------------------------------------- prefill calibration windows


@pytest.mark.parametrize("n", [2, 3, 10, 16, 100])
def test_prefill_windows_cover_lengths_equally(n):
    windows = prefill_windows(n)
    lengths = sorted({b - a for a, b, _ in windows})
    want = [2**i for i in range(1, n.bit_length() + 1) if 2**i < n] + [n]
    assert lengths == want  # 2, 4, 8, ... below n, and n
    for length in lengths:
        mine = [(a, b, w) for a, b, w in windows if b - a == length]
        assert 1 <= len(mine) <= 8 and len({(a, b) for a, b, _ in mine}) == len(mine)
        assert all(0 <= a < b <= n for a, b, _ in mine) and max(b for _, b, _ in mine) == n
        assert math.isclose(sum(w for _, _, w in mine), 1.0)  # each length weighs the same
    assert prefill_windows(1) == [(0, 1, 1.0)]
    with pytest.raises(ValueError):
        prefill_windows(0)


def test_window_scores_are_the_prefill_lookup_score():
    """window_scores on per-token S gives what the lookup's reduce_scores gives for that window at once."""
    g = torch.Generator().manual_seed(5)
    log_scores = torch.randn(4, 12, 7, generator=g) - 3  # [Hq, Lq, C] log S
    rows = 2
    per_token = torch.exp(log_scores).reshape(rows, 2, 12, 7).mean(dim=1)
    windows = [(0, 12, 1.0), (3, 5, 1.0), (11, 12, 1.0)]
    got = window_scores(per_token, windows)
    assert got.shape == (rows, 3, 7)
    for w, (a, b, _) in enumerate(windows):
        torch.testing.assert_close(got[:, w], reduce_scores(log_scores[:, a:b], rows))


def test_pooled_thresholds_equal_the_concatenation_under_the_limit():
    g = torch.Generator().manual_seed(5)
    parts = [(torch.rand(n, generator=g), torch.randint(1, 30, (n,), generator=g).float()) for n in (50, 7, 120)]
    want = weighted_thresholds(torch.cat([s for s, _ in parts]), torch.cat([w for _, w in parts]), SPARSITIES)
    assert torch.equal(pooled_thresholds(parts, SPARSITIES), want)


def test_pooled_thresholds_sample_each_part_in_proportion_over_the_limit():
    """Over the limit each part gives a uniform sample in proportion to its size: the thresholds stay within a
    sampling error of the exact ones (20K of 400K scores: the weighted quantiles move by well under 0.02)."""
    g = torch.Generator().manual_seed(6)
    parts = [(torch.rand(n, generator=g) ** p, torch.randint(1, 30, (n,), generator=g).float())
             for n, p in ((200_000, 1.0), (150_000, 2.0), (50_000, 0.5))]  # parts of different score distributions
    exact = weighted_thresholds(torch.cat([s for s, _ in parts]), torch.cat([w for _, w in parts]), SPARSITIES)
    sampled = pooled_thresholds(parts, SPARSITIES, max_samples=20_000)
    torch.testing.assert_close(sampled, exact, atol=0.02, rtol=0.0)
    assert not torch.equal(sampled, exact)  # it did sample
