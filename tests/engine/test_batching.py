"""engine.context.batching: turns answered together give each the answer it gets alone (greedy: the same tokens and
text), over different documents, methods and budgets, two turns over one document (forks), a turn that joins
mid-answer and one that leaves early (cancelled): none disturbs the others (tiny models, CPU, fp32)."""

from __future__ import annotations

import pytest

from engine.context.batching import TurnBatch
from engine.context.turn import Delta
from tests.engine.test_batch_step import SEQUENCES, _sessions

MAX_TOKENS = 12

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.parametrize("tiny_model_path", ["llama_gqa", "gemma3_hybrid"], indirect=True)]


def _turn(sessions, seen: set, doc: int, method: str, sparsity: float, question: str):
    """A turn of SEQUENCES' kind; a second one over a document takes a fork."""
    turn = sessions[doc].turn(question, method, sparsity, MAX_TOKENS, fork=doc in seen)
    seen.add(doc)
    return turn


def _run(batch: TurnBatch, joining: list, cancel_after: dict[int, int]) -> dict[int, tuple[str, list[int]]]:
    """Answer `joining` [(step at which it joins, key, turn)] together; the turn keyed k in cancel_after leaves after
    that many steps. Returns key -> (its text as the pieces said it, its tokens), finished turns' finish() applied."""
    texts: dict[int, str] = {}
    keys = {}
    steps = 0
    finished = {}
    pending = sorted(joining, key=lambda j: j[0])
    while pending or len(batch):
        while pending and pending[0][0] <= steps:
            _, key, turn = pending.pop(0)
            keys[id(turn)] = key
            piece = batch.join(turn)
            texts[key] = piece.text if piece is not None else ""
            if turn.done:
                finished[key] = turn
        for turn, piece in batch.step():
            key = keys[id(turn)]
            texts[key] += piece.text if isinstance(piece, Delta) else ""
            if turn.done:
                finished[key] = turn
        steps += 1
        for key, after in cancel_after.items():
            turn = next((t for t in batch.turns if keys[id(t)] == key), None)
            if turn is not None and steps >= after:
                batch.leave(turn)
                finished[key] = turn
    out = {}
    for key, turn in finished.items():
        piece, answer = turn.finish()
        out[key] = (texts[key] + (piece.text if piece is not None else ""), answer.tokens, answer.text)
    return out


def test_turns_answered_together_answer_as_alone(tiny_model_path):
    from engine.model.load import load_model

    lm = load_model(str(tiny_model_path), device="cpu")
    sessions = _sessions(lm)
    alone = {}
    for key, (doc, method, sparsity, question) in enumerate(SEQUENCES):
        answer = sessions[doc].ask(question, method, sparsity, MAX_TOKENS)
        alone[key] = (answer.tokens, answer.text)
    seen: set = set()
    # the first two join at once, the third after two steps, the fourth after three; the second leaves after 4
    joining = [(at, key, _turn(sessions, seen, *SEQUENCES[key])) for at, key in ((0, 0), (0, 1), (2, 2), (3, 3))]
    got = _run(TurnBatch(lm), joining, cancel_after={1: 4})
    assert set(got) == set(alone)
    for key, (text, tokens, answer_text) in got.items():
        want_tokens, want_text = alone[key]
        if key == 1:  # cancelled: what it said so far is the start of its lone answer
            assert tokens == want_tokens[: len(tokens)] and 0 < len(tokens) < len(want_tokens)
            continue
        assert tokens == want_tokens, key
        assert answer_text == want_text and text.strip() == want_text
    assert len({tuple(v[1]) for v in got.values()}) > 1  # the answers are not one another's
