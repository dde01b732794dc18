"""engine.attention.cache (static new-token buffers written at a device-side offset, the fixed part filled in place)
and engine.attention.stats.TurnRecorder (device totals, dense layers counted on the host, replayed steps handed over)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.cache import MIN_NEW_CAPACITY, FixedContextCache, FixedContextLayer
from engine.attention.method import Lookup
from engine.attention.stats import StepTotals, TurnRecorder
from kernels.selection import Selection

HKV, D = 2, 8


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g)


def test_new_tokens_land_at_the_device_offset_and_survive_growth():
    layer = FixedContextLayer(fixed_len=10)
    k1, v1 = kv(3, 0)
    layer.update(k1, v1)
    assert layer.new_keys.shape[1] == MIN_NEW_CAPACITY and int(layer.new_len) == 3 == layer.host_new
    layer.reserve(layer.new_keys, 2 * MIN_NEW_CAPACITY + 1)  # grows to the next power of two, keeps slots 0-2
    assert layer.new_keys.shape[1] == 4 * MIN_NEW_CAPACITY
    k2, v2 = kv(2, 1)
    layer.update(k2, v2)
    keys, values = layer.new_kv(static=False)
    torch.testing.assert_close(keys, torch.cat([k1, k2], dim=2)[0], atol=0, rtol=0)
    torch.testing.assert_close(values, torch.cat([v1, v2], dim=2)[0], atol=0, rtol=0)
    assert layer.new_kv(static=True)[0].shape[1] == 4 * MIN_NEW_CAPACITY  # every slot (a captured step)
    assert layer.get_seq_length() == 15
    layer.reset_dynamic()
    assert int(layer.new_len) == 0 == layer.host_new and layer.new_kv(static=False)[0].shape[1] == 0


@pytest.mark.parametrize("window", [None, 5])
def test_commit_into_the_preallocated_store_equals_concatenation(window):
    """A global layer with a capacity fills one store chunk by chunk; without one (and in sliding layers) the
    chunks are concatenated. Both give the same fixed part; sliding layers keep their window."""
    chunks = [kv(n, seed) for seed, n in enumerate((4, 7, 3))]
    caches = [FixedContextCache.empty([window], capacity=14), FixedContextCache.empty([window])]
    for cache in caches:
        for k, v in chunks:
            cache.layers[0].update(k, v)
            cache.commit()
    stored, concatenated = (c.layers[0] for c in caches)
    want_k = torch.cat([k for k, _ in chunks], dim=2)[0]
    if window is not None:
        want_k = want_k[:, -window:]
    assert stored.fixed_len == concatenated.fixed_len == 14
    torch.testing.assert_close(stored.fixed_keys, want_k, atol=0, rtol=0)
    torch.testing.assert_close(concatenated.fixed_keys, want_k, atol=0, rtol=0)
    assert (stored._store is not None) == (window is None)


def lookup(counts: list[int], num_keys: int, index: float) -> Lookup:
    """A lookup whose selection keeps counts[r] keys of row r (one row per KV head)."""
    indptr = torch.tensor([0] + counts).cumsum(0)
    indices = torch.cat([torch.arange(c) for c in counts])
    return Lookup(selection=Selection(indptr, indices, num_keys),
                  index_elements=torch.full((HKV,), index / HKV))


def test_recorder_totals_by_phase():
    """Prefill and two eager decode steps on layer 0 (sparse, one row per KV head) and layer 1 (dense), then two
    replayed steps handed over as totals: kept fractions per query head and the KV budget, counted by hand."""
    fixed, hq = 100, 4
    rec = TurnRecorder([0, 1], hq, HKV, D, fixed, sync_cuda=False)
    dense = Lookup(selection=None, index_elements=torch.zeros(1))
    rec.begin_step()  # the question's prefill
    rec.record(0, lookup([20, 40], fixed, 30.0))
    rec.record(1, dense)
    for _ in range(2):  # eager decode steps
        rec.begin_step()
        rec.record(0, lookup([10, 30], fixed, 30.0))
        rec.record(1, dense)
    replayed = StepTotals.zeros(2, hq, torch.device("cpu"))
    replayed.kept[0, :HKV] = torch.tensor([2 * 50.0, 2 * 10.0])  # two steps of [50, 10]
    replayed.read[0] = 2 * 30.0
    replayed.rows[0] = HKV
    replayed.dense.add(1)
    rec.add_decode(replayed, 2)
    stats = rec.finish("squeeze", 0.9, 5, {})
    assert stats.steps == 5 and stats.timings["timed_steps"] == 3  # the replayed two were not split
    assert stats.kept_fraction_prefill == [[0.2, 0.2, 0.4, 0.4], [1.0] * 4]
    decode_row0 = [(2 * 10 + 2 * 50) / 4 / fixed] * 2 + [(2 * 30 + 2 * 10) / 4 / fixed] * 2
    assert stats.kept_fraction_decode == [pytest.approx(decode_row0), [1.0] * 4]
    dense_kv = HKV * fixed * 2 * D  # one layer's fixed K/V elements
    prefill_read = (60 * 2 * D + 30) + dense_kv
    assert stats.kv_budget_prefill == pytest.approx(prefill_read / (2 * dense_kv), abs=1e-6)
    decode_read = 2 * (40 * 2 * D + 30) + 2 * (60 * 2 * D + 30) + 4 * dense_kv
    assert stats.kv_budget == pytest.approx((prefill_read + decode_read) / 5 / (2 * dense_kv), abs=1e-6)


def test_recorder_a_prefill_in_several_calls_is_one_phase():
    """A long question's prefill in two calls (the second `continued`): both calls' lookups are the prefill phase's,
    averaged as two lookups; the decode step after it is the decode phase's first, and a call continued after a
    decode step is refused."""
    fixed, hq = 100, 4
    rec = TurnRecorder([0], hq, HKV, D, fixed, sync_cuda=False)
    rec.begin_step()
    rec.record(0, lookup([20, 40], fixed, 30.0))
    rec.begin_step(continued=True)
    rec.record(0, lookup([40, 60], fixed, 30.0))
    rec.begin_step()  # the first decode step
    rec.record(0, lookup([10, 10], fixed, 30.0))
    stats = rec.finish("squeeze", 0.9, 2, {})
    assert stats.steps == 3 and stats.timings["timed_steps"] == 3
    assert stats.kept_fraction_prefill == [[0.3, 0.3, 0.5, 0.5]]
    assert stats.kept_fraction_decode == [[0.1, 0.1, 0.1, 0.1]]
    dense_kv = HKV * fixed * 2 * D
    assert stats.kv_budget_prefill == pytest.approx((80 * 2 * D + 30) / dense_kv, abs=1e-6)
    with pytest.raises(RuntimeError, match="prefill"):
        rec.begin_step(continued=True)


def test_recorder_union_when_rows_are_query_heads():
    """Rows per query head: a key two heads of a group select is read once (the union, counted on the device)."""
    fixed, hq = 50, 4
    rec = TurnRecorder([0], hq, HKV, D, fixed, sync_cuda=False)
    rec.begin_step()
    indptr = torch.tensor([0, 10, 20, 25, 30])  # heads 0-1 (KV head 0) both keys 0-9; heads 2-3 keys 0-4, 5-9
    indices = torch.cat([torch.arange(10), torch.arange(10), torch.arange(5), torch.arange(5, 10)])
    rec.record(0, Lookup(Selection(indptr, indices, fixed), torch.zeros(HKV)))
    stats = rec.finish("squeeze", 0.9, 1, {})
    assert stats.kept_fraction_prefill == [[0.2, 0.2, 0.1, 0.1]]
    assert stats.kv_budget_prefill == pytest.approx(20 / (HKV * fixed), abs=1e-6)  # 10 + 10 distinct keys
