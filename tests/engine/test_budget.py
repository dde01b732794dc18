"""The KV budget's calibration (engine.attention.budget): inverting a method's measured reads, and what one step
reads (the definition engine.attention.stats' kv_budget uses)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.budget import KEYS_GRID, cut_threshold, keys_for, less_follow
from engine.attention.method import Lookup
from kernels.selection import FollowRows, Selection


def linear_reads(index: float) -> torch.Tensor:
    """Reads of a method whose index costs `index` on top of the keys it keeps."""
    return torch.tensor([k + index for k in KEYS_GRID], dtype=torch.float64)


def test_keys_for_inverts_the_reads():
    curve = linear_reads(0.05)
    for budget in (0.1, 0.2, 0.33, 0.5):
        assert keys_for(curve, budget) == pytest.approx(budget - 0.05, abs=1e-9)
    assert keys_for(curve, KEYS_GRID[5] + 0.05) == pytest.approx(KEYS_GRID[5])


def test_keys_for_clamps_at_both_ends():
    curve = linear_reads(0.05)
    assert keys_for(curve, 1.1) == 1.0  # at least what every key reads: all of them (Method.plan: budget 1 = all)
    assert keys_for(curve, 1.0) == pytest.approx(0.95)
    assert keys_for(curve, 0.03) == KEYS_GRID[-1]  # below what the index alone reads: the fewest keys


def test_keys_for_ignores_a_non_monotone_point():
    """A noisy point (more keys reading less) never makes the plan jump: the reads are made monotone first."""
    curve = linear_reads(0.0)
    i = KEYS_GRID.index(0.3)
    curve[i] = 0.1  # 0.3 of the keys "read" 0.1
    assert keys_for(curve, 0.2) == pytest.approx(0.2)
    assert 0.275 <= keys_for(curve, 0.29) <= 0.35  # within the interval the lifted point spans


@pytest.mark.parametrize("keys,kept", [(0, 0), (4, 0), (10, 10), (16, 10), (30, 30), (40, 40), (44, 45), (55, 55),
                                       (100, 55), (torch.tensor(31.0), 30)])
def test_cut_threshold_keeps_the_best_units_nearest_the_keys_asked(keys, kept):
    """Units taken best first over every row (the second row's 0.4 before the first's 0.3), up to the count nearest
    the keys asked (16: 10 rather than 30); none for none; all (the empty unit's score included) past their total;
    the keys as a host number or a device tensor."""
    score = torch.tensor([[0.5, 0.1, 0.3], [0.2, 0.4, 0.0]])
    sizes = torch.tensor([[10, 10, 10], [5, 20, 0]])
    cut = cut_threshold(score, sizes, keys)
    assert cut.shape == () and int(sizes[score > cut].sum()) == kept


def test_read_fraction_counts_a_kv_heads_keys_once_and_the_index():
    """Two query-head rows of one KV head selecting overlapping keys read their union; the index's elements are
    added; over Hkv x L x 2 x D."""
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, :4] = True
    mask[1, 2:6] = True  # union: keys 0..5
    lookup = Lookup(selection=Selection.from_mask(mask), index_elements=torch.tensor([8.0]))
    assert lookup.read_fraction(head_dim=4, num_keys=10) == pytest.approx((6 * 2 * 4 + 8) / (10 * 2 * 4))
    assert Lookup(selection=None, index_elements=torch.zeros(1)).read_fraction(4, 10) == 1.0


def assert_reads_as_its_lookups(policy, index, plans, queries, n: int, tail: int) -> None:
    """policy.reads equals Method.reads (each plan's own lookup, read_fraction) for a decode step (the last query)
    and a question's prefill (12 queries), and the plans read different amounts (the grid is exercised)."""
    from engine.attention.method import Method

    d = queries.shape[2]
    for q, pos in ((queries[:, -1:], torch.tensor([n + tail - 1])), (queries[:, 5:17], torch.arange(n - 12, n))):
        fast = policy.reads(q, index, plans, d**-0.5, pos)
        assert fast == pytest.approx(Method.reads(policy, q, index, plans, d**-0.5, pos), abs=1e-12)
        assert len(set(fast)) > 5


@pytest.mark.parametrize("settings", [{}, {"bounds": "exact"}, {"group": "query"}, {"page_size": 32}])
def test_quest_reads_every_plan_as_its_lookups_do(settings):
    """QuestPolicy.reads counts each plan's pages without a lookup where a row is a KV head; each value equals
    Lookup.read_fraction of the method's own lookup at that plan (Method.reads), decode steps and a question's
    prefill alike, a last partial page included (300 keys in pages of 16 or 32)."""
    from engine.attention.method import LayerIndex, LayerKeys
    from engine.methods import make_method

    g = torch.Generator().manual_seed(9)
    hq, hkv, d, n, tail = 4, 2, 16, 300, 8
    keys = torch.randn(hkv, n + tail, d, generator=g)
    queries = torch.randn(hq, 40, d, generator=g)
    policy = make_method("quest", settings)
    index = LayerIndex(tensors=policy.build(LayerKeys(layer_idx=0, keys=keys[:, :n], tail=tail), {}, {}),
                       num_keys=n + tail, tail=tail)
    plans = [policy.plan_keys({}, f, f, f) for f in KEYS_GRID]
    assert_reads_as_its_lookups(policy, index, plans, queries, n, tail)


@pytest.mark.parametrize("settings", [{}, {"rank": "mass"}, {"dense_first_layer": False}])
def test_saap_reads_every_plan_as_its_lookups_do(settings):
    """SaapPolicy.reads scores, ranks and counts the buckets once for all the plans; each value equals
    Lookup.read_fraction of the method's own lookup at that plan (Method.reads), decode steps and a question's
    prefill alike, in a layer read whole (the first, by default) and in a sparse one."""
    from engine.attention.method import LayerIndex, Method
    from engine.context.ingest import build_methods
    from engine.index.artifacts import layer_part
    from engine.methods import build_order, make_method, stand_ins

    g = torch.Generator().manual_seed(10)
    hq, hkv, d, n, tail = 4, 2, 16, 400, 8
    keys = {i: torch.randn(hkv, n + tail, d, generator=g) for i in (0, 1)}
    queries = {i: torch.randn(hq, 24, d, generator=g) for i in keys}
    methods = [make_method(m, {"buckets": 16, "hidden": 8, **settings} if m == "saap" else None)
               for m in build_order(["saap"])]
    prepared = stand_ins(methods, [0, 1], hkv, d)
    artifacts = build_methods(keys, queries, tail, methods, d**-0.5, torch.device("cpu"), prepared=prepared)
    policy = methods[-1]
    plans = [policy.plan_keys({}, f, f, f) for f in KEYS_GRID]
    for layer in (0, 1):
        own = layer_part(prepared["saap"], layer)  # the model-level parts, as a session's index holds them
        built = {k.split(".", 2)[2]: t for k, t in artifacts.items() if k.startswith(f"saap.layer{layer}.")}
        index = LayerIndex({**own, **built}, n + tail, tail)
        q = queries[layer]
        for step, pos in ((q[:, -1:], torch.tensor([n + tail - 1])), (q[:, 2:14], torch.arange(n - 12, n))):
            fast = policy.reads(step, index, plans, d**-0.5, pos)
            assert fast == pytest.approx(Method.reads(policy, step, index, plans, d**-0.5, pos), abs=1e-12)
            whole = layer == 0 and settings.get("dense_first_layer", True)
            assert (len(set(fast)) == 1) if whole else (len(set(fast)) > 3)  # a whole layer reads every key


@pytest.mark.parametrize("settings", [{}, {"group": "query"}, {"centroids": "exact", "level1_ratio": 0.05}])
def test_hsqueeze_reads_every_plan_as_its_lookups_do(settings):
    """HierarchicalSqueezePolicy.reads scores level 1 once and level 2 once per level-1 threshold; each value equals
    Lookup.read_fraction of the method's own lookup at that plan (Method.reads), decode steps and a question's
    prefill alike: the budget curves are unchanged."""
    from engine.attention.method import CalibrationSet, LayerIndex, LayerKeys
    from engine.methods import make_method

    g = torch.Generator().manual_seed(8)
    hq, hkv, d, n, tail = 4, 2, 16, 400, 8
    keys = torch.randn(hkv, n + tail, d, generator=g)
    queries = torch.randn(hq, 40, d, generator=g)
    squeeze = make_method("squeeze", {"centroid_ratio": 0.1})
    layer = LayerKeys(layer_idx=0, keys=keys[:, :n], tail=tail)
    required = {"squeeze": squeeze.build(layer, {}, {})}
    policy = make_method("hsqueeze", {"level1_ratio": 0.02, **settings})
    index = LayerIndex(tensors=policy.build(layer, required, {}), num_keys=n + tail, tail=tail)
    calibration = policy.calibrate([CalibrationSet(index=index, queries=queries)], d**-0.5)
    plans = [policy.plan_keys(calibration, f, f, f) for f in KEYS_GRID]
    assert_reads_as_its_lookups(policy, index, plans, queries, n, tail)


@pytest.mark.parametrize("settings", [{}, {"group": "query"}, {"centroids": "exact", "centroid_ratio": 0.1}])
def test_squeeze_reads_every_plan_as_its_lookups_do(settings):
    """SqueezePolicy.reads scores once for all the plans; each value equals Lookup.read_fraction of the method's own lookup
    at that plan (Method.reads), decode steps and a question's prefill alike: the budget curves are unchanged."""
    from engine.attention.method import CalibrationSet, LayerIndex, LayerKeys
    from engine.methods import make_method

    g = torch.Generator().manual_seed(7)
    hq, hkv, d, n, tail = 4, 2, 16, 300, 8
    keys = torch.randn(hkv, n + tail, d, generator=g)
    queries = torch.randn(hq, 40, d, generator=g)
    policy = make_method("squeeze", settings)
    index = LayerIndex(tensors=policy.build(LayerKeys(layer_idx=0, keys=keys[:, :n], tail=tail), {}, {}),
                       num_keys=n + tail, tail=tail)
    calibration = policy.calibrate([CalibrationSet(index=index, queries=queries)], d**-0.5)
    plans = [policy.plan_keys(calibration, f, f, f) for f in KEYS_GRID]
    assert_reads_as_its_lookups(policy, index, plans, queries, n, tail)


def test_the_follow_rows_each_unit_holds():
    """KeyCount.held: each listed follow row within the indexed range lands in the unit of each KV head whose key
    range holds its place in the layout (order), once per head; rows outside the range (the sink, the dense tail) and
    missing ones (-1) in none; without an order, a row's place is its position less the first indexed one."""
    starts = torch.tensor([[0, 3, 3, 8, 10], [0, 5, 6, 9, 10]])  # [Hkv = 2, U + 1]: unit u at [starts[u], starts[u+1])
    order = torch.tensor([[5, 1, 2, 6, 9, 0, 3, 7, 8, 4], list(range(10))], dtype=torch.int32)  # [2, indexed = 10]
    follow = FollowRows(torch.tensor([-1, 1, 2, 6, 11, 12, 14]), first=2, indexed=10, order=order)  # 0, 4, 9, 10
    keys = less_follow(100.0, 2, follow)
    # head 0: rows 0, 4, 9 lie at 5, 9, 4 -> units 2, 3, 2; head 1 as stored: 0, 4, 9 -> units 0, 0, 3
    assert keys.held(starts).tolist() == [[0, 0, 2, 1], [2, 0, 0, 1]]
    assert float(keys.value()) == 100.0 - 2 * 3
    unordered = less_follow(100.0, 2, FollowRows(follow.positions, first=2, indexed=10))
    assert unordered.held(starts).tolist() == [[1, 0, 1, 1], [2, 0, 0, 1]]
    assert less_follow(100.0, 2, None).held(starts).sum() == 0


def test_the_follow_rows_quests_best_pages_hold():
    """held_in_pages: the indexed follow rows each KV head reads anyway, in its k best pages or past its full pages,
    averaged over the heads; more pages hold more of them (the pages a cut with follow rows fits grow with them)."""
    from engine.methods.quest import held_in_pages

    scores = torch.tensor([[0.9, 0.1, 0.5, 0.2], [0.1, 0.9, 0.2, 0.5]])  # [Hkv = 2, P = 4] pages of 4 keys
    follow = FollowRows(torch.tensor([-1, 1, 2, 6, 17, 19, 30]), first=1, indexed=20)  # rows 0, 1, 5, 16, 18
    # head 0's best page is 0 (rows 0, 1), head 1's page 1 (row 5); rows 16, 18 lie past the full pages (read)
    assert held_in_pages(scores, 1, follow, 4) == (4 + 3) / 2
    assert held_in_pages(scores, 2, follow, 4) == (4 + 3) / 2  # page 2 / page 3 hold none
    assert held_in_pages(scores, 4, follow, 4) == 5.0
    order = torch.tensor([list(range(20)), list(range(19, -1, -1))], dtype=torch.int32)  # head 1 reversed
    # head 1: rows 0, 1, 5, 16, 18 lie at 19, 18, 14, 3, 1 -> past the full pages, past, page 3, page 0, page 0
    assert held_in_pages(scores, 1, FollowRows(follow.positions, 1, 20, order), 4) == (4 + 2) / 2
