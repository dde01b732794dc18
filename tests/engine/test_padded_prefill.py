"""A question's prefill padded to a captured length (engine.model.generate.forward_padded, what a replayed prefill
computes: engine.model.graph.PrefillGraph) against the same prefill unpadded, for every method with its follow rows,
on the tiny models (reference backend, fp32, CPU): the last real token's logits, the turn's tokens after it, what
the prefill read and the follow rows the turn reports are the unpadded turn's. The CUDA graph itself is tested on a
GPU in tests/engine/test_engine_graph.py."""

from __future__ import annotations

import pytest
import torch

from engine.attention.follow import FollowSettings
from engine.model.generate import DENSE_PREFILL_MAX, PREFILL_LENGTHS, forward_padded, forward_step, padded_length
from engine.text.prompt import question_ids

METHODS = ["full", "squeeze", "hsqueeze", "quest", "duo", "duo-squeeze", "saap"]
SPARSITY = 0.7
STEPS = 4
# fp32 on both sides; the pooled scores sum the same terms in another order (a padded block's masked rows)
TOL = dict(atol=1e-4, rtol=1e-4)
QUESTION = "Who kept the lighthouse logbook, and when was the light first lit?"


@pytest.fixture(scope="module")
def session(tiny_model_path):
    from engine.context.ingest import ingest_tokens
    from engine.context.session import ContextSession
    from engine.model.load import load_model
    from engine.text.prompt import tokenize_document
    from kernels.backend import REFERENCE
    from tests.engine.test_engine_tiny import DOCUMENT, SETTINGS, all_methods, gates_for

    lm = load_model(str(tiny_model_path), device="cpu")
    ids = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context).ids
    methods = all_methods()
    out = ingest_tokens(lm, ids, SETTINGS, REFERENCE, methods, prepared=gates_for(lm, methods))
    return ContextSession(lm, out.artifacts, SETTINGS, REFERENCE, methods={m.name: m for m in methods},
                          follow=FollowSettings(prefill=16, decode=4), graphs=False)


def turn(session, method: str, prompt: torch.Tensor, length: int | None):
    """A greedy turn: its first token's logits [1, V], its STEPS tokens and its statistics, the prefill padded to
    `length` (None: unpadded)."""
    lm = session.lm
    recorder = session.recorder()
    step = session.step_context(method, SPARSITY, recorder)
    cache = step.cache
    with torch.inference_mode():
        cache.reset_dynamic()
        cache.reserve(max(prompt.numel() + STEPS, length or 0))
        position = cache.get_seq_length()
        if length is None:
            logits = forward_step(lm, step, prompt, position)
        else:
            logits = forward_padded(lm, step, prompt, position, length)
        first = logits.float().clone()
        tokens = [int(logits.argmax(dim=-1))]
        position += prompt.numel()
        for _ in range(STEPS - 1):
            logits = forward_step(lm, step, torch.tensor([tokens[-1]]), position)
            tokens.append(int(logits.argmax(dim=-1)))
            position += 1
        follow = step.follow.turn_positions(prompt, torch.tensor(tokens[:-1])) if step.follow is not None else []
        recent = step.follow.recent.clone() if step.follow is not None else None
    cache.reset_dynamic()
    return first, tokens, recorder.finish(method, SPARSITY, len(tokens), {}), follow, recent


def same_clusters(got: list[dict], want: list[dict]) -> bool:
    """The prefill's kept units (TurnStats.clusters): the same ids and sizes, their scores within float32's sums."""
    def units(entries):
        return [(e["layer"], r["row"], r["ids"], r["sizes"]) for e in entries for r in e["rows"]]

    def scores(entries):
        return [x for e in entries for r in e["rows"] for x in r.get("scores", [])]

    return units(got) == units(want) and scores(got) == pytest.approx(scores(want), rel=1e-5, abs=1e-6)


def test_padded_length():
    assert [padded_length(n) for n in (1, 2, 16, 17, 200, 300, PREFILL_LENGTHS[-1], PREFILL_LENGTHS[-1] + 1)] == \
        [None, 16, 16, 32, 256, 512, PREFILL_LENGTHS[-1], None]
    # a step that reads every key pads no further than DENSE_PREFILL_MAX
    assert [padded_length(n, dense=True) for n in (2, 200, DENSE_PREFILL_MAX, DENSE_PREFILL_MAX + 1)] == \
        [16, 256, DENSE_PREFILL_MAX, None]


@pytest.mark.parametrize("method", METHODS)
def test_a_padded_prefill_is_the_unpadded_one(session, method):
    prompt = question_ids(session.lm.tokenizer, QUESTION)
    length = padded_length(prompt.numel())
    assert length is not None and length > prompt.numel() + 2  # real padding
    first, tokens, stats, follow, _ = turn(session, method, prompt, None)
    p_first, p_tokens, p_stats, p_follow, _ = turn(session, method, prompt, length)
    torch.testing.assert_close(p_first, first, **TOL)
    assert p_tokens == tokens
    assert p_stats.kv_budget_prefill == pytest.approx(stats.kv_budget_prefill, abs=1e-6)
    assert p_stats.kv_budget_decode == pytest.approx(stats.kv_budget_decode, abs=1e-6)
    assert same_clusters(p_stats.clusters, stats.clusters)
    assert p_follow == follow


def test_the_follow_rows_of_a_padded_question_are_its_own(session):
    """Follow.begin with `valid`: the question's rows and its last tokens are the real tokens' (the padding would
    add bigrams of its own and end the recent tokens)."""
    step = session.step_context("squeeze", SPARSITY)
    follow = step.follow
    prompt = question_ids(session.lm.tokenizer, QUESTION)
    follow.begin(prompt)
    want_positions, want_recent = follow.positions.clone(), follow.recent.clone()
    padded = torch.cat([prompt, torch.full((9,), 7, dtype=torch.int64)])
    follow.begin(padded, torch.tensor([prompt.numel()]))
    assert torch.equal(follow.positions, want_positions) and torch.equal(follow.recent, want_recent)
