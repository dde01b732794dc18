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
    """logits [B, V] (or [V]) -> [B] int64 ([1] for [V]): each row's index of its first maximum, as
    logits.argmax(dim=-1) gives it, in two reductions for every row at once (a batched step's B rows included).
    torch's argmax over one row of a 128K vocabulary is one thread block's work (35 us of an H200's decode step of an
    8B model); the maxima of GREEDY_PARTS slices, then their argmax, fill the GPU (no host sync)."""
    if logits.dim() not in (1, 2):
        raise ValueError(f"greedy picks a token a row: logits must be [B, V] or [V], got {tuple(logits.shape)}")
    rows = logits.reshape(-1, logits.shape[-1])  # [B, V]
    vocab = rows.shape[1]
    width = -(-vocab // GREEDY_PARTS)
    parts = -(-vocab // width)
    padded = F.pad(rows, (0, parts * width - vocab), value=float("-inf")) if parts * width > vocab else rows
    values, where = padded.reshape(rows.shape[0], parts, width).max(dim=2)  # [B, parts]: each slice's first maximum
    best = values.argmax(dim=1, keepdim=True)  # [B, 1]: the first slice holding the row's maximum
    return (best * width + where.gather(1, best)).view(-1)


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
