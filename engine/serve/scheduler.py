"""Every user's turns on one model: a thread that owns the model's steps, answers up to `max_batch` turns together and
keeps the rest in a queue, first come first served, each told its place.

The first turn in the queue joins the turns under way when the batch has room and it can run beside them: its
method's index built, its context open or openable beside theirs (the engine keeps up to max_batch contexts on the
device, as many as its memory holds: Engine.can_open), and, over a context that other turns read, in their order of
its K/V (ContextSession.layout_key). Otherwise it, and everything behind it, waits until it can (at the latest when
no turn is under way): no turn overtakes another. While turns wait, the first ones that could fit in the batch are
warmed one at a time on a thread of their own (Request.warm: their context's files read and checked into memory,
nothing on the device), and a turn joins turns under way only once warmed, so that admitting it costs them its copy
to the device, not a read of gigabytes from disk (a lone turn, max_batch 1, runs while the next one's context is
read). Admitted, a turn's question is prefilled alone (a long one a chunk a step, between the others' steps), then
it takes one token a step with the others (engine.context.batching.TurnBatch). With max_batch = 1 each turn runs
alone through its session's own path (on a GPU its steps replayed from CUDA graphs). A turn whose reader goes away
(its stream closed: the user stopped it or left) leaves at the next step; the others go on.
"""

from __future__ import annotations

import cProfile
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from engine.context.batching import TurnBatch
from engine.context.session import ContextSession
from engine.context.turn import Answer, Delta, Turn
from engine.model.load import LoadedModel

CPU_BATCH = 4  # turns answered together by default on the CPU
# Turns answered together by default on a GPU: on an H100 eight turns over eight 32K contexts step in 1.46x a lone
# turn's time (5.5x its tokens a second; engine/bench/README.md, "Captures without a synchronisation"), and a turn
# alone in the batch replays its session's own step (engine.model.lone_graph)
GPU_BATCH = 8
WAIT_REPEAT_S = 0.5  # a queued turn's Waiting is yielded again this often (its reader may stop it meanwhile)


def default_batch(device: torch.device) -> int:
    """Turns answered together by default: CPU_BATCH on the CPU, GPU_BATCH on a GPU (a batch's steps replayed from
    CUDA graphs, captured anew whenever a turn joins or leaves: engine.context.batching); `squeeze serve --batch N`
    answers N together, `--batch 1` one at a time."""
    return GPU_BATCH if device.type == "cuda" else CPU_BATCH


@dataclass(frozen=True)
class Waiting:
    """A turn is queued: `ahead` turns are before it (0: it is next)."""

    ahead: int


@dataclass(eq=False)
class Request:
    """A turn asked for. prepare(): its context's session with the method's index built (slow the first time:
    called when the turn is admitted); joinable(): whether its session is open with the index built, so that it
    can join turns under way without building or loading anything; make(session, fork): its Turn (fork: another
    turn over the context is under way), whose times count from `asked` (its first token's time holds its wait).
    Its events (Delta, Answer, Waiting, an exception; None ends them) go to `events`. warm(): the work that makes
    prepare() quick and needs neither the model nor the device, or None where there is none (a quick look, under the
    scheduler's lock; the work runs on another thread while the turn waits, and what it raises is left for prepare
    to raise in its turn); warm None: nothing to do ahead."""

    context_id: str
    method: str
    prepare: Callable[[], ContextSession]
    joinable: Callable[[], bool]
    make: Callable[[ContextSession, bool], Turn]
    warm: Callable[[], Callable[[], None] | None] | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    gone: threading.Event = field(default_factory=threading.Event)  # its reader closed the stream
    asked: float = field(default_factory=time.perf_counter)
    told: int | None = None  # the place last told
    session: ContextSession | None = None
    turn: Turn | None = None
    warming: str = ""  # its warm(): "" not begun, "running", "done"


class Scheduler:
    """Steps the turns of every request together (the module docstring); lm(): the model (loaded on first use)."""

    def __init__(self, max_batch: int, lm: Callable[[], LoadedModel]):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.max_batch = max_batch
        self._lm = lm
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._batch: TurnBatch | None = None
        self._alone: Request | None = None  # the turn running alone (max_batch 1)
        self._warming: threading.Thread | None = None  # the thread warming a waiting turn (one at a time)
        self._starting: Request | None = None  # the turn being admitted (its preparation runs on the thread)
        self.profiler: cProfile.Profile | None = None  # set: the thread's work runs under it (bench serve --profile)
        self.timeline: list[tuple[str, int, float, float]] | None = None  # set: the thread's work appended to it as
        # (kind, turns under way before it, its start on time.perf_counter's clock, seconds): "start" (a turn admitted,
        # its first token taken), "step" (bench serve)

    def stream(self, request: Request) -> Iterator[Delta | Answer | Waiting]:
        """Queue the request and yield its events: Waiting(ahead) while it waits (each time its place changes, and
        every WAIT_REPEAT_S), then the answer's pieces and its Answer. An exception of its turn is raised here.
        Closing the stream early takes the turn out, waiting or under way."""
        with self._cond:
            self._waiting.append(request)
            if self._alone is not None:  # a turn runs alone: the loop tells places again only after it
                request.told = len(self._waiting) - 1
                request.events.put(Waiting(request.told))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="squeeze-scheduler", daemon=True)
                self._thread.start()
            self._warm_next()  # (the thread may be busy with a lone turn)
            self._cond.notify_all()
        try:
            last = None
            while True:
                try:
                    event = request.events.get(timeout=WAIT_REPEAT_S if isinstance(last, Waiting) else None)
                except queue.Empty:  # still waiting: said again, so that a reader may stop between two events
                    event = last
                if event is None:
                    return
                if isinstance(event, BaseException):
                    raise event
                last = event
                yield event
        finally:
            request.gone.set()
            with self._cond:
                self._cond.notify_all()

    def contexts_in_use(self) -> set[str]:
        """The contexts that turns under way read."""
        with self._cond:
            return {r.context_id for r in [*self._active, *([self._alone] if self._alone else [])]}

    def queued(self) -> int:
        """Turns waiting now."""
        with self._cond:
            return len(self._waiting)

    # ------------------------------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                for request in [r for r in self._waiting if r.gone.is_set()]:  # readers gone while waiting
                    self._waiting.remove(request)
                    request.events.put(None)
                while not self._waiting and not self._active:
                    self._cond.wait()
                try:
                    admitted = self._admit()
                except BaseException as exc:  # noqa: BLE001 - the first waiting turn cannot say whether it joins
                    self._fail(self._waiting.popleft(), exc, locked=True)
                    continue
                for ahead, request in enumerate(self._waiting):
                    if request.told != ahead:
                        request.told = ahead
                        request.events.put(Waiting(ahead))
                self._starting = admitted
                self._warm_next()
                if admitted is None and not self._active:  # the first waits for its warm-up: nothing to step
                    self._cond.wait(WAIT_REPEAT_S)
                    continue
            if admitted is not None:
                try:
                    self._profiled(self._start, admitted)
                finally:
                    with self._cond:
                        self._starting = None
            elif self._active:
                self._profiled(self._step)

    def _warm_next(self) -> None:
        """Start warming the first waiting turn not yet warmed among those the batch could take next, unless one
        is being warmed (under the lock). Where no turn runs or starts, the first is left to start at once (its
        preparation reads what a warm-up would)."""
        if self._warming is not None:
            return
        idle = not self._active and self._alone is None and self._starting is None
        room = max(1, self.max_batch - len(self._active))
        for request in list(self._waiting)[1 if idle else 0:room]:
            if request.warm is None or request.warming or request.gone.is_set():
                continue
            try:
                work = request.warm()
            except Exception:  # noqa: BLE001 - raised again by the turn's prepare(), in its turn
                work = None
            if work is None:
                request.warming = "done"
                continue
            request.warming = "running"
            self._warming = threading.Thread(target=self._warm, args=(request, work), name="squeeze-warm", daemon=True)
            self._warming.start()
            return

    def _warm(self, request: Request, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception:  # noqa: BLE001 - raised again by the turn's prepare(), in its turn
            pass
        finally:
            with self._cond:
                request.warming = "done"
                self._warming = None
                self._cond.notify_all()

    def _profiled(self, work: Callable, *args) -> None:
        """work(*args), under `profiler` where one is set (it profiles the thread that enables it: this one), and
        timed into `timeline` where one is set."""
        timeline, turns, t0 = self.timeline, len(self._active), time.perf_counter()
        profiler = self.profiler
        if profiler is not None:
            profiler.enable()
        try:
            work(*args)
        finally:
            if profiler is not None:
                profiler.disable()
            if timeline is not None:
                timeline.append(("step" if work == self._step else "start", turns, t0, time.perf_counter() - t0))

    def _admit(self) -> Request | None:
        """The first waiting request, taken from the queue, if it may start now (under the lock)."""
        if not self._waiting or len(self._active) >= self.max_batch:
            return None
        self._warm_next()  # (a turn with nothing to warm is done with it at once)
        first = self._waiting[0]
        if first.warming == "running":  # read once, by its warm-up (the turns under way step meanwhile)
            return None
        if self._active:
            if first.warm is not None and first.warming != "done":  # its warm-up first (_warm_next begins it)
                return None
            if not first.joinable():
                return None
            same = [r for r in self._active if r.context_id == first.context_id]
            if same:  # over one context, turns read its K/V in one order
                layout = same[0].session.layout_key  # (the method is built: joinable)
                if layout(first.method) != layout(same[0].method):
                    return None
        return self._waiting.popleft()

    def _start(self, request: Request) -> None:
        """Open the request's turn and take its first token; with max_batch 1, run it whole."""
        try:
            request.session = request.prepare()
            request.turn = request.make(request.session, any(r.context_id == request.context_id
                                                                 for r in self._active))
            request.turn.count_from(request.asked)
            if self.max_batch == 1:
                with self._cond:
                    self._alone = request
                try:
                    for event in request.session.run(request.turn, stop=request.gone):
                        request.events.put(event)
                finally:
                    with self._cond:
                        self._alone = None
                request.events.put(None)
                self._leave(request)
                return
            if self._batch is None:
                self._batch = TurnBatch(self._lm())
            piece = self._batch.join(request.turn)
        except BaseException as exc:  # noqa: BLE001 - raised by the turn's reader
            self._fail(request, exc)
            return
        if piece is not None:
            request.events.put(piece)
        if request.turn.done:
            self._finish(request)
        else:
            with self._cond:
                self._active.append(request)

    def _step(self) -> None:
        """One step of every turn under way; turns that ended or whose reader left go."""
        for request in [r for r in self._active if r.gone.is_set()]:
            self._batch.leave(request.turn)
            request.turn.step.cache.reset_dynamic()
            self._leave(request)
            request.events.put(None)
        if not self._active:
            return
        by_turn = {id(r.turn): r for r in self._active}
        try:
            results = self._batch.step()
        except BaseException as exc:  # noqa: BLE001 - every turn of the step failed with it
            for request in list(self._active):
                self._batch.leave(request.turn)
                self._fail(request, exc)
            return
        for turn, piece in results:
            request = by_turn[id(turn)]
            if piece is not None:
                request.events.put(piece)
            if turn.done:
                self._finish(request)

    def _finish(self, request: Request) -> None:
        try:
            piece, answer = request.turn.finish()
        except BaseException as exc:  # noqa: BLE001
            self._fail(request, exc)
            return
        if piece is not None:
            request.events.put(piece)
        request.events.put(answer)
        request.events.put(None)
        self._leave(request)

    def _fail(self, request: Request, exc: BaseException, locked: bool = False) -> None:
        """End a request with `exc` (raised by its reader); locked: the caller holds the lock."""
        if request.turn is not None:
            request.turn.step.cache.reset_dynamic()
        request.events.put(exc)
        request.events.put(None)
        if not locked:
            self._leave(request)

    def _leave(self, request: Request) -> None:
        """A request is done: out of the batch, and its session and turn let go (a context closed meanwhile frees
        its memory once no turn holds it)."""
        with self._cond:
            if request in self._active:
                self._active.remove(request)
            request.session = request.turn = None
