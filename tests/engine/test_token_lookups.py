"""One lookup per question token (engine.attention.function.StepContext.token_lookups). Against references, for every method:
a layer's attention over the fixed context for several query tokens, each over the keys its own lookup (at the
decode plan) selects, against masked softmax attention; a question's prefill against its tokens fed one call at a
time; what the turn reports it read against the mean of those calls' reads; at budget one, full attention. Tiny
random-weight GQA model, reference backend, fp32."""

from __future__ import annotations

import pytest
import torch

from engine.attention.follow import OFF
from engine.attention.stats import TurnRecorder
from engine.model.generate import forward_step, full_logits
from engine.text.prompt import question_ids

METHODS = ["squeeze", "hsqueeze", "quest", "duo", "duo-squeeze", "saap"]
SPARSITY = 0.8
pytestmark = pytest.mark.parametrize("tiny_model_path", ["llama_gqa"], indirect=True)  # one arch: the lookups
# are the methods' own, tested on every arch elsewhere; here only the prefill's split into tokens is new


@pytest.fixture(scope="module")
def session(tiny_model_path):
    """The tiny GQA model's session, without follow rows (a one-token step would add its own: the reference is the
    lookup alone)."""
    from engine.context.ingest import ingest_tokens
    from engine.context.session import ContextSession
    from engine.model.load import load_model
    from engine.text.prompt import tokenize_document
    from kernels.backend import REFERENCE
    from tests.engine.test_engine_tiny import DOCUMENT, SETTINGS, all_methods, gates_for

    lm = load_model(str(tiny_model_path), device="cpu")
    fc = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context)
    methods = all_methods()
    out = ingest_tokens(lm, fc.ids, SETTINGS, REFERENCE, methods, prepared=gates_for(lm, methods))
    return ContextSession(lm, out.artifacts, SETTINGS, REFERENCE, methods={m.name: m for m in methods}, follow=OFF,
                          token_lookups=True)


def _one_at_a_time(session, method: str, prompt: torch.Tensor, recorder: TurnRecorder | None) -> torch.Tensor:
    """[Lq, V]: each prompt token's logits, the tokens fed one per call (the reference)."""
    step = session.step_context(method, SPARSITY, recorder)
    cache = step.cache
    rows = []
    with torch.inference_mode():
        cache.reset_dynamic()
        cache.reserve(prompt.numel())
        position = cache.get_seq_length()
        for token in prompt.tolist():
            rows.append(forward_step(session.lm, step, torch.tensor([token]), position).float())
            position += 1
    cache.reset_dynamic()
    return torch.cat(rows)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """The reference: q [Hq, 1, D] over keys k, v [Hkv, L, D] where mask [Hq, L] is set -> (out [Hq, 1, D], lse [Hq, 1])."""
    group = q.shape[0] // k.shape[0]
    s = torch.einsum("hd,hld->hl", q[:, 0].double(), k.repeat_interleave(group, dim=0).double()) * scale
    s = s.masked_fill(~mask, float("-inf"))
    out = torch.einsum("hl,hld->hd", torch.softmax(s, dim=-1), v.repeat_interleave(group, dim=0).double())
    return out[:, None].float(), torch.logsumexp(s, dim=-1)[:, None].float()


@pytest.mark.parametrize("method", METHODS)
def test_a_layers_tokens_each_attend_to_their_own_selection(session, method):
    """engine.attention.function's attention of 7 query tokens at a global layer, with no new token to see = per
    token, masked attention over what that token's own lookup selects (its row's keys; every key where the layer is
    read densely)."""
    from engine.attention.function import _looked_up

    lm = session.lm
    torch.manual_seed(0)
    step = session.step_context(method, SPARSITY)
    m = step.method
    positions = torch.arange(session.fixed_len, session.fixed_len + 7)
    for i in lm.global_layers:
        layer = session.cache.layers[i]
        q = torch.randn(lm.num_heads, 7, lm.head_dim)
        no_new = layer.fixed_keys[:, :0]  # [Hkv, 0, D]
        out = torch.empty(lm.num_heads, 7, lm.head_dim)
        _looked_up(layer, q, positions, 0.3, step, no_new, no_new, out)
        for t in range(7):
            lookup = m.lookup(q[:, t : t + 1], layer.indexes[method], step.plan, 0.3, step.backend, positions[t : t + 1])
            if lookup.selection is None:
                mask = torch.ones(lm.num_heads, layer.fixed_keys.shape[1], dtype=torch.bool)
            else:
                mask = lookup.selection.to_mask().repeat_interleave(lm.num_heads // lookup.selection.rows, dim=0)
            ref_out, _ = _masked_attention(q[:, t : t + 1], layer.fixed_keys, layer.fixed_values, mask, 0.3)
            torch.testing.assert_close(out[:, t : t + 1], ref_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_token_lookups_equal_the_tokens_one_at_a_time(session, method):
    """The question's prefill equals its tokens fed one call at a time, on all but a few positions: the two
    compute the new tokens' part in different orders of summation, and a cluster whose score sits at the threshold
    may then be kept by one and not the other, which changes the positions after it (seen on the MHA model)."""
    prompt = question_ids(session.lm.tokenizer, "Who kept the lighthouse logbook?")
    assert prompt.numel() > 8
    mine = full_logits(session.lm, session.step_context(method, SPARSITY), prompt)
    theirs = _one_at_a_time(session, method, prompt, None)
    close = ((mine - theirs).abs() <= 1e-4 + 1e-4 * theirs.abs()).all(dim=-1)
    assert close.float().mean() >= 0.9, close


def test_token_lookups_differ_from_one_lookup(session):
    """The setting changes what a multi-token prefill reads (else the test above would prove nothing about it)."""
    prompt = question_ids(session.lm.tokenizer, "Who kept the lighthouse logbook?")
    mine = full_logits(session.lm, session.step_context("squeeze", SPARSITY), prompt)
    session.token_lookups = False
    try:
        shared = full_logits(session.lm, session.step_context("squeeze", SPARSITY), prompt)
    finally:
        session.token_lookups = True
    assert (mine - shared).abs().max() > 1e-3


@pytest.mark.parametrize("method", ["squeeze", "quest", "saap"])
def test_the_prefill_reports_the_mean_of_its_tokens_reads(session, method):
    """kv_budget_prefill with token lookups = the mean read of the one-token steps that the reference runs (its
    first call counts as a prefill, the others as decode steps: the turn's kv_budget averages all of them)."""
    prompt = question_ids(session.lm.tokenizer, "Who kept the lighthouse logbook?")
    recorder = session.recorder(sync_cuda=False)
    full_logits(session.lm, session.step_context(method, SPARSITY, recorder), prompt)
    mine = recorder.finish(method, SPARSITY, 0, {})
    reference = session.recorder(sync_cuda=False)
    _one_at_a_time(session, method, prompt, reference)
    theirs = reference.finish(method, SPARSITY, prompt.numel() - 1, {})
    assert 0.0 < mine.kv_budget_prefill < 1.0
    assert mine.kv_budget_prefill == pytest.approx(theirs.kv_budget, abs=1e-6)
    torch.testing.assert_close(torch.tensor(mine.kept_fraction_prefill), torch.tensor(theirs.kept_fraction),
                               atol=1e-6, rtol=0)


def test_token_lookups_at_budget_one_are_full_attention(session):
    prompt = question_ids(session.lm.tokenizer, "Who kept the lighthouse logbook?")
    full = full_logits(session.lm, session.step_context("full", 0.0), prompt)
    for method in ("squeeze", "quest", "saap"):
        torch.testing.assert_close(full_logits(session.lm, session.step_context(method, 0.0), prompt), full,
                                   atol=1e-4, rtol=1e-4)
