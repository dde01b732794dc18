"""The rows of a global layer's fixed K/V (engine/attention/rows.py): the sink's tokens stored with the dense tail, the
same K/V as a context without a sink up to that order, the same full-attention answers, and every method reading
the sink at any budget."""

from __future__ import annotations

import pytest
import torch

from engine.attention.rows import FixedRows
from engine.bench import fidelity
from engine.bench.needles import context_session
from engine.context.settings import ContextSettings
from engine.methods import SPARSE_METHODS, make_method
from engine.model.load import load_model
from kernels.backend import REFERENCE
from tests.support.tiny_models import gates_for, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "The lighthouse keeper wrote every evening. " * 12


@pytest.mark.parametrize("tokens,sink,tail,want", [
    (100, 4, 10, (4, 10)),
    (100, 0, 10, (0, 10)),
    (12, 4, 10, (1, 10)),  # the sink shrinks first so that one token stays indexed
    (5, 4, 10, (0, 4)),  # then the tail
])
def test_rows_keep_one_indexed_token(tokens, sink, tail, want):
    rows = FixedRows.of(sink, tail, tokens)
    assert (rows.sink, rows.tail) == want
    assert rows.indexed == tokens - rows.sink - rows.tail >= 1


def test_rows_refuse_a_context_of_one_token():
    with pytest.raises(ValueError, match="at least 2"):
        FixedRows.of(4, 10, 1)


@pytest.mark.parametrize("sink", [0, 1, 4])
def test_arrange_puts_each_token_in_its_row(sink):
    """arrange (in place) agrees with order(): row r holds token order[r]; the indexed tokens first in order, then
    the sink, then the tail."""
    rows = FixedRows.of(sink, 5, 23)
    tokens = torch.arange(23, dtype=torch.float32)[None, :, None].expand(2, 23, 3).clone()
    view = tokens[:, :]  # a view: the rows move in its storage
    assert rows.arrange(view).data_ptr() == tokens.data_ptr()
    torch.testing.assert_close(tokens[0, :, 0], rows.order().float(), rtol=0, atol=0)
    assert rows.order()[: rows.indexed].tolist() == list(range(sink, 23 - 5))
    assert rows.order()[rows.indexed:].tolist() == list(range(sink)) + list(range(18, 23))
    assert sorted(rows.order().tolist()) == list(range(23))


def test_settings_validate_and_read_back_old_contexts_without_a_sink():
    with pytest.raises(ValueError, match="sink"):
        ContextSettings(sink=-1)
    with pytest.raises(ValueError, match="calibration"):
        ContextSettings(calibration=0)
    old = ContextSettings.from_dict({"dense_tail": 7})  # stored before the sink and the calibration setting existed
    assert (old.sink, old.calibration) == (0, 7)  # (its tail's queries calibrated it)
    assert ContextSettings.from_dict(ContextSettings(sink=3).as_dict()) == ContextSettings(sink=3)


def test_the_calibration_queries_are_the_last_tokens_whatever_the_tail(sessions):
    """`calibration` sets how many of the context's last tokens give their queries, apart from the dense tail: the
    same queries (exactly) with a tail of 8 or of 20."""
    from engine.context.ingest import ingest_tokens
    from engine.text.prompt import tokenize_document

    lm = sessions[0].lm
    ids = tokenize_document(lm.tokenizer, TEXT, lm.max_context).ids
    got = {tail: ingest_tokens(lm, ids, ContextSettings(dense_tail=tail, calibration=20), REFERENCE).artifacts
           for tail in (8, 20)}
    for i in lm.global_layers:
        short, long = (got[tail][f"layer{i}.calib_queries"] for tail in (8, 20))
        assert short.shape[1] == 20
        torch.testing.assert_close(short, long, rtol=0, atol=0)


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """The same document with and without a sink, every method built."""
    path = make_tiny_model(tmp_path_factory.mktemp("rows_model"), "llama_gqa")
    lm = load_model(str(path), device="cpu")
    return {sink: context_session(lm, TEXT, list(SPARSE_METHODS), context=ContextSettings(dense_tail=8, sink=sink),
                                  prepared=gates_for(lm, [make_method(n) for n in SPARSE_METHODS]))
            for sink in (0, 4)}


def test_the_sink_only_reorders_the_fixed_kv(sessions):
    """Global layers: the K/V with a sink are those without one in the order of FixedRows.order (float32, exact);
    sliding-window layers (none here) would keep theirs."""
    plain, sunk = sessions[0], sessions[4]
    plain.arrange(None)
    sunk.arrange(None)
    order = sunk.rows.order()
    assert sunk.rows.sink == 4 and sunk.tail == 12 and plain.tail == 8
    for a, b in zip(plain.cache.layers, sunk.cache.layers):
        torch.testing.assert_close(b.fixed_keys, a.fixed_keys[:, order], rtol=0, atol=0)
        torch.testing.assert_close(b.fixed_values, a.fixed_values[:, order], rtol=0, atol=0)


def test_full_attention_answers_the_same_with_a_sink(sessions):
    """The fixed context is attended as a whole: its row order does not change full attention (greedy tokens
    equal; logits within float32 summation-order noise, atol 1e-4)."""
    question = "What did the keeper write?"
    (a,), (b,) = (fidelity.reference_cases(sessions[sink], [question], 8) for sink in (0, 4))
    assert a.answer.tolist() == b.answer.tolist()
    torch.testing.assert_close(fidelity.forced_logits(sessions[4], "full", 0.0, a)[0],
                               fidelity.forced_logits(sessions[0], "full", 0.0, a)[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_every_method_reads_the_sink_at_any_budget(sessions, method):
    """At the smallest budget, every step's selection holds the sink's rows (after the indexed ones)."""
    session = sessions[4]
    session.arrange(session.method(method))
    rows, plan = session.rows, session.plan(method, 0.99)
    for layer_idx in session.lm.global_layers:
        layer = session.cache.layers[layer_idx]
        q = torch.randn(session.lm.num_heads, 3, session.lm.head_dim)
        at = torch.arange(rows.tokens, rows.tokens + 3)  # the question's positions, after the context
        for block, pos in ((q, at), (q[:, -1:], at[-1:])):  # a question's prefill, a decode step
            found = session.method(method).lookup(block, layer.indexes[method], plan, 1.0, REFERENCE, pos)
            mask = found.selection.to_mask()
            assert bool(mask[:, rows.indexed : rows.indexed + rows.sink].all()), (method, layer_idx)
