"""The real embedded model: sparse attention at zero sparsity equals full attention, and passkeys are retrieved.

Marked slow: together they take a few minutes on 2 CPU cores (three ~4K-token ingests).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ContextSettings
from engine.policies import SPARSE_METHODS, build_order, make_method
from engine.ingest import ingest_tokens
from engine.bench.passkey import PASSKEY_QUESTION, insert_passkey
from engine.prompt import question_ids, tokenize_document
from engine.session import ContextSession
from kernels.backend import REFERENCE

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).resolve().parents[1] / "assets" / "sample.md"
KEY = "48213"
DEPTHS = (0.1, 0.5, 0.9)
# The index of these tests: 10% centroids and a level 1 that rules out 30% of the keys, not the defaults (5%, 50%).
# Why (measured, issue 2 note): at 90% sparsity the answer's decode steps need the one key after the digit just
# read (an induction head puts 0.4-0.6 of its weight on it); S = exp(q . mean key) underestimates a cluster whose
# members such a sharp head tells apart (20-180x here), so at 5% that key's cluster fell below the threshold in
# 7/30 (seed, depth) draws for squeeze and 10/30 for hsqueeze; at this index 1/30 each (seeds 0-9), 18/18 at seeds
# 0-2, and 36/36 on two other passkeys. Finer clusters were the only change that helped (more k-means iterations,
# restarts, a per-head max, other key weightings did not).
PASSKEY_INDEX = {"squeeze": {"centroid_ratio": 0.1}, "hsqueeze": {"level1_prune": 0.3}}


def passkey_methods() -> dict:
    """Every sparse method, squeeze and hsqueeze with PASSKEY_INDEX."""
    return {n: make_method(n, PASSKEY_INDEX.get(n)) for n in build_order(["squeeze", "hsqueeze", "quest"])}


@pytest.fixture(scope="module")
def passkey_sessions(real_lm):
    """One ingested context per passkey depth."""
    sessions = {}
    for depth in DEPTHS:
        text = insert_passkey(SAMPLE.read_text(), KEY, depth)
        fixed = tokenize_document(real_lm.tokenizer, text, real_lm.max_context)
        methods = passkey_methods()
        out = ingest_tokens(real_lm, fixed.ids, ContextSettings(), REFERENCE, list(methods.values()))
        sessions[depth] = ContextSession(real_lm, out.artifacts, ContextSettings(), REFERENCE, methods=methods)
    return sessions


@pytest.fixture(scope="module")
def answers_at_90(passkey_sessions):
    """(depth, method) -> the passkey answer at 90% sparsity, asked once for the budget and the retrieval tests."""
    cache = {}

    def ask(depth, method):
        if (depth, method) not in cache:
            cache[depth, method] = passkey_sessions[depth].ask(PASSKEY_QUESTION, method, 0.9, max_new_tokens=12)
        return cache[depth, method]
    return ask


def test_shipped_document_is_about_4k_tokens(passkey_sessions):
    assert 3500 <= passkey_sessions[0.5].fixed_len <= 4500


def test_zero_sparsity_equals_full_attention(real_lm, passkey_sessions):
    """At budget 1 every cluster or page is kept: every sparse method's logits equal full attention, and the engine's
    full attention equals the model's own SDPA over the concatenated prompt.

    Tolerance: float32 with a different summation order (chunked prefill, log-sum-exp merge) over ~4K keys;
    the logits are O(30), observed differences O(1e-5).
    """
    session = passkey_sessions[0.5]
    full = session.logits(PASSKEY_QUESTION, "full")
    for method in SPARSE_METHODS:
        torch.testing.assert_close(session.logits(PASSKEY_QUESTION, method, 0.0), full, atol=2e-4, rtol=1e-4)
    ids = torch.cat([session.tokens, question_ids(real_lm.tokenizer, PASSKEY_QUESTION)])
    real_lm.model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            reference = real_lm.model(ids[None]).logits[0, session.fixed_len :].float()
    finally:
        real_lm.model.set_attn_implementation("squeeze")
    torch.testing.assert_close(full, reference, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("depth", DEPTHS)
def test_passkey_retrieved_by_full_attention(passkey_sessions, depth):
    answer = passkey_sessions[depth].ask(PASSKEY_QUESTION, "full", 0.0, max_new_tokens=12)
    assert KEY in answer.text, f"full attention at depth {depth} answered {answer.text!r}"


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("method", ["squeeze", "hsqueeze"])
def test_kv_budget_at_90_percent(answers_at_90, depth, method):
    """10% of the keys + centroids + the dense tail (~2.5%) of the global layers, averaged over the turn. Squeeze
    reads all its 10% centroids (5% of the bytes) at every step, hsqueeze the 1% level-1 centroids and the survivors'
    children; the answer's sharp decode steps keep fewer keys than the calibrated 10%. Measured on these passkey
    turns: squeeze 0.141-0.149, hsqueeze 0.126-0.134 (seed 0)."""
    stats = answers_at_90(depth, method).stats
    assert 0.05 <= stats.kv_budget <= 0.16
    assert all(0.0 < k <= 1.0 for layer in stats.kept_fraction for k in layer)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("method", ["squeeze", "hsqueeze"])
def test_passkey_retrieved_at_90_percent(answers_at_90, depth, method):
    """The answer's decode steps need the one key after the digit just read (an induction head); with 10% centroids
    (PASSKEY_INDEX) its cluster stays above the threshold. Measured: 29/30 (k-means seed, depth) draws for each
    method at seeds 0-9, 18/18 at seeds 0-2 (this test uses seed 0)."""
    answer = answers_at_90(depth, method)
    assert KEY in answer.text, f"{method}@0.9 at depth {depth} answered {answer.text!r}"


@pytest.mark.parametrize("depth", DEPTHS)
def test_quest_retrieves_the_passkey_at_70_percent(passkey_sessions, depth):
    """Quest's page bounds are loose on this model (head_dim 256, QK-normed and rotated keys): with the question's
    queries the passkey's page ranks 50-120th of 242 by its bound at the global layers, where the exact q . k ranks it
    first to sixth (scratch measurement, session 8), so at 90% (24 pages) Quest loses it; from 70% it answers."""
    answer = passkey_sessions[depth].ask(PASSKEY_QUESTION, "quest", 0.7, max_new_tokens=12)
    assert KEY in answer.text, f"quest@0.7 at depth {depth} answered {answer.text!r}"


def test_same_answer_at_zero_sparsity(passkey_sessions):
    session = passkey_sessions[0.1]
    full = session.ask("Who was the principal keeper when the last keepers left the headland?", "full", 0.0, 16)
    squeeze = session.ask("Who was the principal keeper when the last keepers left the headland?", "squeeze", 0.0, 16)
    assert squeeze.text == full.text
