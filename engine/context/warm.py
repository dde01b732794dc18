"""A sparse method's kernels compiled when the model loads rather than in a user's first question.

On a GPU, Triton compiles a kernel at its first launch in a process (from its own disk cache when it compiled it
before, from source else: seconds for a method's lookup, union, follow and tally kernels). The kernels take a
context's sizes as plain arguments (kernels/README.md), so a short context compiles what a long one runs, but only
their first run compiles them at all: `warm_method` runs a method over a small random context once, as a stage of
the model's load (`warm_load`: after engine.model.compiled.warm_up's dense calls; engine.serve.service.Engine.load,
and the benchmarks' models that stand for it), so that a process's first question over a real document finds them
compiled.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.context.ingest import ingest_tokens
from engine.context.session import ContextSession
from engine.context.settings import ContextSettings
from engine.context.turn import Answer
from engine.methods import Method, build_order, make_method
from engine.model.compiled import warm_up
from engine.model.load import LoadedModel
from kernels.backend import Backend

WARM_TOKENS = 2048  # the random context's tokens: enough for a 10% budget to leave most keys unread
WARM_QUESTION = "What is this document about?"
WARM_ANSWER_TOKENS = 3  # a prefill, a decode step captured, one replayed


def warm_method(lm: LoadedModel, backend: Backend, method: Method, sparsity: float,
                prepared: dict | None = None, tokens: int = WARM_TOKENS) -> Answer:
    """Ingest `tokens` random tokens (at most half the model's context) with `method` (and what it requires), ask
    WARM_QUESTION over them at `sparsity` (WARM_ANSWER_TOKENS tokens: its prefill, then decode steps, replayed from
    CUDA graphs where the session has them), and drop it all. prepared: the methods' model-level artifacts
    (Method.prepare; by name). Returns the Answer (its statistics say what the method read)."""
    gen = torch.Generator().manual_seed(0)
    tokens = min(tokens, lm.max_context // 2)  # (room for the question and the answer in a model of a short context)
    ids = torch.randint(0, lm.config.vocab_size, (tokens,), generator=gen)
    settings = ContextSettings()
    methods = [method if name == method.name else make_method(name) for name in build_order([method.name])]
    out = ingest_tokens(lm, ids, settings, backend, methods, prepared=prepared)
    session = ContextSession(lm, out.artifacts, settings, backend, methods={m.name: m for m in methods},
                             prepared=prepared)
    answer = session.ask(WARM_QUESTION, method.name, sparsity, WARM_ANSWER_TOKENS)
    del session, out
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    return answer


def warm_load(lm: LoadedModel, backend: Backend, batch: int, methods: Sequence[Method], sparsity: float) -> float:
    """A load's warm-up where the layers are compiled: the layers at the lengths and batch sizes (up to `batch`) a
    turn uses (engine.model.compiled.warm_up), then `warm_method` of each of `methods` that learns nothing per model
    (the others are prepared when first asked for). Returns the seconds it took."""
    started = time.perf_counter()
    warm_up(lm, backend, batch)
    for method in methods:
        if not method.learns_per_model():
            warm_method(lm, backend, method, sparsity)
    return time.perf_counter() - started
