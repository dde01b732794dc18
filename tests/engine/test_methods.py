"""The cluster methods (engine.methods squeeze, hsqueeze) on random keys: build, calibrate through CalibrationSet,
plan, lookup; sparsity and structure checks. (tests/engine/test_methods_contract.py checks every method on the contract.)

No model: two "layers" of random keys [Hkv, L, D] and random calibration queries stand in for a prefilled context.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from engine.context.ingest import build_methods
from engine.context.settings import ContextSettings
from engine.index.thresholds import SPARSITY_GRID, prefill_windows, weighted_thresholds
from engine.methods import CalibrationSet, LayerIndex, make_method
from engine.methods.full import FullPolicy
from engine.methods.hsqueeze import HierarchicalSettings, HierarchicalSqueezePolicy
from engine.methods.squeeze import SqueezePolicy, SqueezeSettings, num_centroids, per_token_scores, weighted_samples
from kernels.backend import REFERENCE
from kernels.layout import ClusterLayout
from kernels.reference.centroid import centroid_log_scores, reduce_scores

HQ, HKV, L, D = 4, 2, 500, 32
DENSE_TAIL = 10
LC = L - DENSE_TAIL  # clustered keys: the context minus its dense tail, as engine/context/ingest.py cuts it
NUM_LAYERS = 2
CALIB_TOKENS = 16
SCALE = D**-0.5
CENTROID_RATIO, LEVEL1_RATIO = 0.1, 0.02
# Each (row, token, cluster) triple carries ~LC / C = 10 keys of the LC * rows * tokens * layers measured, i.e.
# ~1e-4 of the total: the calibration's quantile is exact to that; the rest of the 0.05 allowance covers float32
# score differences between the calibration pass (all tokens at once) and the per-token lookups, which can move
# clusters whose score sits right at the threshold.
SPARSITY_TOL = 0.05


pytestmark = pytest.mark.usefixtures("one_thread")


def methods_for(group: str = "kv", prefill: str = "decode", centroids: str = "exact") -> dict:
    """squeeze and hsqueeze with the test's index settings, one selection per `group`, prefill thresholds `prefill`;
    float centroids (the paper's index, whose structure these tests check: one-byte ones have their own test)."""
    return {"squeeze": SqueezePolicy(SqueezeSettings(centroid_ratio=CENTROID_RATIO, group=group,
                                                     prefill_threshold=prefill, centroids=centroids)),
            "hsqueeze": HierarchicalSqueezePolicy(HierarchicalSettings(level1_ratio=LEVEL1_RATIO, group=group,
                                                                       prefill_threshold=prefill, centroids=centroids))}


@dataclass
class Layer:
    """One random layer: its keys [Hkv, L, D], calibration queries [Hq, Nc, D], and each method's index."""

    keys: torch.Tensor
    queries: torch.Tensor
    indexes: dict[str, LayerIndex]


def calib_sets(layers: list[Layer], name: str) -> list[CalibrationSet]:
    return [CalibrationSet(index=layer.indexes[name], queries=layer.queries) for layer in layers]


@pytest.fixture(scope="module")
def layers() -> list[Layer]:
    keys, queries = {}, {}
    for layer in range(NUM_LAYERS):
        g = torch.Generator().manual_seed(100 + layer)
        keys[layer] = torch.randn(HKV, L, D, generator=g)
        queries[layer] = torch.randn(HQ, CALIB_TOKENS, D, generator=g)  # [Hq, Nc, D]
    made = build_methods(keys, queries, DENSE_TAIL, list(methods_for().values()), SCALE, torch.device("cpu"))
    out = []
    for layer in range(NUM_LAYERS):
        indexes = {}
        for name in ("squeeze", "hsqueeze"):
            prefix = f"{name}.layer{layer}."
            indexes[name] = LayerIndex(tensors={k[len(prefix):]: v for k, v in made.items() if k.startswith(prefix)},
                                       num_keys=L, tail=DENSE_TAIL)
        out.append(Layer(keys=keys[layer], queries=queries[layer], indexes=indexes))
    return out


def calibrate_all(layers, methods) -> dict:
    return {name: m.calibrate(calib_sets(layers, name), SCALE) for name, m in methods.items()}


@pytest.fixture(scope="module", params=["kv", "query"])
def calibrated(request, layers):
    methods = methods_for(request.param)
    return methods, calibrate_all(layers, methods)


@pytest.fixture(scope="module", params=["kv", "query"])
def prefill_calibrated(request, layers):
    """As `calibrated`, with the question prefill's own thresholds (prefill_threshold="calibrated")."""
    methods = methods_for(request.param, "calibrated")
    return methods, calibrate_all(layers, methods)


def rows_of(method) -> int:
    return HKV if method.settings.group == "kv" else HQ


def lookup(method, q, index, calibration, sparsity):
    """The lookup under the calibrated thresholds alone (plan_keys: no room to cut to), what these tests measure."""
    keys = 1.0 - sparsity
    return method.lookup(q, index, method.plan_keys(calibration, keys, keys, keys), SCALE, REFERENCE)


def original_mask(selection, index) -> torch.Tensor:
    """[rows, L] bool: the selection (of positions in the cluster-permuted K/V) in the keys' original order."""
    rows = selection.rows
    layout = ClusterLayout.from_labels(index["labels"], index["counts"].shape[1], L - LC)
    assert torch.equal(layout.starts, index["key_starts"])
    order = layout.order.repeat_interleave(rows // HKV, dim=0)  # [rows, L]
    mask = torch.zeros(rows, L, dtype=torch.bool)
    mask.scatter_(1, order, selection.to_mask())
    return mask


def kept_fraction(method, layers, calibration, sparsity) -> float:
    """Mean over layers, calibration tokens (one lookup each, Lq = 1) and rows of the clustered keys kept."""
    fractions = []
    for layer in layers:
        for t in range(layer.queries.shape[1]):
            result = lookup(method, layer.queries[:, t : t + 1], layer.indexes[method.name], calibration, sparsity)
            counts = result.selection.counts()  # [rows] includes the dense tail, which every row keeps
            fractions.append((counts - DENSE_TAIL).double() / LC)
    return torch.cat(fractions).mean().item()


# ---------------------------------------------------------------- the index


def test_index_shapes_and_counts(layers):
    c2 = num_centroids(LC, CENTROID_RATIO)
    c1 = num_centroids(LC, LEVEL1_RATIO)
    assert (c2, c1) == (49, 10)
    for layer in layers:
        keys = layer.keys
        flat = layer.indexes["squeeze"]
        assert flat["labels"].shape == (HKV, LC) and flat["centroids"].shape == (HKV, c2, D)
        for h in range(HKV):
            members = flat["labels"][h] == 3
            assert torch.allclose(flat["centroids"][h, 3], keys[h, :LC][members].mean(dim=0), atol=1e-5)
        index = layer.indexes["hsqueeze"]  # squeeze's clusters renumbered under level-1 parents
        assert torch.equal(index["counts"].sort(dim=1).values, flat["counts"].sort(dim=1).values)
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
    methods, calibration = calibrated
    kept = kept_fraction(methods["squeeze"], layers, calibration["squeeze"], sparsity)
    assert abs(kept - (1 - sparsity)) <= SPARSITY_TOL, (rows_of(methods["squeeze"]), sparsity, kept)


@pytest.mark.parametrize("budget", [0.2, 0.35, 0.6])
@pytest.mark.parametrize("name", ["squeeze", "hsqueeze"])
def test_each_lookup_reads_its_budget_on_queries_the_calibration_never_saw(layers, calibrated, name, budget):
    """Method.plan gives the lookups room to read: each cuts its own scores at the share of the fixed K/V bytes it
    asked for (engine.attention.budget.cut_threshold; index and dense tail counted; on the CPU), a decode step and a
    question's prefill alike, on queries the calibration never saw (three times sharper than its own): within one
    cluster's keys of the budget (at most 0.009 off here; under the calibrated thresholds alone the same queries
    read 0.016-0.337 off)."""
    methods, calibration = calibrated
    policy = methods[name]
    plan = policy.plan(calibration[name], budget)
    g = torch.Generator().manual_seed(9)
    for layer in layers:
        index = layer.indexes[name]
        cluster = float(index["counts"].max()) / (HKV * L)  # one cluster's share of the K/V
        for lq in (1, 8):
            q = 3 * torch.randn(HQ, lq, D, generator=g)
            read = policy.lookup(q, index, plan, SCALE, REFERENCE).read_fraction(D, L)
            if rows_of(policy) == HKV:  # (a row per query head keeps its threshold: rows of a head share keys)
                assert abs(read - budget) <= cluster + 1e-9, (name, budget, lq, read)


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
def test_hsqueeze_kept_fraction_matches_target(layers, calibrated, sparsity):
    methods, calibration = calibrated
    kept = kept_fraction(methods["hsqueeze"], layers, calibration["hsqueeze"], sparsity)
    assert abs(kept - (1 - sparsity)) <= SPARSITY_TOL, (rows_of(methods["hsqueeze"]), sparsity, kept)


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
    methods, calibration = calibrated
    policy = methods[name]
    rows = rows_of(policy)
    for layer in layers:
        for q in (layer.queries[:, :1], layer.queries[:, 5:6], layer.queries):  # decode and prefill shapes
            result = lookup(policy, q, layer.indexes[name], calibration[name], 0.0)
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
    methods, calibration = calibrated
    hsqueeze = methods["hsqueeze"]
    rows = rows_of(hsqueeze)
    plan = hsqueeze.plan(calibration["hsqueeze"], 1.0 - sparsity)
    assert plan.decode[0] > 0  # the level-1 threshold prunes something at these sparsities
    pruned_some = False
    for layer in layers:
        index = layer.indexes["hsqueeze"]
        for q in (layer.queries[:, :1], layer.queries[:, 3:4], layer.queries[:, 4:12]):
            result = lookup(hsqueeze, q, index, calibration["hsqueeze"], sparsity)
            t1, _ = plan.at(q.shape[1])
            keep1 = level1_survivors(q, index, t1, rows)  # [rows, C1]
            parent = index["l1_parent"].repeat_interleave(rows // HKV, dim=0)  # [rows, C2]
            parent_kept = torch.gather(keep1, 1, parent)  # [rows, C2]
            assert result.units.shape == parent_kept.shape
            assert not (result.units & ~parent_kept).any()
            pruned_some |= bool((~keep1).any())
            # The selection is exactly the keys of the kept level-2 clusters, plus the dense tail.
            kv = torch.arange(rows) * HKV // rows
            key_mask = torch.gather(result.units, 1, index["labels"][kv])
            selected = original_mask(result.selection, index)
            assert torch.equal(selected[:, :LC], key_mask)
            assert selected[:, LC:].all()
    assert pruned_some


# ---------------------------------------------------------------- the question's prefill


def prefill_kept_fraction(policy, layers, calibration, sparsity) -> float:
    """Clustered keys kept by the prefill lookup (Lq > 1 at once) of each calibration window (prefill_windows),
    averaged with the windows' weights over layers, windows and rows: what the prefill calibration targets."""
    total = weight = 0.0
    for layer in layers:
        for a, b, w in prefill_windows(layer.queries.shape[1]):
            result = lookup(policy, layer.queries[:, a:b], layer.indexes[policy.name], calibration, sparsity)
            total += w * ((result.selection.counts() - DENSE_TAIL).double() / LC).mean().item()
            weight += w
    return total / weight


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
@pytest.mark.parametrize("name", ["squeeze", "hsqueeze"])
def test_prefill_kept_fraction_matches_target(layers, prefill_calibrated, name, sparsity):
    """With its own thresholds the question's prefill keeps about 1 - s of the keys, as a decode step does (same
    tolerance as decode's). (With decode's it keeps what the union of its token mean and its last token passes: on
    these random keys sometimes less than 1 - s, on real keys up to twice as much: tests/bench/test_bench_kept.py.)"""
    methods, calibration = prefill_calibrated
    policy = methods[name]
    kept = prefill_kept_fraction(policy, layers, calibration[name], sparsity)
    assert abs(kept - (1 - sparsity)) <= SPARSITY_TOL, (rows_of(policy), name, sparsity, kept)


def test_decode_calibration_is_unchanged(layers, calibrated):
    """Decode's thresholds are the weighted quantiles of every calibration token's S whether or not the prefill has
    its own, and the default calibration (prefill_threshold="decode") holds nothing else."""
    methods, calibration = calibrated
    group = methods["squeeze"].settings.group
    p_methods = methods_for(group, "calibrated")
    p_calibration = calibrate_all(layers, p_methods)
    rows = rows_of(methods["squeeze"])
    scores, weights = [], []
    for layer in layers:
        index = layer.indexes["squeeze"]
        sample, weight = weighted_samples(per_token_scores(layer.queries, index, SCALE, rows, REFERENCE),
                                          index["counts"], rows)
        scores.append(sample)
        weights.append(weight)
    want = weighted_thresholds(torch.cat(scores), torch.cat(weights), SPARSITY_GRID)
    assert set(calibration["squeeze"]) == {"threshold"}
    assert set(calibration["hsqueeze"]) == {"threshold_l1", "threshold_l2"}
    assert torch.equal(calibration["squeeze"]["threshold"], want)
    assert torch.equal(p_calibration["squeeze"]["threshold"], want)
    for name in ("threshold_l1", "threshold_l2"):
        assert torch.equal(p_calibration["hsqueeze"][name], calibration["hsqueeze"][name])
    for name, names in (("squeeze", ("threshold_prefill",)), ("hsqueeze", ("threshold_l1_prefill", "threshold_l2_prefill"))):
        for n in names:
            t = p_calibration[name][n]
            assert t.shape == (len(SPARSITY_GRID),) and t[0].item() == 0.0
        assert (p_calibration[name][names[0]].diff() >= 0).all()
        for sparsity in (0.5, 0.9):
            plain = methods[name].plan(calibration[name], 1.0 - sparsity)
            with_prefill = p_methods[name].plan(p_calibration[name], 1.0 - sparsity)
            assert plain.decode == with_prefill.decode and plain.prefill == plain.decode


@pytest.mark.parametrize("name", ["squeeze", "hsqueeze"])
def test_phase_picks_thresholds(layers, prefill_calibrated, name):
    """A decode step (Lq = 1) uses the plan's decode thresholds; a prefill step (Lq > 1) its prefill ones, which
    are their own where prefill_threshold="calibrated"."""
    methods, calibration = prefill_calibrated
    policy = methods[name]
    plan = policy.plan_keys(calibration[name], 0.2, 0.2, 0.2)
    assert plan.prefill != plan.decode and plan.at(1) == plan.decode and plan.at(8) == plan.prefill
    index = layers[0].indexes[name]

    def kept(q, p):
        return policy.lookup(q, index, p, SCALE, REFERENCE).units

    one, many = layers[0].queries[:, 5:6], layers[0].queries[:, 2:10]
    decode_only = replace(plan, prefill=plan.decode)
    prefill_only = replace(plan, decode=plan.prefill)
    assert torch.equal(kept(one, plan), kept(one, decode_only))
    assert torch.equal(kept(many, plan), kept(many, prefill_only))
    assert not torch.equal(kept(many, plan), kept(many, decode_only))


# ---------------------------------------------------------------- Lookup metadata


@pytest.mark.parametrize("sparsity", [0.0, 0.7])
def test_index_elements(layers, calibrated, sparsity):
    methods, calibration = calibrated
    squeeze, hsqueeze = methods["squeeze"], methods["hsqueeze"]
    rows = rows_of(squeeze)
    c2 = layers[0].indexes["squeeze"]["centroids"].shape[1]
    c1 = layers[0].indexes["hsqueeze"]["l1_centroids"].shape[1]
    for layer in layers:
        q = layer.queries[:, 2:3]
        sq = lookup(squeeze, q, layer.indexes["squeeze"], calibration["squeeze"], sparsity)
        assert sq.index_elements.shape == (HKV,)
        assert torch.equal(sq.index_elements.double(), torch.full((HKV,), float(c2 * (D + 1)), dtype=torch.float64))
        # hsqueeze reads every level-1 centroid, then each row's level-2 candidates: the children of its level-1
        # survivors (a centroid and its count: D + 1 elements each; rows of one KV head read theirs separately).
        index = layer.indexes["hsqueeze"]
        hs = lookup(hsqueeze, q, index, calibration["hsqueeze"], sparsity)
        t1 = hsqueeze.plan(calibration["hsqueeze"], 1.0 - sparsity).decode[0]
        keep1 = level1_survivors(q, index, t1, rows)  # [rows, C1]
        parent = index["l1_parent"].repeat_interleave(rows // HKV, dim=0)  # [rows, C2]
        survivors = torch.gather(keep1, 1, parent).sum(dim=1).reshape(HKV, rows // HKV).sum(dim=1)  # [Hkv]
        want = ((c1 + survivors) * (D + 1)).double()
        assert torch.equal(hs.index_elements.double(), want)
        assert (hs.index_elements <= (c1 + (rows // HKV) * c2) * (D + 1)).all()



def test_one_byte_index_and_its_reads(layers):
    """With one-byte centroids (the default) each index keeps uint8 codes with an offset and a step per KV head and
    dim (both levels for hsqueeze); squeeze's decode to the float index's centroids within half a step (the same
    k-means: the same seed and keys; hsqueeze clusters squeeze's decoded centroids, so its own differ), and a lookup
    reads a byte per element plus the offsets and steps: here, float32 keys, a quarter of a centroid's elements, and
    2 * D float32 values per KV head."""
    keys = {i: layer.keys for i, layer in enumerate(layers)}
    queries = {i: layer.queries for i, layer in enumerate(layers)}
    coded = build_methods(keys, queries, DENSE_TAIL, list(methods_for(centroids="int8").values()), SCALE,
                          torch.device("cpu"))
    for i, layer in enumerate(layers):
        for name, prefix in (("squeeze", ""), ("hsqueeze", ""), ("hsqueeze", "l1_")):
            codes = coded[f"{name}.layer{i}.{prefix}centroids"]
            step = coded[f"{name}.layer{i}.{prefix}centroid_step"]
            offset = coded[f"{name}.layer{i}.{prefix}centroid_offset"]
            exact = layer.indexes[name][f"{prefix}centroids"]
            assert codes.dtype == torch.uint8 and codes.shape == exact.shape and step.shape == offset.shape == (HKV, D)
            if name == "squeeze":
                decoded = offset[:, None] + step[:, None] * codes.float()
                assert ((decoded - exact).abs() <= step[:, None] / 2 + 1e-5).all()
        prefix = f"squeeze.layer{i}."
        index = LayerIndex({k[len(prefix):]: v for k, v in coded.items() if k.startswith(prefix)}, L, DENSE_TAIL)
        squeeze = methods_for(centroids="int8")["squeeze"]
        calibration = squeeze.calibrate([CalibrationSet(queries=layer.queries, index=index)], SCALE)
        found = lookup(squeeze, layer.queries[:, 2:3], index, calibration, 0.7)
        c2 = index["centroids"].shape[1]
        assert torch.allclose(found.index_elements.double(), torch.full((HKV,), c2 * (D / 4 + 1) + 2 * D,
                                                                         dtype=torch.float64))


# ---------------------------------------------------------------- rows and the dense method


@pytest.mark.parametrize("name", ["squeeze", "hsqueeze"])
def test_group_decides_rows(layers, calibrated, name):
    methods, calibration = calibrated
    policy = methods[name]
    index = layers[0].indexes[name]
    for q in (layers[0].queries[:, :1], layers[0].queries[:, :6]):
        result = lookup(policy, q, index, calibration[name], 0.7)
        assert result.selection.rows == rows_of(policy)
        assert result.units.shape == (rows_of(policy), index["centroids"].shape[1])
        assert torch.equal(result.sizes, index["counts"])


def test_full_policy_is_dense(layers):
    full = make_method("full")
    assert isinstance(full, FullPolicy) and not full.sparse
    assert full.calibrate(calib_sets(layers, "squeeze"), SCALE) == {}
    plan = full.plan({}, 0.3)
    result = full.lookup(layers[0].queries[:, :1], layers[0].indexes["squeeze"], plan, SCALE, REFERENCE)
    assert result.selection is None and result.units is None


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "cls,bad",
    [
        (SqueezeSettings, {"centroid_ratio": 0.0}),
        (SqueezeSettings, {"centroid_ratio": 1.5}),
        (SqueezeSettings, {"kmeans_iters": 0}),
        (SqueezeSettings, {"group": "head"}),
        (SqueezeSettings, {"prefill_threshold": "mean"}),
        (HierarchicalSettings, {"level1_ratio": 0.0}),
        (HierarchicalSettings, {"level1_prune": 1.0}),
        (ContextSettings, {"dense_tail": 0}),
    ],
)
def test_settings_validation(cls, bad):
    with pytest.raises(ValueError):
        cls(**bad)


def test_make_method_takes_a_dict_of_settings():
    assert make_method("squeeze", {"centroid_ratio": 0.1}).settings == SqueezeSettings(centroid_ratio=0.1)
    with pytest.raises(ValueError, match="unknown squeeze setting"):
        make_method("squeeze", {"ratio": 0.1})
    with pytest.raises(ValueError, match="unknown method"):
        make_method("nope")
    with pytest.raises(TypeError):
        SqueezePolicy(HierarchicalSettings())


def test_num_centroids_is_clamped():
    assert num_centroids(490, 0.1) == 49 and num_centroids(490, 0.02) == 10
    assert num_centroids(3, 0.1) == 1  # at least one
    assert num_centroids(7, 1.0) == 7  # at most every key


def test_squeeze_clusters_under_the_calibration_queries_metric():
    """kmeans="query" (the default): a build with the layer's query moment clusters with metric_kmeans under
    query_metric of it (build_methods passes the moments it is given, else its calibration queries'); kmeans=
    "cosine", or a build without a moment, clusters spherically; hsqueeze's level 1 follows its own setting the
    same way (over squeeze's centroids, weighted by their sizes)."""
    from engine.attention.method import LayerKeys
    from engine.index.kmeans import metric_kmeans, query_metric, query_moment, spherical_kmeans

    g = torch.Generator().manual_seed(7)
    keys, queries = torch.randn(HKV, LC, D, generator=g), torch.randn(HQ, CALIB_TOKENS, D, generator=g)
    moment = query_moment(queries, HKV)
    k = num_centroids(LC, CENTROID_RATIO)
    settings = SqueezeSettings(centroid_ratio=CENTROID_RATIO, centroids="exact")
    assert settings.kmeans == "query"
    built = SqueezePolicy(settings).build(LayerKeys(0, keys, DENSE_TAIL, query_moment=moment), {}, {})
    want = metric_kmeans(keys, k, query_metric(moment))
    assert torch.equal(built["labels"], want.labels)
    torch.testing.assert_close(built["centroids"], want.centroids)
    cosine = spherical_kmeans(keys, k)
    assert not torch.equal(want.labels, cosine.labels)
    cosine_settings = replace(settings, kmeans="cosine")
    for other in (SqueezePolicy(cosine_settings).build(LayerKeys(0, keys, DENSE_TAIL, query_moment=moment), {}, {}),
                  SqueezePolicy(settings).build(LayerKeys(0, keys, DENSE_TAIL), {}, {})):
        assert torch.equal(other["labels"], cosine.labels)
    h_settings = HierarchicalSettings(level1_ratio=LEVEL1_RATIO, centroids="exact")
    level1 = HierarchicalSqueezePolicy(h_settings).build(LayerKeys(0, keys, DENSE_TAIL, query_moment=moment),
                                                          {"squeeze": built}, {})
    k1 = num_centroids(LC, LEVEL1_RATIO)
    want1 = metric_kmeans(built["centroids"], k1, query_metric(moment), weights=built["counts"])
    torch.testing.assert_close(level1["l1_centroids"], want1.centroids)
    # build_methods: the moments it is given, else the calibration queries'
    full = torch.cat([keys, torch.randn(HKV, DENSE_TAIL, D, generator=g)], dim=1)
    other_moment = query_moment(torch.randn(HQ, 50, D, generator=g), HKV)
    for given, used in ((None, moment), ({0: other_moment}, other_moment)):
        made = build_methods({0: full}, {0: queries}, DENSE_TAIL, [SqueezePolicy(settings)], SCALE,
                             torch.device("cpu"), moments=given)
        assert torch.equal(made["squeeze.layer0.labels"], metric_kmeans(keys, k, query_metric(used)).labels)
    with pytest.raises(ValueError, match="kmeans must be one of"):
        SqueezeSettings(kmeans="l2")
