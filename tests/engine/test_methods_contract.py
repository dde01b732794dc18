"""One contract, every registered method (engine.methods.REGISTRY): the same checks for each.

- budget 1 reads every key and equals full attention;
- a selection is valid (CSR rows, keys in range, no repeats, the dense tail in every row) in the method's layout;
- the Triton backend's lookup equals the reference's (the kernels run in the interpreter on the CPU);
- a budget is what a step reads, index included, in both phases, over the calibration queries;
- each with its defaults, and the methods with another index (float centroids, one-byte page bounds) with it too.

The context is synthetic: two global layers of clustered keys (so that a lookup has structure to find), GQA 4/2,
the calibration queries drawn near the keys as a model's are.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.context.ingest import build_methods
from engine.methods import REGISTRY, SPARSE_METHODS, LayerIndex, build_order, make_method
from engine.methods.quest import QuestPolicy
from kernels.backend import REFERENCE, TRITON

pytestmark = pytest.mark.usefixtures("one_thread")

HQ, HKV, D = 4, 2, 16
INDEXED, TAIL = 640, 24
SCALE = 1.0 / math.sqrt(D)
LAYERS = (1, 3)
# Attention of the same keys through the reference and through the kernels: float32 sums in another order.
ATOL = 2e-5
# A budget's measured read over the calibration queries, within this much of it: the reads are
# calibrated on these very queries, at grid points between which the plan interpolates (a threshold keeps a
# different share of the keys at each step; a top-K method rounds to whole pages).
BUDGET_TOL = 0.03
# Settings scaled to this 664-key context where a method's defaults assume a document (DuoAttention's streaming
# window: 64 sink + 256 recent keys would be half of it, a floor above the budgets tested below), or where a
# method's ceiling here sits near the 0.5 budget checked below: hsqueeze's level 1 at its default would rule out
# half of the keys (it read 0.466 of a 0.5 budget, the one-byte centroids leaving more of it to keys), and with two
# of duo-squeeze's four heads streaming it read at most 0.464.
SMALL_CONTEXT = {"hsqueeze": {"level1_prune": 0.3}, "duo": {"sink": 8, "recent": 48},
                 "duo-squeeze": {"sink": 8, "recent": 48, "retrieval": 0.75}, "saap": {"buckets": 32, "hidden": 16}}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run compiled on a GPU, interpreted otherwise
# Every method is checked with its defaults, and these with their other index too: float centroids (the paper's;
# one byte is the default, duo-squeeze reads squeeze's) and exact page bounds (the paper's; one byte is the default).
OTHER_INDEX = {"squeeze": {"centroids": "exact"}, "hsqueeze": {"centroids": "exact"}, "quest": {"bounds": "exact"}}
# Settings of a lookup that are not its defaults, each a variant of its own: hsqueeze's level 1 at its calibrated
# threshold rather than cut at a number of keys.
VARIANTS = {"defaults": {}, "other index": OTHER_INDEX, "level-1 threshold": {"hsqueeze": {"level1": "threshold"}}}
CASES = [pytest.param(n, "defaults", id=n) for n in SPARSE_METHODS] + [
    pytest.param(n, "other index", id=f"{n}-other-index") for n in ("squeeze", "hsqueeze", "duo-squeeze", "quest")] + [
    pytest.param("hsqueeze", "level-1 threshold", id="hsqueeze-level-1-threshold")]


def synthetic_context(seed: int = 0):
    """keys: layer -> [Hkv, INDEXED + TAIL, D]; values alike; queries: layer -> [Hq, TAIL, D] near the keys."""
    g = torch.Generator().manual_seed(seed)
    keys, values, queries = {}, {}, {}
    for layer in LAYERS:
        centers = torch.randn(HKV, 24, D, generator=g) * 2
        which = torch.randint(0, 24, (HKV, INDEXED + TAIL), generator=g)
        keys[layer] = torch.gather(centers, 1, which[:, :, None].expand(-1, -1, D)) + 0.5 * torch.randn(
            HKV, INDEXED + TAIL, D, generator=g)
        values[layer] = torch.randn(HKV, INDEXED + TAIL, D, generator=g)
        pick = torch.randint(0, 24, (HQ, TAIL), generator=g)
        group = torch.arange(HQ)[:, None] // (HQ // HKV)
        queries[layer] = centers[group.expand(-1, TAIL), pick] + torch.randn(HQ, TAIL, D, generator=g)
    return keys, values, queries


def build_context(variant: str):
    keys, values, queries = synthetic_context()
    settings = {n: {**SMALL_CONTEXT.get(n, {}), **VARIANTS[variant].get(n, {})} for n in SPARSE_METHODS}
    methods = [make_method(n, settings[n]) for n in build_order(SPARSE_METHODS)]
    prepared = {m.name: m.stand_in(list(LAYERS), HKV, D) for m in methods}  # what a trained model would have given
    artifacts = build_methods(keys, queries, TAIL, methods, SCALE, torch.device("cpu"), prepared=prepared)
    for method in methods:  # a session's index joins the model-level artifacts to each layer's (engine.context.session)
        artifacts.update({f"{method.name}.{name}": t for name, t in prepared[method.name].items()})
    return keys, values, queries, {m.name: m for m in methods}, artifacts


@pytest.fixture(scope="module")
def contexts():
    """variant (of VARIANTS) -> (keys, values, queries, methods by name, artifacts), built once."""
    built = {}

    def get(variant: str):
        if variant not in built:
            built[variant] = build_context(variant)
        return built[variant]
    return get


def positions(a: int, b: int) -> torch.Tensor:
    """The positions of calibration queries a .. b - 1 (the context's last TAIL tokens)."""
    return torch.arange(INDEXED + a, INDEXED + b)


def steps(q: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A decode step (the last calibration query) and a question's prefill (the first 7), with their positions."""
    return [(q[:, -1:], positions(TAIL - 1, TAIL)), (q[:, :7], positions(0, 7))]


def layer_index(artifacts, name, layer):
    prefix = f"{name}.layer{layer}."
    tensors = {k[len(prefix):]: v for k, v in artifacts.items() if k.startswith(prefix)}
    return LayerIndex(tensors=tensors, num_keys=INDEXED + TAIL, tail=TAIL)


def calibration(artifacts, name):
    prefix = f"{name}.calib."
    return {k[len(prefix):]: v for k, v in artifacts.items() if k.startswith(prefix)}


def arranged(method, index, x):
    """x [Hkv, L, D] in the method's layout (what its selections index)."""
    layout = method.layout(index)
    return x if layout is None else layout.permute(x)


def test_registry_lists_every_method_once():
    assert len(set(REGISTRY)) == len(REGISTRY) and "full" in REGISTRY
    assert set(SPARSE_METHODS) == {n for n, cls in REGISTRY.items() if cls.sparse}
    for name in SPARSE_METHODS:
        order = build_order([name])
        assert order[-1] == name and set(REGISTRY[name].requires) <= set(order)


@pytest.mark.parametrize("name,variant", CASES)
def test_full_budget_is_full_attention(contexts, name, variant):
    keys, values, queries, methods, artifacts = contexts(variant)
    method = methods[name]
    plan = method.plan(calibration(artifacts, name), 1.0)
    for layer in LAYERS:
        index = layer_index(artifacts, name, layer)
        for q, at in steps(queries[layer]):  # a decode step, a question's prefill
            lookup = method.lookup(q, index, plan, SCALE, REFERENCE, at)
            assert bool(lookup.selection.to_mask().all()), f"{name} at budget 1 skipped keys"
            k, v = arranged(method, index, keys[layer]), arranged(method, index, values[layer])
            sparse = REFERENCE.kernel("sparse").sparse_attention(q, k, v, lookup.selection, SCALE)
            dense = REFERENCE.kernel("sparse").attention_with_lse(q, keys[layer], values[layer], SCALE)
            torch.testing.assert_close(sparse[0], dense[0], rtol=1e-5, atol=ATOL)
            torch.testing.assert_close(sparse[1], dense[1], rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize("name,variant", CASES)
@pytest.mark.parametrize("budget", [0.1, 0.3])
def test_selection_is_valid(contexts, name, variant, budget):
    keys, values, queries, methods, artifacts = contexts(variant)
    method = methods[name]
    plan = method.plan(calibration(artifacts, name), budget)
    for layer in LAYERS:
        index = layer_index(artifacts, name, layer)
        for q, at in steps(queries[layer]):
            sel = method.lookup(q, index, plan, SCALE, REFERENCE, at).selection
            indptr = sel.indptr
            assert sel.num_keys == INDEXED + TAIL and sel.rows in (HQ, HKV)
            assert int(indptr[0]) == 0 and bool((indptr[1:] >= indptr[:-1]).all())
            for r in range(sel.rows):
                row = sel.indices[indptr[r] : indptr[r + 1]].long()
                assert bool(((row >= 0) & (row < sel.num_keys)).all())
                assert row.unique().numel() == row.numel(), f"{name}: a key selected twice"
                assert set(range(INDEXED, INDEXED + TAIL)) <= set(row.tolist()), f"{name}: the dense tail is missing"


@pytest.mark.parametrize("name,variant", CASES)
def test_triton_lookup_equals_reference(contexts, name, variant):
    keys, values, queries, methods, artifacts = contexts(variant)
    method = methods[name]
    plan = method.plan(calibration(artifacts, name), 0.25)
    for layer in LAYERS:
        index = layer_index(artifacts, name, layer)
        on_device = LayerIndex({k: t.to(DEVICE) for k, t in index.tensors.items()}, index.num_keys, index.tail)
        for q, at in steps(queries[layer]):
            ref = method.lookup(q, index, plan, SCALE, REFERENCE, at)
            tri = method.lookup(q.to(DEVICE), on_device, plan, SCALE, TRITON, at.to(DEVICE))
            assert torch.equal(ref.selection.to_mask(), tri.selection.to_mask().cpu()), f"{name}: selections differ"
            torch.testing.assert_close(ref.index_elements.float(), tri.index_elements.float().cpu())
            k, v = arranged(method, index, keys[layer]), arranged(method, index, values[layer])
            out_ref = REFERENCE.kernel("sparse").sparse_attention(q, k, v, ref.selection, SCALE)
            out_tri = TRITON.kernel("sparse").sparse_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                                               tri.selection, SCALE)
            torch.testing.assert_close(out_tri[0].cpu(), out_ref[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,variant", CASES)
@pytest.mark.parametrize("budget", [0.2, 0.3, 0.5])
def test_measured_budget_is_the_asked_one(contexts, name, variant, budget):
    """The knob is a KV budget: over the calibration queries, a decode step and a question's prefill each read
    within BUDGET_TOL of the asked share of the K/V bytes, the index's bytes included (engine.attention.budget).
    Budgets from 0.2: below, this small context's index and dense tail alone (~0.06-0.1) leave little to keep."""
    from engine.index.thresholds import prefill_windows

    keys, values, queries, methods, artifacts = contexts(variant)
    method = methods[name]
    plan = method.plan(calibration(artifacts, name), budget)
    decode, prefill, weight = [], 0.0, 0.0
    for layer in LAYERS:
        index = layer_index(artifacts, name, layer)
        for t in range(TAIL):  # every calibration query as a decode step
            decode.append(method.lookup(queries[layer][:, t : t + 1], index, plan, SCALE, REFERENCE,
                                        positions(t, t + 1)).read_fraction(D, INDEXED + TAIL))
        for a, b, w in prefill_windows(TAIL):  # windows of them as questions
            found = method.lookup(queries[layer][:, a:b], index, plan, SCALE, REFERENCE, positions(a, b))
            prefill += w * found.read_fraction(D, INDEXED + TAIL)
            weight += w
    read_decode, read_prefill = sum(decode) / len(decode), prefill / weight
    assert abs(read_decode - budget) <= BUDGET_TOL, f"{name} decode at budget {budget} read {read_decode:.3f}"
    assert abs(read_prefill - budget) <= BUDGET_TOL, f"{name} prefill at budget {budget} read {read_prefill:.3f}"


class Probe(QuestPolicy):
    """Quest with a model-level artifact: per global layer a vector learned "once per model" (here: the query
    projection's first row), which every build and lookup must see in its layer's index."""

    name = "probe"
    prepared_calls = 0

    def prepare(self, lm, preparation=None) -> dict:
        type(self).prepared_calls += 1
        return {f"layer{i}.learned": lm.model.get_decoder().layers[i].self_attn.q_proj.weight[0].detach().float()
                for i in lm.global_layers}

    def build(self, layer, required, prepared):
        assert "learned" in prepared, "build did not get the model-level artifacts"
        return super().build(layer, required, prepared)

    def lookup(self, q, layer, plan, scale, backend, positions=None, valid=None, follow=None):
        assert "learned" in layer, "the lookup's index lacks the model-level artifacts"
        return super().lookup(q, layer, plan, scale, backend, positions, valid, follow)


def test_model_level_artifacts_are_made_once_and_stored_apart(tmp_path, monkeypatch):
    """Method.prepare runs once per model and settings; its artifacts live in the store's model table (not in any
    context), reach `build` at ingest and on demand, and join the layer's index in a session, also after a
    restart."""
    from engine.model.load import load_model
    from engine.serve.service import Engine
    from tests.support.tiny_models import make_tiny_model

    monkeypatch.setitem(REGISTRY, "probe", Probe)
    lm = load_model(str(make_tiny_model(tmp_path, "llama_gqa")), device="cpu")
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper rang the bell at dawn and logged the weather every four hours. " * 6)
    engine = Engine(tmp_path / "cache", lm=lm)
    report = engine.ingest(doc, methods=("squeeze", "probe"))
    assert Probe.prepared_calls == 1
    names = engine.store.models.names(lm.model_id, "probe", engine.method("probe").settings.as_dict())
    assert names == sorted(f"layer{i}.learned" for i in lm.global_layers)
    assert not [a for a in engine.store.artifacts.list(report.context_id) if "learned" in a["name"]]
    assert engine.ask(report.context_id, "Who rang the bell?", "probe", 0.5, 2).text is not None
    restarted = Engine(tmp_path / "cache", lm=lm)  # a new process: read back from the store, not made again
    assert restarted.ask(report.context_id, "Who rang the bell?", "probe", 0.5, 2).stats.method == "probe"
    other = {"probe": {"page_size": 8}}  # a request's own settings: rebuilt on demand, prepared for them
    assert restarted.ask(report.context_id, "Who rang the bell?", "probe", 0.5, 2, overrides=other).stats.method == "probe"
    assert Probe.prepared_calls == 2
    assert restarted.method_settings["probe"] == Probe.Settings()  # the engine's own settings are untouched
