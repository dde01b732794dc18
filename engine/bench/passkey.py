"""Synthetic passkey retrieval: hide a key in a document at a chosen depth (the standard long-context probe)."""

from __future__ import annotations

PASSKEY_QUESTION = "What is the secret passkey?"
PASSKEY_SENTENCE = "The secret passkey is {key}. Remember it. {key} is the secret passkey."


def insert_sentence(text: str, sentence: str, depth: float) -> str:
    """Insert `sentence` at the sentence boundary nearest after `depth` (0..1) of the text."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    target = int(len(text) * depth)
    cut = text.find(". ", target)
    cut = len(text) if cut < 0 else cut + 2
    return text[:cut] + sentence + " " + text[cut:]


def insert_passkey(text: str, key: str, depth: float) -> str:
    """Insert the passkey sentence at the sentence boundary nearest after `depth` (0..1) of the text."""
    return insert_sentence(text, PASSKEY_SENTENCE.format(key=key), depth)
