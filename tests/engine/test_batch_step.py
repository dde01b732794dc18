"""engine.model.batch: one decode step over several sequences gives each sequence the logits and greedy tokens of
its own steps, with sequences over different documents of different lengths, different methods and budgets, and
two over the same document (a fork of its cache and follow rows) in one batch, for every sparse method (tiny
models, CPU, fp32, the reference kernels)."""

from __future__ import annotations

import pytest
import torch

from engine.context.ingest import ingest_tokens
from engine.context.session import ContextSession
from engine.methods import SPARSE_METHODS, build_order
from engine.model.batch import forward_batch
from engine.model.generate import forward_step
from engine.model.load import load_model
from engine.text.prompt import question_ids, tokenize_document
from kernels.backend import REFERENCE
from tests.engine.test_engine_tiny import DOCUMENT, SETTINGS, all_methods
from tests.support.tiny_models import gates_for

# fp32 on both sides: a product over B tokens may sum in another order than over one
TOL = dict(atol=1e-4, rtol=1e-4)
STEPS = 5
OTHER = ("Orchard notes. The pear trees on the south wall were grafted in 1911 by a gardener named Tomas Brekke. "
         "Each autumn the harvest was weighed on the cellar scale and written in a green ledger. ") * 3
# (document, method, sparsity, question): two sequences over the first document, one with its own fork
SEQUENCES = [(0, "squeeze", 0.7, "Who kept the lighthouse logbook?"),
             (1, "quest", 0.5, "Who grafted the pear trees?"),
             (0, "squeeze", 0.5, "When was the light electrified?"),
             (1, "full", 0.0, "Where was the harvest written?")]

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.parametrize("tiny_model_path", ["llama_gqa", "gemma3_hybrid"], indirect=True)]


def _sessions(lm, backend=REFERENCE, names: tuple[str, ...] | None = None) -> list[ContextSession]:
    """A session over each of DOCUMENT and OTHER with every method built (or those `names`), on `backend`."""
    methods = [m for m in all_methods() if names is None or m.name in names]
    out = []
    for text in (DOCUMENT, OTHER):
        ids = tokenize_document(lm.tokenizer, text, lm.max_context).ids
        artifacts = ingest_tokens(lm, ids, SETTINGS, backend, methods, prepared=gates_for(lm, methods)).artifacts
        out.append(ContextSession(lm, artifacts, SETTINGS, backend))
    return out


def _steps(sessions: list[ContextSession], sequences: list = SEQUENCES) -> list:
    """A StepContext per sequence; a second sequence over a document takes a fork of its cache and follow rows."""
    steps, seen = [], set()
    for doc, method, sparsity, _ in sequences:
        step = sessions[doc].step_context(method, sparsity)
        if doc in seen:
            step.cache = step.cache.fork()
            step.follow = step.follow.fork() if step.follow is not None else None
        seen.add(doc)
        steps.append(step)
    return steps


def _prefill(lm, step, question: str) -> tuple[torch.Tensor, int]:
    """The question's prefill alone: (its next token's logits [V], the position of that token)."""
    prompt = question_ids(lm.tokenizer, question)
    step.cache.reset_dynamic()
    step.cache.reserve(prompt.numel() + STEPS + 1)
    start = step.cache.get_seq_length()
    return forward_step(lm, step, prompt, start)[0], start + prompt.numel()


@pytest.mark.parametrize("shared", [False, True])
def test_a_batched_step_is_each_sequences_own_step(tiny_model_path, shared):
    """shared: every sequence's lookup first, then their attentions through union_attention_batch."""
    lm = load_model(str(tiny_model_path), device="cpu")
    _batched_against_alone(lm, _sessions(lm), SEQUENCES, shared)


@pytest.mark.parametrize("method", sorted(set(SPARSE_METHODS) - {"squeeze", "quest"}))
def test_every_sparse_method_steps_batched_as_alone(tiny_model_path, method):
    """Each of the other sparse methods (squeeze and Quest: above) in a batch of three sequences over the two
    documents, at two budgets, one a fork: each sequence's logits and greedy tokens are those of its own steps."""
    lm = load_model(str(tiny_model_path), device="cpu")
    sequences = [(0, method, 0.7, SEQUENCES[0][3]), (1, method, 0.5, SEQUENCES[1][3]),
                 (0, method, 0.5, SEQUENCES[2][3])]
    _batched_against_alone(lm, _sessions(lm, names=tuple(build_order([method]))), sequences, shared=False)


def _batched_against_alone(lm, sessions: list[ContextSession], sequences: list, shared: bool) -> None:
    """`sequences` [(document, method, sparsity, question)] prefilled alone, then STEPS decode steps each on its own
    and all of them batched (forward_batch, fed the batch's greedy tokens): the same logits within TOL, the same
    greedy tokens, and not all the same answer."""
    with torch.inference_mode():
        alone = []  # per sequence: the logits of its prefill and of each decode step, run on its own
        for step, (_, _, _, question) in zip(_steps(sessions, sequences), sequences):
            logits, position = _prefill(lm, step, question)
            seen = [logits]
            for _ in range(STEPS):
                logits = forward_step(lm, step, logits.argmax().reshape(1), position)[0]
                position += 1
                seen.append(logits)
            alone.append(torch.stack(seen))
        steps = _steps(sessions, sequences)
        firsts = [_prefill(lm, step, q) for step, (_, _, _, q) in zip(steps, sequences)]  # each prefilled alone
        logits = torch.stack([f[0] for f in firsts])
        positions = [f[1] for f in firsts]
        together = [logits]
        for _ in range(STEPS):
            logits = forward_batch(lm, steps, logits.argmax(dim=-1), positions, shared=shared)
            positions = [p + 1 for p in positions]
            together.append(logits)
        together = torch.stack(together, dim=1)  # [B, 1 + STEPS, V]
    for b, want in enumerate(alone):
        torch.testing.assert_close(together[b], want, **TOL)
        assert together[b].argmax(-1).tolist() == want.argmax(-1).tolist()
    # the sequences differ (nothing was mixed up): each document's answers are its own
    assert len({tuple(t.argmax(-1).tolist()) for t in together}) > 1


def test_a_batch_needs_a_token_and_a_position_per_sequence(tiny_model_path):
    lm = load_model(str(tiny_model_path), device="cpu")
    steps = _steps(_sessions(lm))[:2]
    with pytest.raises(ValueError, match="one token and one position per sequence"):
        forward_batch(lm, steps, torch.zeros(3, dtype=torch.int64), [0, 0])


def test_shared_launches_of_the_triton_kernels_attend_as_each_sequences_own(tiny_model_path):
    """On the Triton backend (its interpreter on the CPU), a batched step whose attentions share the union kernels'
    launches (kernels/union_ops.py union_attention_batch: one split and one merge launch for the sequences of one
    kind) gives the logits of the same step with each sequence's own launches, step after step (the kernels do not
    depend on the model's layers: one tiny model, a minute in the interpreter)."""
    from kernels.dispatch import backend_for

    if tiny_model_path.name != "llama_gqa":
        pytest.skip("one model is enough for the kernels' launches")
    lm = load_model(str(tiny_model_path), device="cpu")
    sessions = _sessions(lm, backend_for(lm.device, "triton"), names=tuple({m for _, m, _, _ in SEQUENCES}))
    got = {}
    with torch.inference_mode():
        for shared in (False, True):
            steps = _steps(sessions)
            firsts = [_prefill(lm, step, q) for step, (_, _, _, q) in zip(steps, SEQUENCES)]
            logits = torch.stack([f[0] for f in firsts])
            positions = [f[1] for f in firsts]
            seen = []
            for _ in range(2):
                logits = forward_batch(lm, steps, logits.argmax(dim=-1), positions, shared=shared)
                positions = [p + 1 for p in positions]
                seen.append(logits)
            got[shared] = torch.stack(seen)
    torch.testing.assert_close(got[True], got[False], **TOL)
