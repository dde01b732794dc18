"""How the next token is chosen from the model's logits: greedy by default, or sampled with a temperature and a
top-p (nucleus) cut, with a repetition penalty on what the answer already said.

The repetition penalty (CTRL's, as transformers applies it: a seen token's positive logit divided by the penalty,
a negative one multiplied) counts the answer's own tokens only, not the document's nor the question's: an answer
about a document should be free to quote it, and a base model's failure is to repeat its own lines.
"""

from __future__ import annotations

import torch

from engine.model.catalog import GenerationOptions


class Sampler:
    """Picks each next token of one answer. pick(logits [1, V]) -> [1] int64 on the logits' device; the picked
    tokens are remembered for the repetition penalty. One host synchronisation per token at most (the caller's)."""

    def __init__(self, options: GenerationOptions, vocab: int, device: torch.device):
        self.options = options
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.generator: torch.Generator | None = None
        if options.temperature > 0:
            self.generator = torch.Generator(device=device)
            if options.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(options.seed)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        opts = self.options
        scores = logits[0].float()  # [V]
        if opts.repetition_penalty != 1.0:
            penalised = torch.where(scores > 0, scores / opts.repetition_penalty, scores * opts.repetition_penalty)
            scores = torch.where(self.seen[: scores.numel()], penalised, scores)
        if opts.temperature == 0.0:
            token = scores.argmax().view(1)
        else:
            probs = torch.softmax(scores / opts.temperature, dim=-1)
            if opts.top_p < 1.0:
                probs = top_p_filter(probs, opts.top_p)
            token = torch.multinomial(probs, 1, generator=self.generator)
        self.seen[token] = True
        return token


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [V] -> the same with every token outside the nucleus zeroed: the most probable tokens whose mass
    first reaches top_p (the most probable one always kept)."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
    return probs * keep
