"""engine.model.compiled: decoder layers under torch.compile around the engine's attention give the eager model's
logits and tokens (CPU, fp32, tiny models; the GPU variant with CUDA graphs is in tests/engine/test_engine_graph.py).

Each model is loaded twice from its directory (the same weights): one copy compiled, one eager, over one ingest's
artifacts (cloned for each session). The compiled copy's first calls compile (seconds per shape on the CPU)."""

from __future__ import annotations

import pytest
import torch

from engine.context.ingest import ingest_tokens
from engine.context.session import ContextSession
from engine.model.compiled import compile_layers, layers_compiled
from engine.model.generate import generate_tokens
from engine.model.load import load_model
from engine.text.prompt import question_ids, tokenize_document
from kernels.backend import REFERENCE
from tests.engine.test_engine_tiny import DOCUMENT, QUESTION, SETTINGS, all_methods
from tests.support.tiny_models import gates_for

# fp32 on both sides; inductor fuses the element-wise ops (one rounding per fused kernel instead of one per op)
TOL = dict(atol=1e-4, rtol=1e-4)
CASES = [("full", 0.0), ("squeeze", 0.7)]
STEPS = 6

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.parametrize("tiny_model_path", ["llama_gqa", "gemma3_hybrid"], indirect=True)]


@pytest.fixture(scope="module")
def sessions(tiny_model_path):
    """(compiled session, eager session) over the same context."""
    eager_lm = load_model(str(tiny_model_path), device="cpu")
    compiled_lm = load_model(str(tiny_model_path), device="cpu")
    assert compile_layers(compiled_lm) == compiled_lm.num_layers and layers_compiled(compiled_lm)
    assert compile_layers(compiled_lm) == 0  # idempotent
    assert not layers_compiled(eager_lm)
    ids = tokenize_document(eager_lm.tokenizer, DOCUMENT, eager_lm.max_context).ids
    artifacts = ingest_tokens(eager_lm, ids, SETTINGS, REFERENCE, all_methods(),
                  prepared=gates_for(eager_lm, all_methods())).artifacts
    clone = lambda: {k: v.clone() for k, v in artifacts.items()}  # noqa: E731
    return (ContextSession(compiled_lm, clone(), SETTINGS, REFERENCE),
            ContextSession(eager_lm, clone(), SETTINGS, REFERENCE))


@pytest.mark.parametrize("method,sparsity", CASES)
def test_compiled_layers_match_eager(sessions, method, sparsity):
    compiled, eager = sessions
    torch.testing.assert_close(compiled.logits(QUESTION, method, sparsity), eager.logits(QUESTION, method, sparsity),
                               **TOL)
    prompt = question_ids(eager.lm.tokenizer, QUESTION)
    got = list(generate_tokens(compiled.lm, compiled.step_context(method, sparsity), prompt, STEPS))
    want = list(generate_tokens(eager.lm, eager.step_context(method, sparsity), prompt, STEPS))
    assert got == want


def test_compiled_ingest_matches_eager(sessions, tiny_model_path):
    """The ingest's chunked prefill through compiled layers: the same K/V (the same index follows from them)."""
    compiled, eager = sessions
    ids = tokenize_document(eager.lm.tokenizer, DOCUMENT, eager.lm.max_context).ids
    got = ingest_tokens(compiled.lm, ids, SETTINGS, REFERENCE, all_methods(),
                  prepared=gates_for(compiled.lm, all_methods())).artifacts
    want = ingest_tokens(eager.lm, ids, SETTINGS, REFERENCE, all_methods(),
                  prepared=gates_for(eager.lm, all_methods())).artifacts
    for i in range(eager.lm.num_layers):
        torch.testing.assert_close(got[f"layer{i}.keys"], want[f"layer{i}.keys"], **TOL)
        torch.testing.assert_close(got[f"layer{i}.values"], want[f"layer{i}.values"], **TOL)


def test_the_warm_up_compiles_what_a_turn_needs(tiny_model_path):
    """After engine.model.compiled.warm_up (the load's compile stage), an ingest of another length, a question's
    prefill and its decode steps compile nothing more: a user's first question pays no compilation."""
    from torch._dynamo.utils import counters

    from engine.model.compiled import warm_up

    torch._dynamo.reset()  # (other tests' compilations would hide this one's)
    lm = load_model(str(tiny_model_path), device="cpu")
    compile_layers(lm)
    assert warm_up(lm, REFERENCE) > 0
    compiled = sum(counters["stats"].values())
    ids = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context).ids
    session = ContextSession(lm, ingest_tokens(lm, ids, SETTINGS, REFERENCE, all_methods(),
                                               prepared=gates_for(lm, all_methods())).artifacts, SETTINGS, REFERENCE)
    prompt = question_ids(lm.tokenizer, QUESTION)
    assert len(list(generate_tokens(lm, session.step_context("squeeze", 0.7), prompt, STEPS))) == STEPS
    assert sum(counters["stats"].values()) == compiled, dict(counters["stats"])


def test_the_warm_up_for_a_batch_compiles_every_batch_size(tiny_model_path):
    """Where turns are answered together (warm_up's batch > 1), a batched decode step of any size up to the batch,
    over different documents and methods, compiles nothing more after the warm-up: a server's first batches pay no
    compilation."""
    from torch._dynamo.utils import counters

    from engine.model.batch import forward_batch
    from engine.model.compiled import warm_up
    from tests.engine.test_batch_step import SEQUENCES, _prefill, _sessions, _steps

    torch._dynamo.reset()
    lm = load_model(str(tiny_model_path), device="cpu")
    compile_layers(lm)
    sessions = _sessions(lm)
    assert warm_up(lm, REFERENCE, batch=len(SEQUENCES)) > 0
    compiled = sum(counters["stats"].values())
    with torch.inference_mode():
        steps = _steps(sessions)
        firsts = [_prefill(lm, step, question) for step, (_, _, _, question) in zip(steps, SEQUENCES)]
        for size in range(2, len(SEQUENCES) + 1):
            tokens = torch.stack([f[0] for f in firsts[:size]]).argmax(dim=-1)
            logits = forward_batch(lm, steps[:size], tokens, [f[1] + size - 2 for f in firsts[:size]])
            assert logits.shape == (size, lm.config.vocab_size)
    assert sum(counters["stats"].values()) == compiled, dict(counters["stats"])
