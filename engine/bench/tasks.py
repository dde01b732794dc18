"""What a needle cell hides in its haystack and asks (`squeeze eval`'s needles, engine.bench.needles): the passkey
probe, and tasks that matching the question's words against the document does not solve.

    passkey     "The secret passkey is K. ..." asked as "What is the secret passkey?": the question repeats the
                needle's words, which is what the follow rows (engine.attention.follow) match
    paraphrase  the key in a sentence that shares no two consecutive words with the question (a vault's number,
                asked for as the strongbox's code)
    multikey    four needles of one form, a door's colour and its key each; one colour is asked
    vartrack    a chain of three assignments spread after the depth (A is K; B is A's value; C is B's): asked for C

Every task places its sentences with engine.bench.passkey.insert_sentence; the cell's key is what the answer must
say. A cell's distractors and names come from a generator seeded by the cell (task, length, depth, key), so a run is
repeatable.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from engine.bench.passkey import PASSKEY_QUESTION, insert_passkey, insert_sentence

PARAPHRASE_SENTENCE = "Kept in the archive, the number for the harbour vault reads {key}. Again, {key}."
PARAPHRASE_QUESTION = "Which code opens the strongbox at the port?"
MULTIKEY_SENTENCE = "The secret passkey of the {colour} door is {key}."
MULTIKEY_QUESTION = "What is the secret passkey of the {colour} door?"
COLOURS = ("red", "blue", "green", "yellow")
VARTRACK_FIRST = "The variable {name} is set to {key}."
VARTRACK_NEXT = "The variable {name} is set to the value of {previous}."
VARTRACK_QUESTION = "What is the value of the variable {name}?"
NAMES = ("KESTREL", "MARLIN", "OSPREY", "HERON", "PETREL", "GANNET", "PLOVER", "CURLEW")


@dataclass(frozen=True)
class Needle:
    """One cell's document (the haystack with the task's sentences in it), its question and the key the answer must
    say."""

    text: str
    question: str
    key: str


def insert_all(text: str, placed: list[tuple[float, str]]) -> str:
    """Each (depth, sentence) inserted (engine.bench.passkey.insert_sentence), the deepest first, so that the
    shallower depths stay where they were."""
    for at, sentence in sorted(placed, reverse=True):
        text = insert_sentence(text, sentence, at)
    return text


def _passkey(text: str, key: str, depth: float, rng: random.Random) -> Needle:
    return Needle(insert_passkey(text, key, depth), PASSKEY_QUESTION, key)


def _paraphrase(text: str, key: str, depth: float, rng: random.Random) -> Needle:
    return Needle(insert_sentence(text, PARAPHRASE_SENTENCE.format(key=key), depth), PARAPHRASE_QUESTION, key)


def _multikey(text: str, key: str, depth: float, rng: random.Random) -> Needle:
    """The asked door's needle at `depth`, the other three at depths spread evenly around it, each with a key of its
    own (five digits, none the asked one)."""
    asked = rng.randrange(len(COLOURS))
    others = set()
    while len(others) < len(COLOURS) - 1:
        other = str(rng.randrange(10000, 100000))
        if other != key:
            others.add(other)
    keys = iter(sorted(others))
    placed = []
    for i, colour in enumerate(COLOURS):
        shift = (i - asked) / len(COLOURS)
        placed.append(((depth + shift) % 1.0, MULTIKEY_SENTENCE.format(colour=colour,
                                                                    key=key if i == asked else next(keys))))
    return Needle(insert_all(text, placed), MULTIKEY_QUESTION.format(colour=COLOURS[asked]), key)


def _vartrack(text: str, key: str, depth: float, rng: random.Random) -> Needle:
    """A is set to the key at `depth`, B to A's value a third of the rest later, C to B's two thirds later."""
    a, b, c = rng.sample(NAMES, 3)
    rest = 1.0 - depth
    placed = [(depth, VARTRACK_FIRST.format(name=a, key=key)),
              (depth + rest / 3, VARTRACK_NEXT.format(name=b, previous=a)),
              (depth + 2 * rest / 3, VARTRACK_NEXT.format(name=c, previous=b))]
    return Needle(insert_all(text, placed), VARTRACK_QUESTION.format(name=c), key)


TASKS: dict[str, Callable[[str, str, float, random.Random], Needle]] = {
    "passkey": _passkey, "paraphrase": _paraphrase, "multikey": _multikey, "vartrack": _vartrack,
}


def place(task: str, text: str, key: str, depth: float, length: int) -> Needle:
    """The cell (task, length, depth, key)'s needle in `text`."""
    if task not in TASKS:
        raise ValueError(f"unknown needle task {task!r}; choose from {', '.join(TASKS)}")
    return TASKS[task](text, key, depth, random.Random(f"{task}:{length}:{depth}:{key}"))
