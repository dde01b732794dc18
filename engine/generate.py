"""Streaming greedy generation over a fixed-context cache."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.attention import StepContext
from engine.model import LoadedModel


def greedy_tokens(lm: LoadedModel, step: StepContext, prompt: torch.Tensor, max_new_tokens: int) -> Iterator[int]:
    """Yield greedy tokens one at a time; the first forward is the question's prefill. prompt: [Lq] int64.

    Stops after an end-of-sequence token (which is yielded) or `max_new_tokens` tokens. The caller may stop early
    by closing the generator. New tokens take positions after the fixed context.
    """
    cache = step.cache
    cache.reset_dynamic()
    eos = lm.eos_ids()
    ids = prompt.to(lm.device)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            start = cache.get_seq_length()
            positions = torch.arange(start, start + ids.numel(), device=lm.device)
            if step.recorder is not None:
                step.recorder.begin_step()
            out = lm.model(input_ids=ids[None], position_ids=positions[None], past_key_values=cache, use_cache=True,
                           logits_to_keep=1, squeeze_step=step)
            token = int(out.logits[0, -1].argmax())
            yield token
            if token in eos:
                return
            ids = torch.tensor([token], device=lm.device)


def full_logits(lm: LoadedModel, step: StepContext, prompt: torch.Tensor) -> torch.Tensor:
    """Logits of every prompt token over the fixed context (for equivalence tests). prompt: [Lq] -> [Lq, V]."""
    cache = step.cache
    cache.reset_dynamic()
    start = cache.get_seq_length()
    positions = torch.arange(start, start + prompt.numel(), device=lm.device)
    with torch.inference_mode():
        out = lm.model(input_ids=prompt.to(lm.device)[None], position_ids=positions[None], past_key_values=cache,
                       use_cache=True, squeeze_step=step)
    cache.reset_dynamic()
    return out.logits[0].float()
