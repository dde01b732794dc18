"""engine.policies on random keys: build, calibrate through CalibrationSet, lookup; sparsity and structure checks.

No model: two "layers" of random keys [Hkv, L, D] and random calibration queries stand in for a prefilled context.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import SPARSITY_GRID, IndexSettings
from engine.calibrate import prefill_windows, weighted_thresholds
from engine.policies import POLICIES, CalibrationSet, get_policy
from engine.policies.base import step_thresholds
from engine.policies.full import FullPolicy
from engine.policies.hsqueeze import HierarchicalSqueezePolicy
from engine.policies.squeeze import SqueezePolicy, per_token_scores, weighted_samples
from kernels.backend import REFERENCE
from kernels.layout import ClusterLayout
from kernels.reference import centroid_log_scores, reduce_scores

HQ, HKV, L, D = 4, 2, 500, 32
DENSE_TAIL = 10
LC = L - DENSE_TAIL  # clustered keys: the context minus its dense tail, as engine/ingest.py cuts it
NUM_LAYERS = 2
CALIB_TOKENS = 16
SCALE = D**-0.5
SETTINGS = IndexSettings(centroid_ratio=0.1, level1_ratio=0.02, dense_tail=DENSE_TAIL)
# Each (row, token, cluster) triple carries ~LC / C = 10 keys of the LC * rows * tokens * layers measured, i.e.
# ~1e-4 of the total: the calibration's quantile is exact to that; the rest of the 0.05 allowance covers float32
# score differences between the calibration pass (all tokens at once) and the per-token lookups, which can move
# clusters whose score sits right at the threshold.
SPARSITY_TOL = 0.05

squeeze = SqueezePolicy()
hsqueeze = HierarchicalSqueezePolicy()


pytestmark = pytest.mark.usefixtures("one_thread")


def settings_for(group: str) -> IndexSettings:
    return replace(SETTINGS, group=group)


def build_index(keys: torch.Tensor, settings: IndexSettings) -> dict[str, torch.Tensor]:
    """keys [Hkv, L, D] -> the squeeze then hsqueeze artifacts, merged in that order as engine/ingest.py does."""
    clustered = keys[:, :LC]
    index: dict[str, torch.Tensor] = {}
    index.update(squeeze.build(clustered, settings, index))
    index.update(hsqueeze.build(clustered, settings, index))
    return index


@pytest.fixture(scope="module")
def layers() -> list[CalibrationSet]:
    sets = []
    for layer in range(NUM_LAYERS):
        g = torch.Generator().manual_seed(100 + layer)
        keys = torch.randn(HKV, L, D, generator=g)
        queries = torch.randn(HQ, CALIB_TOKENS, D, generator=g)  # [Hq, Nc, D]
        sets.append(CalibrationSet(index=build_index(keys, SETTINGS), queries=queries))
    return sets


@pytest.fixture(scope="module", params=["kv", "query"])
def calibrated(request, layers):
    settings = settings_for(request.param)
    return settings, {
        "squeeze": squeeze.calibrate(layers, SCALE, settings),
        "hsqueeze": hsqueeze.calibrate(layers, SCALE, settings),
    }


@pytest.fixture(scope="module", params=["kv", "query"])
def prefill_calibrated(request, layers):
    """As `calibrated`, with the question prefill's own thresholds (IndexSettings.prefill_threshold)."""
    settings = replace(settings_for(request.param), prefill_threshold="calibrated")
    return settings, {
        "squeeze": squeeze.calibrate(layers, SCALE, settings),
        "hsqueeze": hsqueeze.calibrate(layers, SCALE, settings),
    }


def lookup(policy, q, index, calibration, sparsity, settings):
    return policy.lookup(q, index, policy.thresholds(calibration, sparsity), SCALE, settings, REFERENCE)


def original_mask(selection, index) -> torch.Tensor:
    """[rows, L] bool: the selection (of positions in the cluster-permuted K/V) in the keys' original order."""
    rows = selection.rows
    layout = ClusterLayout.from_labels(index["labels"], index["counts"].shape[1], L - LC)
    assert torch.equal(layout.starts, index["key_starts"])
    order = layout.order.repeat_interleave(rows // HKV, dim=0)  # [rows, L]
    mask = torch.zeros(rows, L, dtype=torch.bool)
    mask.scatter_(1, order, selection.to_mask())
    return mask


def kept_fraction(policy, layers, calibration, sparsity, settings) -> float:
    """Mean over layers, calibration tokens (one lookup each, Lq = 1) and rows of the clustered keys kept."""
    fractions = []
    for layer in layers:
        for t in range(layer.queries.shape[1]):
            result = lookup(policy, layer.queries[:, t : t + 1], layer.index, calibration, sparsity, settings)
            counts = result.selection.counts()  # [rows] includes the dense tail, which every row keeps
            fractions.append((counts - DENSE_TAIL).double() / LC)
    return torch.cat(fractions).mean().item()


# ---------------------------------------------------------------- the index


def test_index_shapes_and_counts(layers):
    c2 = SETTINGS.num_centroids(LC)
    c1 = SETTINGS.num_centroids(LC, SETTINGS.level1_ratio)
    assert (c2, c1) == (49, 10)
    for n, layer in enumerate(layers):
        index = layer.index
        keys = torch.randn(HKV, L, D, generator=torch.Generator().manual_seed(100 + n))  # as the fixture made them
        assert index["labels"].shape == (HKV, LC) and index["centroids"].shape == (HKV, c2, D)
        assert torch.equal(index["counts"].sum(dim=1), torch.full((HKV,), LC))
        for h in range(HKV):
            assert torch.equal(index["counts"][h], torch.bincount(index["labels"][h], minlength=c2))
        assert index["l1_centroids"].shape == (HKV, c1, D) and index["l1_parent"].shape == (HKV, c2)
        # level-1 counts are the keys under each level-1 cluster
        for h in range(HKV):
            want = torch.zeros(c1, dtype=torch.int64).index_add_(0, index["l1_parent"][h], index["counts"][h])
            assert torch.equal(index["l1_counts"][h], want)
        # level-2 ids are grouped by level-1 parent, and the children ranges say so
        assert (index["l1_parent"].diff(dim=1) >= 0).all()
        for h in range(HKV):
            children = torch.bincount(index["l1_parent"][h], minlength=c1)
            assert torch.equal(index["l1_child_starts"][h].diff(), children)
        # the centroids still are the means of their (renumbered) members
        for h in range(HKV):
            members = index["labels"][h] == 3
            assert torch.allclose(index["centroids"][h, 3], keys[h, :LC][members].mean(dim=0), atol=1e-5)


# ---------------------------------------------------------------- calibration vs measured sparsity


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
def test_squeeze_kept_fraction_matches_target(layers, calibrated, sparsity):
    settings, calibration = calibrated
    kept = kept_fraction(squeeze, layers, calibration["squeeze"], sparsity, settings)
    assert abs(kept - (1 - sparsity)) <= SPARSITY_TOL, (settings.group, sparsity, kept)


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
def test_hsqueeze_kept_fraction_matches_target(layers, calibrated, sparsity):
    settings, calibration = calibrated
    kept = kept_fraction(hsqueeze, layers, calibration["hsqueeze"], sparsity, settings)
    assert abs(kept - (1 - sparsity)) <= SPARSITY_TOL, (settings.group, sparsity, kept)


def test_calibration_is_monotone(calibrated):
    _, calibration = calibrated
    for t in (calibration["squeeze"]["threshold"], calibration["hsqueeze"]["threshold_l2"]):
        assert t.shape == (len(SPARSITY_GRID),) and t[0].item() == 0.0
    t = calibration["squeeze"]["threshold"]
    assert (t[1:] >= t[:-1]).all()
    t1 = calibration["hsqueeze"]["threshold_l1"]
    assert (t1[1:] >= t1[:-1]).all()


@pytest.mark.parametrize("name", ["squeeze", "hsqueeze"])
def test_zero_sparsity_selects_every_key(layers, calibrated, name):
    settings, calibration = calibrated
    policy = get_policy(name)
    rows = HKV if settings.group == "kv" else HQ
    for layer in layers:
        for q in (layer.queries[:, :1], layer.queries[:, 5:6], layer.queries):  # decode and prefill shapes
            result = lookup(policy, q, layer.index, calibration[name], 0.0, settings)
            assert result.selection.num_keys == L
            assert torch.equal(result.selection.counts(), torch.full((rows,), L))


# ---------------------------------------------------------------- hierarchical structure


def level1_survivors(q, index, t1, rows):
    """Independent level-1 decision: [rows, C1] bool, S1 > T1 on non-empty level-1 clusters."""
    s1 = reduce_scores(centroid_log_scores(q, index["l1_centroids"], index["l1_counts"], SCALE), rows)
    counts = index["l1_counts"].repeat_interleave(rows // HKV, dim=0)
    return (s1 > t1) & (counts > 0)


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
def test_hsqueeze_level2_kept_only_under_surviving_level1(layers, calibrated, sparsity):
    settings, calibration = calibrated
    rows = HKV if settings.group == "kv" else HQ
    thresholds = hsqueeze.thresholds(calibration["hsqueeze"], sparsity)
    assert thresholds[0] > 0  # the level-1 threshold prunes something at these sparsities
    pruned_some = False
    for layer in layers:
        index = layer.index
        for q in (layer.queries[:, :1], layer.queries[:, 3:4], layer.queries[:, 4:12]):
            result = lookup(hsqueeze, q, index, calibration["hsqueeze"], sparsity, settings)
            t1, _ = step_thresholds(thresholds, hsqueeze.levels, q.shape[1], settings)
            keep1 = level1_survivors(q, index, t1, rows)  # [rows, C1]
            parent = index["l1_parent"].repeat_interleave(rows // HKV, dim=0)  # [rows, C2]
            parent_kept = torch.gather(keep1, 1, parent)  # [rows, C2]
            assert result.clusters.shape == parent_kept.shape
            assert not (result.clusters & ~parent_kept).any()
            pruned_some |= bool((~keep1).any())
            # The selection is exactly the keys of the kept level-2 clusters, plus the dense tail.
            kv = torch.arange(rows) * HKV // rows
            key_mask = torch.gather(result.clusters, 1, index["labels"][kv])
            selected = original_mask(result.selection, index)
            assert torch.equal(selected[:, :LC], key_mask)
            assert selected[:, LC:].all()
    assert pruned_some


# ---------------------------------------------------------------- the question's prefill


def prefill_kept_fraction(policy, layers, calibration, sparsity, settings) -> float:
    """Clustered keys kept by the prefill lookup (Lq > 1 at once) of each calibration window (prefill_windows),
    averaged with the windows' weights over layers, windows and rows: what the prefill calibration targets."""
    total = weight = 0.0
    for layer in layers:
        for a, b, w in prefill_windows(layer.queries.shape[1]):
            result = lookup(policy, layer.queries[:, a:b], layer.index, calibration, sparsity, settings)
            total += w * ((result.selection.counts() - DENSE_TAIL).double() / LC).mean().item()
            weight += w
    return total / weight


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
@pytest.mark.parametrize("name", ["squeeze", "hsqueeze"])
def test_prefill_kept_fraction_matches_target(layers, prefill_calibrated, name, sparsity):
    """With its own thresholds the question's prefill keeps about 1 - s of the keys, as a decode step does (same
    tolerance as decode's). (With decode's it keeps what the union of its token mean and its last token passes: on
    these random keys sometimes less than 1 - s, on real keys up to twice as much: tests/test_bench_kept.py.)"""
    settings, calibration = prefill_calibrated
    policy = get_policy(name)
    kept = prefill_kept_fraction(policy, layers, calibration[name], sparsity, settings)
    assert abs(kept - (1 - sparsity)) <= SPARSITY_TOL, (settings.group, name, sparsity, kept)


def test_decode_calibration_is_unchanged(layers, calibrated):
    """Decode's thresholds are the weighted quantiles of every calibration token's S whether or not the prefill has
    its own, and the default calibration (prefill_threshold="decode") holds nothing else: as before the option."""
    settings, calibration = calibrated
    p_settings = replace(settings, prefill_threshold="calibrated")
    p_calibration = {p.name: p.calibrate(layers, SCALE, p_settings) for p in (squeeze, hsqueeze)}
    rows = HKV if settings.group == "kv" else HQ
    scores, weights = [], []
    for layer in layers:
        sample, weight = weighted_samples(per_token_scores(layer.queries, layer.index, SCALE, rows, REFERENCE),
                                          layer.index["counts"], rows)
        scores.append(sample)
        weights.append(weight)
    want = weighted_thresholds(torch.cat(scores), torch.cat(weights), SPARSITY_GRID)
    assert set(calibration["squeeze"]) == {"threshold"}
    assert set(calibration["hsqueeze"]) == {"threshold_l1", "threshold_l2"}
    assert torch.equal(calibration["squeeze"]["threshold"], want)
    assert torch.equal(p_calibration["squeeze"]["threshold"], want)
    for name in ("threshold_l1", "threshold_l2"):
        assert torch.equal(p_calibration["hsqueeze"][name], calibration["hsqueeze"][name])
    for policy, names in ((squeeze, ("threshold_prefill",)), (hsqueeze, ("threshold_l1_prefill", "threshold_l2_prefill"))):
        for name in names:
            t = p_calibration[policy.name][name]
            assert t.shape == (len(SPARSITY_GRID),) and t[0].item() == 0.0
        assert (p_calibration[policy.name][names[0]].diff() >= 0).all()
        for sparsity in (0.5, 0.9):
            assert policy.thresholds(calibration[policy.name], sparsity) == \
                policy.thresholds(p_calibration[policy.name], sparsity)[: policy.levels]


@pytest.mark.parametrize("name", ["squeeze", "hsqueeze"])
def test_phase_picks_thresholds(layers, prefill_calibrated, name):
    """A decode step (Lq = 1) uses decode's thresholds whatever the setting; a prefill step uses the prefill's
    where prefill_threshold="calibrated" and the calibration has them, decode's otherwise."""
    settings, calibration = prefill_calibrated
    policy = get_policy(name)
    levels = policy.levels
    thresholds = policy.thresholds(calibration[name], 0.8)
    assert len(thresholds) == 2 * levels and thresholds[levels:] != thresholds[:levels]
    layer = layers[0]

    def kept(q, ts, st):
        return policy.lookup(q, layer.index, ts, SCALE, st, REFERENCE).clusters

    one, many = layer.queries[:, 5:6], layer.queries[:, 2:10]
    old = replace(settings, prefill_threshold="decode")
    for st in (settings, old):
        assert torch.equal(kept(one, thresholds, st), kept(one, thresholds[:levels], st))
    assert torch.equal(kept(many, thresholds, old), kept(many, thresholds[:levels], settings))
    assert torch.equal(kept(many, thresholds, settings), kept(many, thresholds[levels:], old))
    assert step_thresholds(thresholds, levels, 8, settings) == thresholds[levels:]
    assert step_thresholds(thresholds, levels, 8, old) == thresholds[:levels]
    assert step_thresholds(thresholds[:levels], levels, 8, settings) == thresholds[:levels]


# ---------------------------------------------------------------- Lookup metadata


@pytest.mark.parametrize("sparsity", [0.0, 0.7])
def test_index_elements(layers, calibrated, sparsity):
    settings, calibration = calibrated
    rows = HKV if settings.group == "kv" else HQ
    c2, c1 = layers[0].index["centroids"].shape[1], layers[0].index["l1_centroids"].shape[1]
    for layer in layers:
        q = layer.queries[:, 2:3]
        sq = lookup(squeeze, q, layer.index, calibration["squeeze"], sparsity, settings)
        assert sq.index_elements.shape == (HKV,)
        assert torch.equal(sq.index_elements.double(), torch.full((HKV,), float(c2 * (D + 1)), dtype=torch.float64))
        # hsqueeze reads every level-1 centroid, then each row's level-2 candidates: the children of its level-1
        # survivors (a centroid and its count: D + 1 elements each; rows of one KV head read theirs separately).
        hs = lookup(hsqueeze, q, layer.index, calibration["hsqueeze"], sparsity, settings)
        t1 = hsqueeze.thresholds(calibration["hsqueeze"], sparsity)[0]  # decode's (Lq = 1)
        keep1 = level1_survivors(q, layer.index, t1, rows)  # [rows, C1]
        parent = layer.index["l1_parent"].repeat_interleave(rows // HKV, dim=0)  # [rows, C2]
        survivors = torch.gather(keep1, 1, parent).sum(dim=1).reshape(HKV, rows // HKV).sum(dim=1)  # [Hkv]
        want = ((c1 + survivors) * (D + 1)).double()
        assert torch.equal(hs.index_elements.double(), want)
        assert (hs.index_elements <= (c1 + (rows // HKV) * c2) * (D + 1)).all()


# ---------------------------------------------------------------- rows and the dense method


@pytest.mark.parametrize("name", ["squeeze", "hsqueeze"])
def test_group_decides_rows(layers, calibrated, name):
    settings, calibration = calibrated
    rows = HKV if settings.group == "kv" else HQ
    policy = get_policy(name)
    layer = layers[0]
    for q in (layer.queries[:, :1], layer.queries[:, :6]):
        result = lookup(policy, q, layer.index, calibration[name], 0.7, settings)
        assert result.selection.rows == rows
        assert result.clusters.shape == (rows, layer.index["centroids"].shape[1])


def test_full_policy_is_dense(layers):
    full = get_policy("full")
    assert isinstance(full, FullPolicy) and not full.sparse
    layer = layers[0]
    assert full.build(torch.randn(HKV, LC, D), SETTINGS, {}) == {}
    assert full.calibrate(layers, SCALE, SETTINGS) == {} and full.thresholds({}, 0.7) == ()
    result = full.lookup(layer.queries[:, :1], layer.index, (), SCALE, SETTINGS, REFERENCE)
    assert result.selection is None and result.clusters is None


def test_policy_registry():
    assert set(POLICIES) == {"full", "squeeze", "hsqueeze"}
    with pytest.raises(ValueError):
        get_policy("nope")


# ---------------------------------------------------------------- IndexSettings


@pytest.mark.parametrize(
    "bad",
    [
        {"centroid_ratio": 0.0},
        {"centroid_ratio": 1.5},
        {"level1_ratio": 0.0},
        {"centroid_ratio": 0.05, "level1_ratio": 0.1},  # level 1 must be coarser than level 2
        {"dense_tail": 0},
        {"kmeans_iters": 0},
        {"group": "head"},
        {"prefill_threshold": "mean"},
    ],
)
def test_index_settings_validation(bad):
    with pytest.raises(ValueError):
        IndexSettings(**bad)


def test_num_centroids_is_clamped():
    settings = IndexSettings(centroid_ratio=0.1, level1_ratio=0.02)
    assert settings.num_centroids(490) == 49 and settings.num_centroids(490, settings.level1_ratio) == 10
    assert settings.num_centroids(3) == 1  # at least one
    assert IndexSettings(centroid_ratio=1.0, level1_ratio=1.0).num_centroids(7) == 7  # at most every key
