"""engine.serve.scheduler through Engine.stream: turns asked at once, over two documents, are answered in one batch
and each as it is alone (greedy: the same text and tokens); beyond the batch a turn waits, told its place; a closed
stream leaves the queue or the batch and frees its place; with a batch of one each turn runs alone, the next told
it is next, its first token's time counted from its ask; a turn that fails is raised to its reader and the others
go on; a waiting turn's context is read on a thread of its own while the turns under way step (or, one turn at a
time, while the turn before it runs), and opened from that read (tiny model; CPU, and CUDA where there is one)."""

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


def _hold_after_first_piece(monkeypatch) -> threading.Event:
    """A lone turn (ContextSession.run) yields its first piece, then waits until the returned event is set."""
    gate, run = threading.Event(), ContextSession.run

    def held(self, turn, stop=None):
        for i, event in enumerate(run(self, turn, stop)):
            yield event
            if i == 0:
                assert gate.wait(60)

    monkeypatch.setattr(ContextSession, "run", held)
    return gate


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
    gate = _hold_after_first_piece(monkeypatch)
    ferry = contexts["ferry"]
    first = engine.stream(ferry, ASKED[0][1], "squeeze", 0.5, TOKENS)
    head = _first_piece(first)
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


class _HeldReads:
    """The engine's artifact reads recorded as (thread name, context id, names); the warm-up thread's reads of
    `held` wait for `release` (set) and tell `reading` when they begin and `read` when they end."""

    def __init__(self, engine: Engine, held: str):
        self.calls: list[tuple[str, str, list]] = []
        self.held, self.reading, self.read, self.release = held, threading.Event(), threading.Event(), threading.Event()
        self._load = engine.store.artifacts.load
        engine.store.artifacts.load = self

    def __call__(self, context_id, names=None, device="cpu"):
        thread = threading.current_thread().name
        self.calls.append((thread, context_id, list(names) if names is not None else None))
        warm = thread == "squeeze-warm" and context_id == self.held
        if warm:
            self.reading.set()
            assert self.release.wait(120)
        try:
            return self._load(context_id, names, device)
        finally:
            if warm:
                self.read.set()

    def session_reads(self, engine: Engine, context_id: str) -> list[str]:
        """The threads that read the whole of a session of `context_id` (its context's and its methods' files)."""
        wanted = [row[0] for row in engine._session_artifacts(context_id, engine.built_methods(context_id))]
        return [t for t, c, n in self.calls if c == context_id and n == wanted]


def _first_piece(stream):
    """A stream's first event past the places it was told (a turn asked as the one before it ends may wait an
    instant)."""
    event = next(stream)
    while isinstance(event, Waiting):
        event = next(stream)
    return event


def _events(stream, n: int, timeout: float = 120.0) -> list:
    """Up to n more events of a stream, read on a thread (a stream that stalls fails the test, not hangs it)."""
    got: list = []

    def read() -> None:
        for event in stream:
            got.append(event)
            if len(got) == n:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), f"the stream stalled after {len(got)} events"
    return got


def test_a_waiting_turns_context_is_read_while_the_turns_under_way_step(lm, tmp_path):
    """A turn over a context that is not open waits while its files are read and checked on another thread (the
    turn under way keeps taking tokens meanwhile), then joins without reading them again; both answers as alone."""
    engine, contexts = _engine(lm, tmp_path, max_batch=2)
    solo = _solo(engine, contexts)
    light = contexts["light"]
    engine._forget([light])  # closed: its next turn opens it from its files
    reads = _HeldReads(engine, light)
    first = engine.stream(contexts["ferry"], ASKED[0][1], "squeeze", 0.5, TOKENS)
    head = [next(first)]
    second = engine.stream(light, ASKED[2][1], "squeeze", 0.5, TOKENS)
    assert next(second) == Waiting(0)
    assert reads.reading.wait(60)  # its context is being read, on the warm-up thread
    more = _events(first, 3)  # the turn under way is not held up by that read
    assert len(more) == 3 and not any(isinstance(e, Answer) for e in more)
    reads.release.set()
    events, answer = _drain(second, [])
    assert answer.tokens == solo[2].tokens and answer.text == solo[2].text
    events, answer = _drain(first, head + more)
    assert answer.tokens == solo[0].tokens and answer.text == solo[0].text
    assert reads.session_reads(engine, light) == ["squeeze-warm"]  # read once, ahead of its turn
    assert not engine._warmed  # taken by the session it was read for


def test_with_a_batch_of_one_the_next_turns_context_is_read_while_a_turn_runs(lm, tmp_path, monkeypatch):
    """With one turn at a time, the next turn's context (not open) is read while the turn before it runs, and its
    session opens from that read."""
    engine, contexts = _engine(lm, tmp_path, max_batch=1)
    solo = _solo(engine, contexts)  # the last turn's context stays open: "light"
    ferry = contexts["ferry"]
    reads = _HeldReads(engine, ferry)
    reads.release.set()
    gate = _hold_after_first_piece(monkeypatch)
    first = engine.stream(contexts["light"], ASKED[2][1], "squeeze", 0.5, TOKENS)
    head = _first_piece(first)
    second = engine.stream(ferry, ASKED[0][1], "squeeze", 0.5, TOKENS)
    assert next(second) == Waiting(0)
    assert reads.read.wait(60)  # read while the first turn runs
    gate.set()
    assert _drain(first, [head])[1].tokens == solo[2].tokens
    assert _drain(second, [])[1].tokens == solo[0].tokens
    assert reads.session_reads(engine, ferry) == ["squeeze-warm"]


def test_a_context_that_does_not_fit_beside_the_turns_under_way_waits_for_them(lm, tmp_path, monkeypatch):
    """With memory for one context (and CONTEXT_HEADROOM) but a batch of two, a turn over a second context is not
    opened beside a turn under way: it waits, told it is next, and opens once the first ends (the idle first
    context closed to make room); both answers as alone. Without the memory check both would run together."""
    from engine.serve.service import CONTEXT_HEADROOM

    engine, contexts = _engine(lm, tmp_path, max_batch=2)
    solo = _solo(engine, contexts)
    ferry, light = contexts["ferry"], contexts["light"]
    sizes = {c: engine.context_bytes(c) for c in (ferry, light)}
    assert min(sizes.values()) > 0
    budget = max(sizes.values()) + CONTEXT_HEADROOM + min(sizes.values()) // 2  # one context, not two
    monkeypatch.setattr(engine, "free_bytes", lambda: budget - sum(engine._open_bytes.values()))
    engine._forget([ferry, light])
    engine.session(ferry)
    assert engine.can_open(light)  # the open one is idle: it would be closed for it
    monkeypatch.setattr(engine.scheduler, "contexts_in_use", lambda: {ferry})
    assert not engine.can_open(light) and engine.can_open(ferry)  # a turn reads it: no room beside it
    monkeypatch.undo()
    monkeypatch.setattr(engine, "free_bytes", lambda: budget - sum(engine._open_bytes.values()))
    first = engine.stream(ferry, ASKED[0][1], "squeeze", 0.5, TOKENS)
    head = _first_piece(first)
    second = engine.stream(light, ASKED[2][1], "squeeze", 0.5, TOKENS)
    assert next(second) == Waiting(0)  # the batch has room, the memory has not
    events, answer = _drain(first, [head])
    assert answer.tokens == solo[0].tokens and answer.text == solo[0].text
    events, answer = _drain(second, [])
    assert answer.tokens == solo[2].tokens and answer.text == solo[2].text
    assert light in engine._sessions and ferry not in engine._sessions  # the idle one closed to make room
