"""How the next token is chosen from the model's logits: greedy by default, or sampled with a temperature and a
top-p (nucleus) cut, with a repetition penalty on what the answer already said.

The repetition penalty (CTRL's, as transformers applies it: a seen token's positive logit divided by the penalty,
a negative one multiplied) counts the answer's own tokens only, not the document's nor the question's: an answer
about a document should be free to quote it, and a base model's failure is to repeat its own lines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.catalog import GenerationOptions

GREEDY_PARTS = 256  # greedy(): the vocabulary's maximum taken over this many slices, then over their maxima


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [1, V] (or [V]) -> [1] int64: the index of the first maximum, as logits.argmax() gives it, in two
    reductions. torch's argmax over one row of a 128K vocabulary is one thread block's work (35 us of an H200's
    decode step of an 8B model); the maxima of GREEDY_PARTS slices, then their argmax, fill the GPU (no host sync)."""
    if logits.dim() > 2 or (logits.dim() == 2 and logits.shape[0] != 1):
        raise ValueError(f"greedy picks one token: logits must be [1, V] or [V], got {tuple(logits.shape)}")
    row = logits.reshape(-1)
    width = -(-row.numel() // GREEDY_PARTS)
    parts = -(-row.numel() // width)
    padded = F.pad(row, (0, parts * width - row.numel()), value=float("-inf")) if parts * width > row.numel() else row
    values, where = padded.view(parts, width).max(dim=1)  # [parts]: each slice's first maximum
    best = values.argmax().view(1)  # the first slice holding the maximum
    return best * width + where.gather(0, best)


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
            token = greedy(scores)
        else:
            probs = torch.softmax(scores / opts.temperature, dim=-1)
            if opts.top_p < 1.0:
                probs = top_p_filter(probs, opts.top_p)
            token = torch.multinomial(probs, 1, generator=self.generator)
        self.seen[token] = True
        return token


def choose(logits: torch.Tensor, sampler: Sampler | None) -> torch.Tensor:
    """The next token from logits [1, V]: greedy without a sampler, else the sampler's pick. [1] int64."""
    return greedy(logits) if sampler is None else sampler.pick(logits)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [V] -> the same with every token outside the nucleus zeroed: the most probable tokens whose mass
    first reaches top_p (the most probable one always kept)."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
    return probs * keep
