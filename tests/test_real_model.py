"""The real embedded model: sparse attention at zero sparsity equals full attention, and passkeys are retrieved.

Marked slow: together they take a few minutes on 2 CPU cores (three ~4K-token ingests).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import IndexSettings
from engine.ingest import ingest_tokens
from engine.passkey import PASSKEY_QUESTION, insert_passkey
from engine.prompt import question_ids, tokenize_document
from engine.session import ContextSession
from kernels.dispatch import REFERENCE

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).resolve().parents[1] / "assets" / "sample.md"
KEY = "48213"
DEPTHS = (0.1, 0.5, 0.9)


@pytest.fixture(scope="module")
def passkey_sessions(real_lm):
    """One ingested context per passkey depth."""
    sessions = {}
    for depth in DEPTHS:
        text = insert_passkey(SAMPLE.read_text(), KEY, depth)
        fixed = tokenize_document(real_lm.tokenizer, text, real_lm.max_context)
        out = ingest_tokens(real_lm, fixed.ids, IndexSettings(), REFERENCE)
        sessions[depth] = ContextSession(real_lm, out.artifacts, IndexSettings(), REFERENCE)
    return sessions


def test_shipped_document_is_about_4k_tokens(passkey_sessions):
    assert 3500 <= passkey_sessions[0.5].fixed_len <= 4500


def test_zero_sparsity_equals_full_attention(real_lm, passkey_sessions):
    """At threshold 0 every cluster is kept: squeeze and hsqueeze logits equal full attention, and the engine's
    full attention equals the model's own SDPA over the concatenated prompt.

    Tolerance: float32 with a different summation order (chunked prefill, log-sum-exp merge) over ~4K keys;
    the logits are O(30), observed differences O(1e-5).
    """
    session = passkey_sessions[0.5]
    full = session.logits(PASSKEY_QUESTION, "full")
    for method in ("squeeze", "hsqueeze"):
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
def test_kv_budget_at_90_percent(passkey_sessions, depth, method):
    """10% of the keys + centroids (2.5%) + the dense tail (~2.5%) of the global layers, averaged over the turn."""
    stats = passkey_sessions[depth].ask(PASSKEY_QUESTION, method, 0.9, max_new_tokens=12).stats
    assert 0.05 <= stats.kv_budget <= 0.16
    assert all(0.0 < k <= 1.0 for layer in stats.kept_fraction for k in layer)


@pytest.mark.xfail(strict=False, reason=(
    "known gap (issue 2 note): at 90% sparsity the 270M model retrieves the passkey in about 60% of "
    "(k-means seed, depth) draws; the typical miss is one wrong digit. Measured with seeds 0-2 x depths 0.1/0.5/0.9."
))
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("method", ["squeeze", "hsqueeze"])
def test_passkey_retrieved_at_90_percent(passkey_sessions, depth, method):
    answer = passkey_sessions[depth].ask(PASSKEY_QUESTION, method, 0.9, max_new_tokens=12)
    assert KEY in answer.text, f"{method}@0.9 at depth {depth} answered {answer.text!r}"


def test_same_answer_at_zero_sparsity(passkey_sessions):
    session = passkey_sessions[0.1]
    full = session.ask("Who was the principal keeper when the last keepers left the headland?", "full", 0.0, 16)
    squeeze = session.ask("Who was the principal keeper when the last keepers left the headland?", "squeeze", 0.0, 16)
    assert squeeze.text == full.text
