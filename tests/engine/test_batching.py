"""engine.context.batching: turns answered together give each the answer it gets alone (greedy: the same tokens and
text), over different documents, methods and budgets, two turns over one document (forks), a turn that joins
mid-answer and one that leaves early (cancelled): none disturbs the others (tiny models, CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

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


def _run(batch: TurnBatch, joining: list, cancel_after: dict[int, int]) -> dict[int, tuple]:
    """Answer `joining` [(step at which it joins, key, turn)] together; the turn keyed k in cancel_after leaves after
    that many steps. Returns key -> (its text as the pieces said it, its tokens, its answer's text, the Answer),
    finished turns' finish() applied."""
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
        out[key] = (texts[key] + (piece.text if piece is not None else ""), answer.tokens, answer.text, answer)
    return out


@pytest.mark.parametrize("ahead", [False, True])
def test_turns_answered_together_answer_as_alone(tiny_model_path, ahead):
    """Turns joining and leaving a batch answer as alone; with `ahead` each step is computed before the previous
    one's tokens are read (the GPU's way, here eagerly): a step already run for a turn that leaves is dropped, and a
    turn that joins meanwhile starts at the step after it."""
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
    got = _run(TurnBatch(lm, ahead=ahead), joining, cancel_after={1: 4})
    assert set(got) == set(alone)
    for key, (text, tokens, answer_text, _) in got.items():
        want_tokens, want_text = alone[key]
        if key == 1:  # cancelled: what it said so far is the start of its lone answer
            assert tokens == want_tokens[: len(tokens)] and 0 < len(tokens) < len(want_tokens)
            continue
        assert tokens == want_tokens, key
        assert answer_text == want_text and text.strip() == want_text
    assert len({tuple(v[1]) for v in got.values()}) > 1  # the answers are not one another's


LONG = ("Read the whole record before you answer, and answer in one short sentence, naming the person only. " * 2
        + "Who kept the lighthouse logbook?")
CHUNK = 48  # tokens a call of a long question's prefill here (the byte tokenizer: a byte a token)


def test_a_long_question_joins_a_call_at_a_time(tiny_model_path):
    """A question of several prefill chunks joins while another turn answers: its prefill runs a call a step (the
    other turn takes a token at each), and both answers are those they get alone, the lone long one in the same
    calls back to back (engine.model.generate.QuestionPrefill)."""
    from engine.model.load import load_model

    lm = load_model(str(tiny_model_path), device="cpu")
    sessions = _sessions(lm)

    def turn(doc: int, method: str, question: str, fork: bool = False):
        made = sessions[doc].turn(question, method, 0.7, MAX_TOKENS, fork=fork)
        made.step.prefill_chunk = CHUNK
        return made

    alone = {}
    for key, (doc, method, question) in enumerate([(1, "quest", "Who grafted the pear trees?"),
                                                  (0, "squeeze", LONG)]):
        made = turn(doc, method, question)
        calls = -(-made.prompt.numel() // CHUNK)
        answer = [e for e in sessions[doc].run(made)][-1]
        alone[key] = (answer.tokens, answer.text, calls, answer.stats.kv_budget_prefill)
    assert alone[1][2] >= 3  # the long question takes several calls
    whole = turn(0, "squeeze", LONG)
    whole.step.prefill_chunk = 10_000
    one_call = [e for e in sessions[0].run(whole)][-1].stats.kv_budget_prefill
    assert abs(alone[1][3] - one_call) <= 0.01  # its calls read the budget as one call does (the CPU's exact cut)

    batch = TurnBatch(lm)
    short = turn(1, "quest", "Who grafted the pear trees?")
    assert batch.join(short) is not None or short.generated
    long = turn(0, "squeeze", LONG)
    assert batch.join(long) is None and len(batch.joining) == 1  # its first call only
    taken, steps_to_first = len(short.generated), None
    for steps in range(1, 4 * MAX_TOKENS):
        batch.step()
        if steps_to_first is None and long.generated:
            steps_to_first = steps
            assert len(short.generated) == min(taken + steps, MAX_TOKENS) or short.done  # a token each call
        if not len(batch):
            break
    assert steps_to_first == alone[1][2] - 1  # the rest of its calls, one a step
    for key, made in ((0, short), (1, long)):
        _, answer = made.finish()
        assert (answer.tokens, answer.text) == alone[key][:2], key


def test_a_long_question_in_calls_is_the_one_call_prefill_under_full_attention(tiny_model_path):
    """Every key read (full attention), a question prefilled a chunk a call gives the answer of the question in one
    call: the calls' positions, new-token K/V and causal reads join up exactly. The decode steps then carry the
    whole question's follow rows and recent tokens, as after one call, and the statistics count the calls as the
    prefill's lookups."""
    from engine.model.load import load_model

    lm = load_model(str(tiny_model_path), device="cpu")
    session = _sessions(lm)[0]
    answers, carried = [], []
    for chunk in (CHUNK, 10_000):
        made = session.turn(LONG, "full", 0.0, MAX_TOKENS)
        made.step.prefill_chunk = chunk
        answers.append([e for e in session.run(made)][-1])
        sparse = session.turn(LONG, "squeeze", 0.7, 1)  # (full attention reads no follow rows)
        sparse.step.prefill_chunk = chunk
        list(session.run(sparse))
        carried.append((sparse.step.follow.question.clone(), sparse.step.follow.recent.clone()))
    assert answers[0].tokens == answers[1].tokens and answers[0].text == answers[1].text
    assert answers[0].stats.kv_budget_prefill == answers[1].stats.kv_budget_prefill == 1.0
    assert torch.equal(carried[0][0], carried[1][0]) and (carried[0][0] >= 0).any()  # the question's rows
    assert torch.equal(carried[0][1], carried[1][1])
    calls = -(-made.prompt.numel() // CHUNK)
    assert calls >= 3 and answers[0].stats.steps == answers[1].stats.steps + calls - 1
