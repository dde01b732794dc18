"""Streaming generation over a fixed-context cache: the question's prefill, then decode steps. Where the step context
has a graph cache (engine.model.graph), a question of up to PREFILL_LENGTHS[-1] tokens (DENSE_PREFILL_MAX for a
step that reads every key) is padded to the next of PREFILL_LENGTHS and its prefill replayed from a CUDA graph (the
real tokens' attention is exactly the unpadded one's: the padding comes after them, and every pooled lookup counts
the real tokens only), and every decode step is replayed from one, each launched before its predecessor's token is
read back; elsewhere each call runs eagerly. Greedy, or each token chosen by an engine.model.sampling.Sampler from
the step's logits (a replayed step then takes the chosen token as its successor's input)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.attention.function import PREFILL_CHUNK, StepContext
from engine.model.load import LoadedModel
from engine.model.sampling import Sampler, choose

# A captured prefill's lengths: a question of n tokens (2 <= n <= the last) is padded to the first that holds it.
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512, PREFILL_CHUNK)
# The last captured length of a step that reads every key: beyond it the GPU's attention over the whole context
# outweighs the host's launches (an 8B model at 128K on an H200: a 1K-token question's prefill 164 ms of GPU work in
# 169 ms), and padding would add to that work. A sparse step's GPU work is a fraction of it: eager, squeeze's 1K-token
# prefill at 10% kept the GPU busy 53 of its 99 ms (engine/bench/results/h200-e2e-128k-prefill-1k-eager.json).
DENSE_PREFILL_MAX = 256


def padded_length(tokens: int, dense: bool = False) -> int | None:
    """The captured length a question of `tokens` tokens is padded to, or None (one token, or longer than the last
    length of its kind: an eager prefill). dense: the step reads every key (lengths up to DENSE_PREFILL_MAX)."""
    if tokens < 2:
        return None
    last = DENSE_PREFILL_MAX if dense else PREFILL_LENGTHS[-1]
    return next((n for n in PREFILL_LENGTHS if tokens <= n <= last), None)


def padded_forward(lm: LoadedModel, step: StepContext, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One call over ids [P] (the first valid[0] real, the rest padding) at `step.positions` [P], with `step.valid`
    as it is (both set by the caller: a captured call reads them from its buffers). Returns the last real token's
    logits [1, V]; the caller then forgets the padding's new-token slots (FixedContextCache.keep_new)."""
    if step.follow is not None:
        step.follow.begin(ids, valid)
    out = lm.model(input_ids=ids[None], position_ids=step.positions[None], past_key_values=step.cache,
                   use_cache=True, logits_to_keep=valid - 1, squeeze_step=step)
    return out.logits[0, -1:]


def forward_padded(lm: LoadedModel, step: StepContext, prompt: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """The question's prefill, eagerly, padded to `length` tokens: padded_forward on this call's own buffers (what a
    replayed prefill computes; engine.model.graph.PrefillGraph). prompt: [n] int64, n <= length. Returns the last
    real token's logits [1, V]; the cache then holds the n real tokens' K/V."""
    n = prompt.numel()
    ids = torch.zeros(length, dtype=torch.int64, device=lm.device)
    ids[:n] = prompt.to(lm.device)
    valid = torch.full((1,), n, dtype=torch.int64, device=lm.device)
    step.positions = torch.arange(start, start + length, device=lm.device)
    step.valid = valid
    if step.recorder is not None:
        step.recorder.begin_step()
    try:
        logits = padded_forward(lm, step, ids, valid)
    finally:
        step.valid = None
    step.cache.keep_new(valid, n)
    return logits


def forward_step(lm: LoadedModel, step: StepContext, ids: torch.Tensor, start: int, begin: bool = True,
                 continued: bool = False) -> torch.Tensor:
    """One eager call over ids [n] at positions start .. start + n - 1 (their K/V join the turn's new tokens).
    begin: the follow rows are the call's (Follow.begin); else those set before it (a long question's calls: its
    own). continued: a further call of the question's prefill (its statistics add to that phase).
    Returns the last token's logits [1, V] on the device (not read back: the caller decides when to synchronise)."""
    step.positions = torch.arange(start, start + ids.numel(), device=lm.device)
    if step.follow is not None and begin:
        step.follow.begin(ids)
    if step.recorder is not None:
        step.recorder.begin_step(continued)
    out = lm.model(input_ids=ids[None], position_ids=step.positions[None], past_key_values=step.cache,
                   use_cache=True, logits_to_keep=1, squeeze_step=step)
    return out.logits[0, -1:]


def _next(lm: LoadedModel, step: StepContext, ids: torch.Tensor, start: int, sampler: Sampler | None) -> torch.Tensor:
    """The token after ids [n] (greedy, or the sampler's): [1] int64 on the device."""
    return choose(forward_step(lm, step, ids, start), sampler)


class QuestionPrefill:
    """A turn's first calls: the cache's new tokens forgotten, room reserved for the prompt [Lq] int64 and an answer
    of max_new_tokens, then the prompt run: in one call where it holds at most `step.prefill_chunk` tokens (replayed
    at a padded length where the step has CUDA graphs, unless `eager`), else that many tokens a call, eagerly, each
    call's lookups pooled over its own tokens and every call reading the whole question's follow rows. `advance()`
    runs the next call and says whether the question is in; `result` is then (the answer's first token, [1] int64 on
    the device: greedy, or the sampler's; the position of the next input). A lone turn runs the calls back to back
    (prefill_question); turns answered together run a joining turn's calls between the others' steps
    (engine.context.batching), so that a long question holds them up one call at a time: both compute the same."""

    def __init__(self, lm: LoadedModel, step: StepContext, prompt: torch.Tensor, max_new_tokens: int,
                 sampler: Sampler | None = None, eager: bool = False):
        self.lm, self.step, self.sampler = lm, step, sampler
        self.prompt = prompt.to(lm.device)
        n, chunk = prompt.numel(), max(1, step.prefill_chunk)
        self.calls = [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)] or [(0, 0)]
        dense = step.plan is None or step.plan.budget >= 1.0
        replay = step.graphs is not None and not step.token_lookups and not eager and len(self.calls) == 1
        self.length = padded_length(n, dense) if replay else None
        self.done = 0
        self.result: tuple[torch.Tensor, int] | None = None
        with torch.inference_mode():
            step.cache.reset_dynamic()
            step.cache.reserve(max(n + max_new_tokens, self.length or 0))
            self.start = step.cache.get_seq_length()
            if len(self.calls) > 1 and step.follow is not None:
                step.follow.begin(self.prompt)  # the whole question's: its calls then keep them

    def advance(self) -> bool:
        """Run the prompt's next call; True once the last one has run (`result` set)."""
        lo, hi = self.calls[self.done]
        last = self.done == len(self.calls) - 1
        with torch.inference_mode():
            if self.length is not None:
                logits = self.step.graphs.prefill(self.step, self.prompt, self.start, self.length)
            else:
                logits = forward_step(self.lm, self.step, self.prompt[lo:hi], self.start + lo,
                                      begin=len(self.calls) == 1, continued=self.done > 0)
            if last:
                self.result = (choose(logits, self.sampler), self.start + self.prompt.numel())
        self.done += 1
        return last


def prefill_question(lm: LoadedModel, step: StepContext, prompt: torch.Tensor, max_new_tokens: int,
                     sampler: Sampler | None = None, eager: bool = False) -> tuple[torch.Tensor, int]:
    """A turn's question prefilled whole (QuestionPrefill's calls back to back). Returns the answer's first token
    ([1] int64 on the device: greedy, or the sampler's) and the position of the next input."""
    prefill = QuestionPrefill(lm, step, prompt, max_new_tokens, sampler, eager)
    while not prefill.advance():
        pass
    return prefill.result


def generate_tokens(lm: LoadedModel, step: StepContext, prompt: torch.Tensor, max_new_tokens: int,
                    sampler: Sampler | None = None) -> Iterator[int]:
    """Yield tokens one at a time (greedy, or chosen by `sampler`); the first forward is the question's prefill.
    prompt: [Lq] int64.

    Stops after an end-of-sequence token (which is yielded) or `max_new_tokens` tokens. The caller may stop early
    by closing the generator (close it before reading the step's recorder: replayed steps' statistics are handed
    to it when the generator ends). New tokens take positions after the fixed context. Inference mode is entered
    around each step, never held across a yield: a caller may resume the generator from another thread (Gradio
    does), and torch's inference mode is per thread.
    """
    eos = lm.eos_ids()
    next_ids, position = prefill_question(lm, step, prompt, max_new_tokens, sampler)
    token = int(next_ids)
    yield token
    if token in eos or max_new_tokens <= 1:
        return
    if step.graphs is not None:
        yield from _replayed(step, next_ids, position, max_new_tokens - 1, eos, sampler)
        return
    for _ in range(max_new_tokens - 1):
        with torch.inference_mode():
            next_ids = _next(lm, step, next_ids, position, sampler)
            token = int(next_ids)
        position += 1
        yield token
        if token in eos:
            return


def _replayed(step: StepContext, token: torch.Tensor, position: int, steps: int, eos: set[int],
              sampler: Sampler | None) -> Iterator[int]:
    """Decode steps from the session's captured graph (captured on first use: one eager step, then the capture).
    Each step is launched before its predecessor's token is read back (DecodeGraph.launch / read), so the GPU runs
    step after step without waiting for the host; a turn that ends at an end-of-sequence token has then run one
    step more than it yields, and its statistics count the steps run."""
    with torch.inference_mode():
        graph, captured = step.graphs.get(step)
        if graph.totals is not None:
            graph.totals.reset()
        graph.set_input(token, position)
    pick = sampler.pick if sampler is not None else None
    launched = 0
    try:
        if not captured:
            with torch.inference_mode():
                token_id = graph.warm_and_capture(step) if pick is None else _warm_pick(graph, step, pick)
            launched = 1
            yield token_id
            if token_id in eos:
                return
        pending = None
        while launched < steps:
            with torch.inference_mode():
                ticket = graph.launch(pick)
            launched += 1
            if pending is not None:
                token_id = graph.read(pending)
                yield token_id
                if token_id in eos:
                    return
            pending = ticket
        if pending is not None:
            yield graph.read(pending)
    finally:
        if step.recorder is not None and graph.totals is not None:
            with torch.inference_mode():
                step.recorder.add_decode(graph.totals, launched)


def _warm_pick(graph, step: StepContext, pick) -> int:
    """The warm step of a sampled turn: its logits picked from, the choice fed to the first replay."""
    graph.warm_and_capture(step)
    chosen = pick(graph.warm_logits)
    graph.feed(chosen)
    return int(chosen)


def full_logits(lm: LoadedModel, step: StepContext, prompt: torch.Tensor) -> torch.Tensor:
    """Logits of every prompt token over the fixed context (for equivalence tests). prompt: [Lq] -> [Lq, V]."""
    cache = step.cache
    with torch.inference_mode():
        cache.reset_dynamic()
        cache.reserve(prompt.numel())
        start = cache.get_seq_length()
        step.positions = torch.arange(start, start + prompt.numel(), device=lm.device)
        if step.follow is not None:
            step.follow.begin(prompt.to(lm.device))
        out = lm.model(input_ids=prompt.to(lm.device)[None], position_ids=step.positions[None], past_key_values=cache,
                       use_cache=True, squeeze_step=step)
    cache.reset_dynamic()
    return out.logits[0].float()
