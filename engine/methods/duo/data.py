"""The synthetic passkey sequences DuoAttention's gates are trained on (Xiao et al., 2024, section 2.2 and the
official data: passkeys of random NATO-alphabet words inserted at random depths of real text, then each asked for
and answered in order).

A sequence is a function of (seed, step): its length (one of `lengths` points from min_tokens to max_tokens), the
place of its haystack in the corpus, its passkeys and their depths all come from one generator seeded by both.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor",
         "whiskey", "xray", "yankee", "zulu")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
NEEDLE = "Remember this sequence of words, it's the {ordinal} passkey to the vault: {words}."
QUESTION = "Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey: "
HEAD = "This is a very long story book: <book> "
FOOT = " </book>.\n\n"


@dataclass(frozen=True)
class GateData:
    """min_tokens, max_tokens: the haystack's length range (the paper: 1,000 to the model's maximum), in `lengths`
    evenly spaced points (50); passkeys per sequence (10) of `words` words each (32), at depths 0.1 to 0.9."""

    min_tokens: int = 1000
    max_tokens: int = 4096
    lengths: int = 50
    passkeys: int = 5
    words: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens or self.lengths < 1:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens and lengths >= 1, got {self}")
        if not 1 <= self.passkeys <= len(ORDINALS) or self.words < 1:
            raise ValueError(f"passkeys must be 1 to {len(ORDINALS)} and words at least 1, got {self}")


@dataclass
class Sequence:
    """context: token ids of the book with its passkeys (the fixed context); new: the questions and answers (the
    tokens whose hidden states the loss compares)."""

    context: list[int]
    new: list[int]


def training_sequence(tokenizer, corpus: list[int], data: GateData, seed: int, step: int,
                      max_context: int) -> Sequence:
    """The sequence of `step`. corpus: token ids of real text; max_context: the model's context (the sequence,
    questions included, stays within it). Raises ValueError when the corpus is shorter than min_tokens."""
    rng = random.Random(seed * 1_000_003 + step)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    keys = [" ".join(rng.choice(WORDS) for _ in range(data.words)) for _ in range(data.passkeys)]
    needles = [ids("\n\n" + NEEDLE.format(ordinal=ORDINALS[i], words=k) + "\n\n") for i, k in enumerate(keys)]
    new: list[int] = []
    for i, k in enumerate(keys):
        new += ids(QUESTION.format(ordinal=ORDINALS[i])) + ids(k) + ids("\n\n")
    head, foot = _bos(tokenizer) + ids(HEAD), ids(FOOT)
    room = max_context - len(new) - len(head) - len(foot) - sum(map(len, needles))
    top = min(data.max_tokens, room, len(corpus))
    if top < data.min_tokens:
        raise ValueError(f"a {data.min_tokens}-token haystack does not fit: the corpus holds {len(corpus)} tokens "
                         f"and the model's context leaves {room}")
    points = [round(data.min_tokens + (top - data.min_tokens) * i / max(1, data.lengths - 1))
              for i in range(data.lengths)]
    length = rng.choice(points)
    start = rng.randrange(0, len(corpus) - length + 1)
    stack = corpus[start : start + length]
    depths = sorted(rng.uniform(0.1, 0.9) for _ in range(data.passkeys))
    context, last = list(head), 0
    for depth, needle in zip(depths, needles):
        cut = int(len(stack) * depth)
        context += stack[last:cut] + needle
        last = cut
    context += stack[last:] + foot
    return Sequence(context=context, new=new)


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
