"""The engine end to end on tiny random-weight models (GQA, MHA, sliding-window hybrid), on the CPU.

Each model goes the real way: saved to a directory, loaded with `load_model(path)`, a document ingested
(prefill + every method's index + calibration), then a ContextSession answers. The references are the same
weights run by transformers' own attention ("sdpa", and "eager" as a second opinion) over the whole sequence
in one plain forward, without any cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.attention.function import ATTN_NAME
from engine.context.ingest import ingest_tokens
from engine.context.session import ContextSession
from engine.context.settings import ContextSettings
from engine.index.kmeans import query_moment
from engine.methods import METHODS, SPARSE_METHODS, build_order, make_method
from engine.model.generate import generate_tokens
from engine.model.load import LoadedModel, load_model
from engine.model.prefill import prefill
from engine.text.prompt import ANSWER_RESERVE, STOP_STRINGS, DocumentTooLongError, question_ids, tokenize_document
from kernels.backend import REFERENCE
from tests.support.tiny_models import GEMMA_SLIDING_WINDOW, SMALL_SAAP, byte_tokenizer, gates_for

# ~600 characters of varied text: digits, punctuation, capitals, one non-ASCII word (several bytes per char).
DOCUMENT = (
    "The lighthouse on Karvik Point was built in 1887 from granite quarried two miles inland. "
    "Its keeper, Ingrid Solberg, logged the weather every four hours: wind, swell, visibility. "
    "In March 1903 a storm tore the lantern room open; the lens survived, the logbook did not. "
    "Ships' captains (mostly herring men from Bergen) paid a toll of 3 kroner per passage. "
    "The café by the harbour sold coffee at 12 öre a cup and kept a barometer behind the till. "
    "By 1925 the light was electrified; a diesel generator replaced the paraffin lamps. "
    "Today the tower is a museum - open May to September, closed Mondays - with 147 steps to the top."
)
QUESTION = "Who kept the lighthouse logbook?"
SETTINGS = ContextSettings(dense_tail=16)
# every sparse method, squeeze's at the ratio the tiny documents need (the paper's 5% of ~600 keys is 30 centroids)
METHOD_SETTINGS = {"squeeze": {"centroid_ratio": 0.1}, "hsqueeze": {"level1_ratio": 0.02}, **SMALL_SAAP}


def all_methods(**overrides) -> list:
    settings = {**METHOD_SETTINGS, **overrides}
    return [make_method(n, settings.get(n)) for n in build_order(SPARSE_METHODS)]
HIGH_SPARSITY = 0.9
NEW_TOKENS = 8
# fp32 everywhere; the engine splits attention into parts (fixed context, new tokens) merged by log-sum-exp,
# and the sparse paths gather keys, so only the summation order differs from transformers' attention.
TOL = dict(atol=1e-4, rtol=1e-4)


@dataclass
class TinyContext:
    arch: str
    lm: LoadedModel
    fixed_ids: torch.Tensor  # [L] the ingested document's ids (BOS first)
    session: ContextSession


@pytest.fixture(scope="module")
def ctx(tiny_model_path) -> TinyContext:
    """One arch's model loaded from its directory, the document ingested, a session over it."""
    lm = load_model(str(tiny_model_path), device="cpu")
    fc = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context)
    methods = all_methods()
    out = ingest_tokens(lm, fc.ids, SETTINGS, REFERENCE, methods, prepared=gates_for(lm, methods))
    session = ContextSession(lm, out.artifacts, SETTINGS, REFERENCE, methods={m.name: m for m in methods})
    return TinyContext(tiny_model_path.name, lm, fc.ids, session)


def plain_logits(lm: LoadedModel, ids: torch.Tensor, attn: str) -> torch.Tensor:
    """[L, V] float32 logits of ids [L] from one plain forward (no cache) with transformers' `attn` attention."""
    lm.model.set_attn_implementation(attn)
    try:
        with torch.inference_mode():
            return lm.model(input_ids=ids[None].to(lm.device), use_cache=False).logits[0].float()
    finally:
        lm.model.set_attn_implementation(ATTN_NAME)


def plain_greedy(lm: LoadedModel, ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy tokens after ids [L], recomputing the whole sequence each step with sdpa (stops after an EOS)."""
    eos, tokens = lm.eos_ids(), []
    for _ in range(max_new_tokens):
        token = int(plain_logits(lm, ids, "sdpa")[-1].argmax())
        tokens.append(token)
        if token in eos:
            break
        ids = torch.cat([ids, torch.tensor([token])])
    return tokens


def answer_text(tokenizer, tokens: list[int], eos: set[int]) -> str:
    """What ContextSession makes of generated tokens: up to the first EOS, cut at a stop string, stripped."""
    kept = []
    for t in tokens:
        if t in eos:
            break
        kept.append(t)
    text = tokenizer.decode(kept, skip_special_tokens=True)
    stops = [text.find(s) for s in STOP_STRINGS if s in text]
    return (text[: min(stops)] if stops else text).strip()


# --------------------------------------------------------------------------- the tiny models themselves


def test_byte_tokenizer_is_one_token_per_byte():
    tok = byte_tokenizer()
    text = "Café 3€\n\nQuestion:"
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert len(enc["input_ids"]) == len(text.encode("utf-8"))
    assert len(enc["offset_mapping"]) == len(enc["input_ids"])
    assert tok.decode(enc["input_ids"]) == text
    assert (tok.bos_token, tok.eos_token, len(tok)) == ("<bos>", "<eos>", 258)


def test_loaded_model_matches_its_arch(ctx):
    lm = ctx.lm
    assert lm.model.config._attn_implementation == ATTN_NAME
    assert lm.num_heads == 4 and lm.head_dim == 16
    expected = {
        "llama_gqa": (2, [None, None]),
        "qwen2_mha": (4, [None, None]),
        "gemma3_hybrid": (1, [GEMMA_SLIDING_WINDOW] * 5 + [None]),
    }[ctx.arch]
    assert (lm.num_kv_heads, lm.sliding_windows) == expected
    if ctx.arch == "gemma3_hybrid":  # the document spans several windows, so the window changes the answer
        assert ctx.fixed_ids.numel() > 2 * GEMMA_SLIDING_WINDOW


# --------------------------------------------------------------------------- exactness against transformers


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("method", METHODS)
def test_logits_match_standard_attention(ctx, method, attn):
    """At sparsity 0 (budget 1) every method attends to every key, so it must reproduce the model's own attention."""
    q_ids = question_ids(ctx.lm.tokenizer, QUESTION)
    expected = plain_logits(ctx.lm, torch.cat([ctx.fixed_ids, q_ids]), attn)[ctx.fixed_ids.numel():]
    got = ctx.session.logits(QUESTION, method, 0.0)
    assert got.shape == (q_ids.numel(), len(ctx.lm.tokenizer))
    torch.testing.assert_close(got, expected, **TOL)


def test_generation_over_cache_equals_plain_greedy(ctx):
    lm, session = ctx.lm, ctx.session
    prompt = question_ids(lm.tokenizer, QUESTION)
    expected = plain_greedy(lm, torch.cat([ctx.fixed_ids, prompt]), NEW_TOKENS)
    got = list(generate_tokens(lm, session.step_context("full", 0.0, None), prompt, NEW_TOKENS))
    session.cache.reset_dynamic()
    assert got == expected
    answer = session.ask(QUESTION, "full", 0.0, max_new_tokens=NEW_TOKENS)
    assert answer.text == answer_text(lm.tokenizer, expected, lm.eos_ids())


def test_session_turns_leave_fixed_context_unchanged(ctx):
    """A turn's new tokens are dropped afterwards: asking twice gives the same logits, the fixed part stays."""
    first = ctx.session.logits(QUESTION, "full")  # (arranges the K/V in their original order: whatever ran before)
    before = [(layer.fixed_keys.clone(), layer.fixed_len) for layer in ctx.session.cache.layers]
    ctx.session.ask("What was the toll?", "squeeze", HIGH_SPARSITY, max_new_tokens=3)
    torch.testing.assert_close(ctx.session.logits(QUESTION, "full"), first, atol=0, rtol=0)
    for layer, (keys, length) in zip(ctx.session.cache.layers, before):
        assert layer.fixed_len == length and layer.dynamic_length() == 0
        assert torch.equal(layer.fixed_keys, keys)


def test_session_takes_over_the_fixed_kv(ctx):
    """The session pops the fixed K/V out of the artifacts: one copy of the context on the device. A layer that is
    not permuted by cluster (a sliding window's) keeps the ingest's very tensor."""
    methods = all_methods()
    artifacts = ingest_tokens(ctx.lm, ctx.fixed_ids, SETTINGS, REFERENCE, methods,
                              prepared=gates_for(ctx.lm, methods)).artifacts
    made = {i: artifacts[f"layer{i}.keys"].data_ptr() for i in range(ctx.lm.num_layers)}
    session = ContextSession(ctx.lm, artifacts, SETTINGS, REFERENCE)
    assert not [name for name in artifacts if name.endswith((".keys", ".values"))]
    for i, layer in enumerate(session.cache.layers):
        assert layer.fixed_keys.data_ptr() == made[i]  # arranged in place for a method, never copied


def test_arranging_for_a_method_keeps_storage_and_restores_order(ctx):
    """The K/V are put in each method's layout in place (captured steps keep their pointers) and back."""
    session = ctx.session
    session.arrange(None)
    layer = session.cache.layers[ctx.lm.global_layers[0]]
    original, ptr = layer.fixed_keys.clone(), layer.fixed_keys.data_ptr()
    for name in ("squeeze", "hsqueeze", "quest", "squeeze", None):
        session.arrange(session.methods[name] if name else None)
        assert layer.fixed_keys.data_ptr() == ptr
        layout = session.methods[name].layout(layer.indexes[name]) if name else None
        want = original if layout is None else layout.permute(original)
        assert torch.equal(layer.fixed_keys, want), name


def test_build_adds_a_method_to_an_open_session(ctx):
    """A method built later from the session's own K/V gives the same artifacts as one built at ingest."""
    out = ingest_tokens(ctx.lm, ctx.fixed_ids, SETTINGS, REFERENCE, [make_method("squeeze", METHOD_SETTINGS["squeeze"])])
    session = ContextSession(ctx.lm, out.artifacts, SETTINGS, REFERENCE)
    assert set(session.methods) == {"full", "squeeze"}
    made = session.build(make_method("quest"))
    assert set(session.methods) == {"full", "squeeze", "quest"}
    prefix = "quest."
    for name, t in made.items():
        assert name.startswith(prefix)
    torch.testing.assert_close(session.logits(QUESTION, "quest", 0.0), ctx.session.logits(QUESTION, "full"), **TOL)
    with pytest.raises(ValueError, match="not built"):
        session.plan("hsqueeze", 0.5)


def test_stream_resumed_from_other_threads(ctx):
    """Gradio resumes a streaming handler on any of its worker threads; torch's inference mode is per thread, so
    generation must not hold it across a yield (a step resumed elsewhere ran with autograd on and failed on the
    inference tensors of the cache). Each next() here runs on a new thread, and one turn is closed midway."""
    import threading  # noqa: PLC0415

    def drive(stop_after: int | None) -> list[str]:
        events, stream = [], ctx.session.stream(QUESTION, "squeeze", HIGH_SPARSITY, max_new_tokens=NEW_TOKENS)
        while stop_after is None or len(events) < stop_after:
            box: dict = {}
            thread = threading.Thread(target=lambda: box.update(event=next(stream, None)))
            thread.start()
            thread.join()
            if box["event"] is None:
                return events
            events.append(type(box["event"]).__name__)
        stream.close()
        return events

    assert len(drive(stop_after=1)) == 1
    assert drive(stop_after=None)[-1] == "Answer"


# --------------------------------------------------------------------------- sparse methods


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_high_sparsity_runs_and_reports(ctx, method):
    lm, session = ctx.lm, ctx.session
    logits = session.logits(QUESTION, method, HIGH_SPARSITY)
    assert torch.isfinite(logits).all()
    stats = session.ask(QUESTION, method, HIGH_SPARSITY, max_new_tokens=4).stats
    assert stats.global_layers == lm.global_layers
    assert len(stats.kept_fraction) == len(lm.global_layers)
    assert all(len(row) == lm.num_heads for row in stats.kept_fraction)
    kept = torch.tensor(stats.kept_fraction)
    assert ((kept >= 0) & (kept <= 1)).all()
    if method in ("squeeze", "quest"):
        assert float(kept.mean()) < 0.6
    assert stats.extra["plan"] and stats.extra["unit"] == session.methods[method].unit
    assert 0 < stats.kv_budget < 1


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_a_turn_records_what_its_lookups_scored(ctx, method):
    """Answer.unit_scores: per global layer the prefill lookup's unit scores, the decode steps' best ones and the
    units' sizes, from the turn itself; the explanation is built from them (no second pass of the model): a unit
    the prefill kept has a score above the plan's prefill threshold; the answer's steps are read against decode's."""
    from engine.serve.explain import explain_turn  # noqa: PLC0415

    answer = ctx.session.ask(QUESTION, method, 0.7, max_new_tokens=4)
    layer = ctx.session.cache.layers[ctx.lm.global_layers[0]].indexes[method]
    if ctx.session.methods[method].unit_labels(layer) is None:  # no units (duo: heads read all or a window)
        assert answer.unit_scores == {} and answer.stats.clusters == []
        return
    assert set(answer.unit_scores) == set(ctx.lm.global_layers)
    threshold = answer.plan.retrieval_threshold()
    for entry in answer.stats.clusters:
        units = answer.unit_scores[entry["layer"]]
        assert units["question"].shape == units["answer"].shape
        index = ctx.session.cache.layers[entry["layer"]].indexes[method]
        if "counts" in index:  # clusters: their sizes (Saap's dense part, its last group, is no unit); pages: all alike
            groups = index["counts"].shape[1]
            assert units["sizes"].shape[1] == groups - (method == "saap")
            assert torch.equal(units["sizes"], index["counts"].cpu()[:, :units["sizes"].shape[1]])
        else:
            assert (units["sizes"] == ctx.session.methods[method].settings.page_size).all()
        kept = torch.zeros_like(units["question"], dtype=torch.bool)
        for row in entry["rows"]:
            assert row["scores"] == [round(float(units["question"][row["row"], i]), 6) for i in row["ids"]]
            kept[row["row"], row["ids"]] = True
        if threshold is not None:  # the question's kept units are the layer's best scored ones (over every row
            # that keeps units: duo-squeeze's streaming heads read their windows)
            live = (units["sizes"].expand_as(kept) > 0) & kept.any(dim=1, keepdim=True)
            left = units["question"][live & ~kept]
            assert kept.any() or method == "duo-squeeze"  # (a layer of streaming heads alone keeps no unit)
            assert left.numel() == 0 or units["question"][kept].min() > left.max()
    report = explain_turn(answer, method)
    assert report["method"] == method and report["scored"] == (threshold is not None)
    assert [e["layer"] for e in report["layers"]] == ctx.lm.global_layers
    for entry in report["layers"]:  # each unit's best score over the answer's steps, ranked units (Quest's) too
        best = answer.unit_scores[entry["layer"]]["answer"]
        for row in entry["rows"]:
            assert row["s_answer"] == [round(float(best[row["row"], c]), 6) for c in row["ids"]]
    if threshold is None:
        assert any(v != 0.0 for e in report["layers"] for row in e["rows"] for v in row["s_answer"])


def test_prefill_threshold_option_end_to_end(ctx):
    """prefill_threshold (squeeze's and hsqueeze's settings): by default ("calibrated") the ingest stores the
    question prefill's own thresholds and the plans carry them beside decode's; "decode" stores none and a question
    uses decode's thresholds (which are the same in both: a decode step reads the same either way). At sparsity 0
    it is still full attention."""
    same = {"prefill_threshold": "decode"}
    methods = all_methods(squeeze={**METHOD_SETTINGS["squeeze"], **same},
                          hsqueeze={**METHOD_SETTINGS["hsqueeze"], **same})
    out = ingest_tokens(ctx.lm, ctx.fixed_ids, SETTINGS, REFERENCE, methods, prepared=gates_for(ctx.lm, methods))
    names = {"squeeze.calib.threshold_prefill", "hsqueeze.calib.threshold_l1_prefill",
             "hsqueeze.calib.threshold_l2_prefill"}
    assert not names & set(out.artifacts)
    assert "threshold_prefill" in ctx.session.calibration["squeeze"]
    session = ContextSession(ctx.lm, out.artifacts, SETTINGS, REFERENCE, methods={m.name: m for m in methods})
    full = ctx.session.logits(QUESTION, "full")
    for method in ("squeeze", "hsqueeze"):
        plan, calibrated = session.plan(method, HIGH_SPARSITY), ctx.session.plan(method, HIGH_SPARSITY)
        assert plan.prefill == plan.decode and calibrated.prefill != calibrated.decode
        assert plan.decode == calibrated.decode
        torch.testing.assert_close(session.logits(QUESTION, method, 0.0), full, **TOL)
        assert torch.isfinite(session.logits(QUESTION, method, HIGH_SPARSITY)).all()


def test_ingest_hands_each_artifact_over_once_when_final(ctx):
    """on_artifact (engine.serve.writer saves through it): every artifact once, the very tensors returned; each global
    layer's K/V before its clustering (ahead of its index), every index before the calibrations."""
    handed: list[tuple[str, torch.Tensor]] = []
    methods = all_methods()
    out = ingest_tokens(ctx.lm, ctx.fixed_ids, SETTINGS, REFERENCE, methods,
                        on_artifact=lambda n, t: handed.append((n, t)), prepared=gates_for(ctx.lm, methods))
    names = [n for n, _ in handed]
    assert sorted(names) == sorted(out.artifacts) and len(set(names)) == len(names)
    assert all(t is out.artifacts[n] for n, t in handed)
    order = {n: i for i, n in enumerate(names)}
    for layer in ctx.lm.global_layers:
        index = [n for n in names if f".layer{layer}." in n]  # every method's index of the layer
        assert index and order[f"layer{layer}.keys"] < min(order[n] for n in index)
    calibrations = [order[n] for n in names if ".calib." in n]
    assert calibrations and min(calibrations) > max(order[n] for n in names if ".calib." not in n)


# --------------------------------------------------------------------------- sliding windows


def test_fixed_cache_keeps_only_the_window_in_sliding_layers(ctx):
    """Sliding layers keep the document's last `window` keys; global layers keep all of them."""
    fixed_len = ctx.fixed_ids.numel()
    for layer, window in zip(ctx.session.cache.layers, ctx.lm.sliding_windows):
        assert layer.fixed_len == fixed_len
        expected = fixed_len if window is None else min(window, fixed_len)
        assert layer.fixed_keys.shape[1] == layer.fixed_values.shape[1] == expected
    if ctx.arch == "gemma3_hybrid":
        assert sum(w is not None for w in ctx.lm.sliding_windows) == 5


@pytest.mark.parametrize("tiny_model_path", ["gemma3_hybrid"], indirect=True)
def test_sliding_window_changes_the_reference(tiny_model_path):
    """Guard on the test itself: the document is long enough that ignoring the window changes the logits
    far beyond TOL, so the sdpa comparison above does check the engine's sliding layers."""
    lm = load_model(str(tiny_model_path), device="cpu")  # a private copy: its windows are widened below
    fixed = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context).ids
    ids = torch.cat([fixed, question_ids(lm.tokenizer, QUESTION)])
    windowed = plain_logits(lm, ids, "sdpa")
    lm.model.config.sliding_window = ids.numel() + 1
    for layer in lm.model.get_decoder().layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = ids.numel() + 1
    unwindowed = plain_logits(lm, ids, "sdpa")
    assert (windowed - unwindowed).abs().max() > 100 * TOL["atol"]


@pytest.mark.parametrize("chunk", [24, 40])  # shorter and longer than the window; neither divides the document
def test_chunked_prefill_equals_one_chunk(ctx, chunk):
    """The fixed K/V (sliding layers trimmed between chunks) and the captured calibration queries do not
    depend on how the prefill is chunked."""
    tail = SETTINGS.rows(ctx.fixed_ids.numel()).tail
    whole, whole_q = prefill(ctx.lm, ctx.fixed_ids, tail, REFERENCE)
    chunked, chunked_q = prefill(ctx.lm, ctx.fixed_ids, tail, REFERENCE, chunk=chunk)
    for a, b in zip(whole.layers, chunked.layers):
        assert a.fixed_len == b.fixed_len == ctx.fixed_ids.numel()
        torch.testing.assert_close(b.fixed_keys, a.fixed_keys, **TOL)
        torch.testing.assert_close(b.fixed_values, a.fixed_values, **TOL)
    assert sorted(chunked_q.queries) == sorted(whole_q.queries) == ctx.lm.global_layers
    for layer in ctx.lm.global_layers:
        got, expected = torch.cat(chunked_q.queries[layer], dim=1), torch.cat(whole_q.queries[layer], dim=1)
        assert got.shape[1] == tail
        torch.testing.assert_close(got, expected, **TOL)
        hkv = whole.layers[layer].fixed_keys.shape[0]
        torch.testing.assert_close(chunked_q.moment(layer, hkv), whole_q.moment(layer, hkv), **TOL)


def test_query_moments_are_every_positions(ctx):
    """The ingest keeps each global layer's second moment of the unit queries over every position of the document
    (QueryCapture.moment: equal to query_moment of all the document's queries), stores it as `layer{i}
    .query_moment`, and a method built later from a stored context clusters with it (the same index as at ingest)."""
    n = ctx.fixed_ids.numel()
    _, everything = prefill(ctx.lm, ctx.fixed_ids, n, REFERENCE)
    settings = {"centroid_ratio": 0.1, "kmeans": "query"}
    out = ingest_tokens(ctx.lm, ctx.fixed_ids, SETTINGS, REFERENCE, [make_method("squeeze", settings)])
    for layer in ctx.lm.global_layers:
        queries = torch.cat(everything.queries[layer], dim=1)  # [Hq, n, D]
        assert queries.shape[1] == n
        stored = out.artifacts[f"layer{layer}.query_moment"]
        torch.testing.assert_close(stored, query_moment(queries, stored.shape[0]), **TOL)
    session = ContextSession(ctx.lm, dict(out.artifacts), SETTINGS, REFERENCE)
    session.methods.pop("squeeze")
    made = session.build(make_method("squeeze", settings))
    for layer in ctx.lm.global_layers:
        assert torch.equal(made[f"squeeze.layer{layer}.labels"], out.artifacts[f"squeeze.layer{layer}.labels"])


# --------------------------------------------------------------------------- document length


def test_document_too_long_is_refused_with_counts():
    tok = byte_tokenizer()
    tokens = 1 + len(DOCUMENT.encode("utf-8"))  # BOS + one token per byte
    limit = 50
    with pytest.raises(DocumentTooLongError) as err:
        tokenize_document(tok, DOCUMENT, ANSWER_RESERVE + limit)
    assert (err.value.tokens, err.value.limit) == (tokens, limit)
    assert str(tokens) in str(err.value) and str(limit) in str(err.value)


def test_document_truncated_to_the_limit():
    tok = byte_tokenizer()
    limit = 50
    fc = tokenize_document(tok, DOCUMENT, ANSWER_RESERVE + limit, truncate=True)
    assert fc.truncated
    assert fc.ids.shape == (limit,) and fc.offsets.shape == (limit, 2)
    whole = tokenize_document(tok, DOCUMENT, ANSWER_RESERVE + 4 * len(DOCUMENT))
    assert not whole.truncated
    assert torch.equal(fc.ids, whole.ids[:limit]) and torch.equal(fc.offsets, whole.offsets[:limit])
