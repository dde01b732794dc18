"""engine.serve.scheduler through Engine.stream: turns asked at once, over two documents, are answered in one batch
and each as it is alone (greedy: the same text and tokens); beyond the batch a turn waits, told its place; a closed
stream leaves the queue or the batch and frees its place; with a batch of one each turn runs alone, the next told
it is next, its first token's time counted from its ask; a turn that fails is raised to its reader and the others
go on (tiny model; CPU, and CUDA where there is one)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.context.session import ContextSession
from engine.context.turn import Answer, Delta
from engine.model.load import load_model
from engine.serve.scheduler import Waiting
from engine.serve.service import Engine
from tests.support.tiny_models import make_tiny_model

FERRY = "The ferry to Orsa leaves at 7:40 from pier 3. Tickets cost 12 crowns; bicycles travel free. " * 6
LIGHT = "Callow Head Light was first lit in 1847 and was kept by the Marr family for ninety years. " * 6
TOKENS = 48  # long enough that the first turns are under way while the others are asked
ASKED = [("ferry", "When does the ferry leave?"), ("ferry", "What do tickets cost?"),
         ("light", "When was it first lit?"), ("light", "Who kept the light?")]


@pytest.fixture(scope="module", params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def lm(request, tmp_path_factory):
    return load_model(str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama_gqa")), request.param)


def _engine(lm, tmp_path, max_batch: int) -> tuple[Engine, dict[str, str]]:
    engine = Engine(tmp_path / "cache", lm=lm, max_batch=max_batch)
    contexts = {}
    for name, text in (("ferry", FERRY), ("light", LIGHT)):
        (tmp_path / f"{name}.txt").write_text(text)
        contexts[name] = engine.ingest(tmp_path / f"{name}.txt").context_id
    return engine, contexts


def _drain(stream, first: list) -> tuple[list, Answer | None]:
    """The rest of a stream's events after `first` (the ones already read), and its Answer."""
    events = list(first) + list(stream)
    answers = [e for e in events if isinstance(e, Answer)]
    return events, answers[0] if answers else None


def _solo(engine: Engine, contexts: dict) -> list[Answer]:
    return [engine.ask(contexts[doc], q, "squeeze", 0.5, TOKENS) for doc, q in ASKED]


def test_turns_asked_together_are_answered_as_alone(lm, tmp_path):
    engine, contexts = _engine(lm, tmp_path, max_batch=4)
    solo = _solo(engine, contexts)
    streams = [engine.stream(contexts[doc], q, "squeeze", 0.5, TOKENS) for doc, q in ASKED]
    firsts = [[next(s)] for s in streams]  # all four under way at once: two documents in one batch
    assert not any(isinstance(f[0], Waiting) for f in firsts)
    results = [None] * 4

    def drain(i: int) -> None:
        results[i] = _drain(streams[i], firsts[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for (events, answer), want in zip(results, solo):
        assert answer is not None and answer.tokens == want.tokens and answer.text == want.text
        said = "".join(e.text for e in events if isinstance(e, Delta))
        assert said.strip() == want.text
    assert engine.scheduler.queued() == 0


def test_a_closed_stream_frees_its_place(lm, tmp_path):
    engine, contexts = _engine(lm, tmp_path, max_batch=2)
    solo = _solo(engine, contexts)
    ferry = contexts["ferry"]
    first = engine.stream(ferry, ASKED[0][1], "squeeze", 0.5, TOKENS)
    second = engine.stream(ferry, ASKED[1][1], "squeeze", 0.5, TOKENS)
    third = engine.stream(contexts["light"], ASKED[2][1], "squeeze", 0.5, TOKENS)
    fourth = engine.stream(ferry, ASKED[0][1], "squeeze", 0.5, TOKENS)
    heads = [next(first), next(second)]
    assert next(third) == Waiting(0) and next(fourth) == Waiting(1)
    third.close()  # left while waiting: the fourth is next
    assert next(fourth) == Waiting(0)
    second.close()  # left mid-answer: its place in the batch goes to the fourth
    events, answer = _drain(fourth, [])
    assert answer.tokens == solo[0].tokens
    events, answer = _drain(first, heads[:1])
    assert answer.tokens == solo[0].tokens and answer.text == solo[0].text
    assert engine.scheduler.queued() == 0


def test_a_batch_of_one_answers_one_turn_at_a_time(lm, tmp_path, monkeypatch):
    engine, contexts = _engine(lm, tmp_path, max_batch=1)
    solo = _solo(engine, contexts)
    gate, run = threading.Event(), ContextSession.run

    def held(self, turn, stop=None):  # the lone turn's first piece, then it waits for the test
        for i, event in enumerate(run(self, turn, stop)):
            yield event
            if i == 0:
                assert gate.wait(60)

    monkeypatch.setattr(ContextSession, "run", held)
    ferry = contexts["ferry"]
    first = engine.stream(ferry, ASKED[0][1], "squeeze", 0.5, TOKENS)
    head = next(first)
    second = engine.stream(ferry, ASKED[1][1], "squeeze", 0.5, TOKENS)
    assert next(second) == Waiting(0)  # told at once, while the first runs
    gate.set()
    assert _drain(first, [head])[1].tokens == solo[0].tokens
    answer = _drain(second, [])[1]
    assert answer.tokens == solo[1].tokens
    timings = answer.stats.timings  # counted from the ask: the wait behind the first turn is in its first token's
    assert 0 < timings["queued_s"] <= timings["first_token_s"] <= timings["total_s"]


def test_a_turn_that_fails_is_raised_to_its_reader_and_the_others_go_on(lm, tmp_path):
    engine, contexts = _engine(lm, tmp_path, max_batch=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(engine.stream(contexts["ferry"], "When?", "squeeze", 0.5, 0))
    with pytest.raises(Exception, match="no-such-context|not found|No such|no such"):
        list(engine.stream("no-such-context", "When?", "squeeze", 0.5, 4))
    answer = [e for e in engine.stream(contexts["ferry"], ASKED[0][1], "squeeze", 0.5, 4) if isinstance(e, Answer)]
    assert len(answer) == 1 and answer[0].stats.new_tokens >= 1
