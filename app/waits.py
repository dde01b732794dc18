"""What a question waits for before its answer, told while it lasts: the model's load, what the method learns once
per model (DuoAttention's gates, Saap's partitions), the build of the method's index of the document (with the
settings this user asked for, e.g. after a change of the centroid ratio). Each look is a `Wait` for the pending
answer's place; Stop ends the wait (the work goes on), Cancel also stops the work at its next step."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from app.render import format_seconds, stage_text, time_left
from app.services import Services, error_text
from engine.serve import ContextSettings, JobView, Overrides, PrepView

MAX_INDEX_ROUNDS = 3  # rebuilds waited for in a row (two users' settings taking turns); then the turn builds it


@dataclass(frozen=True)
class Wait:
    """One look at what a question waits for. kind: "loading" | "training" | "indexing"; text: what, how far and
    the time left; cancellable: Cancel stops that work (else Cancel only stops waiting for it)."""

    kind: str
    text: str
    cancellable: bool


class WaitEnded(Exception):
    """The question was not answered: the user stopped waiting, or the work waited for failed. `text` says which, in
    plain words; `kind` is the notice's (wait | error)."""

    def __init__(self, text: str, kind: str = "wait"):
        super().__init__(text)
        self.text, self.kind = text, kind


@dataclass
class Asked:
    """What the question asks for: the document and its ready context, the method and this user's settings."""

    doc_id: str
    context_id: str
    method: str
    overrides: Overrides


def waits(services: Services, asked: Asked, stop: threading.Event, cancel: threading.Event) -> Iterator[Wait]:
    """Yield what the question still waits for, about every `config.poll_s`, until the turn can start at once.
    Raises WaitEnded when `stop` is set (with `cancel`: the work waited for is cancelled first) or the work fails."""
    yield from _loading(services, stop, cancel)
    yield from _training(services, asked.method, stop, cancel)
    yield from _indexing(services, asked, stop, cancel)


def _pause(services: Services, stop: threading.Event, cancel: threading.Event, cancel_work: Callable[[], object],
           cancelled: str, stopped: str) -> None:
    """One poll's wait (shorter when the user stops waiting): WaitEnded(`stopped`) after Stop,
    WaitEnded(`cancelled`) after Cancel, which first calls `cancel_work`."""
    if not stop.wait(services.config.poll_s):
        return
    if cancel.is_set():
        cancel_work()
        raise WaitEnded(cancelled)
    raise WaitEnded(stopped)


def _loading(services: Services, stop: threading.Event, cancel: threading.Event) -> Iterator[Wait]:
    """While the model loads (its first load parses its weights: minutes): which step of the load is under way."""
    if services.engine.model_loaded:
        return
    loader = services.load_model()
    while loader.is_alive() and not services.engine.model_loaded:
        yield Wait("loading", load_text(services), False)
        _pause(services, stop, cancel, lambda: None, "Stopped waiting; the model goes on loading.",
               "Stopped waiting; the model goes on loading.")


def load_text(services: Services) -> str:
    """'Loading the model before its first answer: loading the weights (step 5 of 5).'"""
    step = services.engine.load_step
    where = "starting" if step is None else f"{step.name} (step {min(step.done + 1, step.total)} of {step.total})"
    return f"Loading the model before its first answer: {where}."


def training_text(view: PrepView, method: str) -> str:
    """'Training duo, once per model, before its first answer: <its progress line> (about 14 min left)'."""
    who = view.method if view.method == method else f"{view.method} (what {method} builds on)"
    left = time_left(view.seconds_left) if view.seconds_left is not None or view.done else "estimating the time left"
    return f"Training {who}, once per model, before its first answer: {view.stage} ({left})."


def _training(services: Services, method: str, stop: threading.Event, cancel: threading.Event) -> Iterator[Wait]:
    """While what `method` learns per model is trained (started here if need be), then while another method's
    training holds the model."""
    preparer = services.preparer
    view = preparer.start(method)
    while view is not None and view.state == "running":
        yield Wait("training", training_text(view, method), True)
        _pause(services, stop, cancel, lambda: preparer.cancel(method),
               f"Cancelled: the training of {view.method} stops at its next step; asking with {method} again goes on "
               "from its last checkpoint.",
               f"Stopped waiting; {view.method} goes on training in the background.")
        view = preparer.view(method)
        if view is not None and view.state == "failed":
            view = preparer.start(method) or view  # told here: the next start tries again
    if view is not None and view.state == "failed":
        raise WaitEnded(f"{view.method} could not learn what it needs: {view.error}; ask again to retry.", "error")
    if view is not None and view.state == "cancelled":
        raise WaitEnded(f"The training of {view.method} was cancelled; ask with {method} again to go on with it.")
    for other in preparer.running():  # another user's: it holds the model until it ends
        while other is not None and other.state == "running":
            yield Wait("training", f"Waiting for the model: it is busy training {other.method} for another "
                                   f"question: {other.stage} ({time_left(other.seconds_left)}).", False)
            _pause(services, stop, cancel, lambda: None, "Stopped waiting.", "Stopped waiting.")
            other = preparer.view(other.method)


def index_text(method: str, job: JobView) -> str:
    """'Building the squeeze index of this document before the answer: clustering 1/2 layers, about 3 s left'."""
    built = list(job.methods) or [method]
    indexes = f"the {' and '.join(built)} index{'es' if len(built) > 1 else ''}"
    return (f"Building {indexes} of this document (with the settings asked for) before the answer: "
            f"{stage_text(job)}, {time_left(job.eta_s, job.stage)}.")


def _indexing(services: Services, asked: Asked, stop: threading.Event, cancel: threading.Event) -> Iterator[Wait]:
    """While the document's index of the method is (re)built by the worker: the one a slider change started, or one
    handed to it here (when the context lacks the index with the settings asked for). A job of the document under
    way is waited for either way: it holds the model while it builds."""
    engine, worker = services.engine, services.worker
    for _ in range(MAX_INDEX_ROUNDS):
        stale = engine.stale_methods(asked.context_id, [asked.method], asked.overrides)
        job = worker.latest_for_document(asked.doc_id)
        if job is None or not job.active:
            if not stale:
                return
            job = worker.submit_document(asked.doc_id, ContextSettings(), methods=(asked.method,),
                                         overrides=asked.overrides)
        while job.active:
            yield Wait("indexing", index_text(asked.method, job), True)
            _pause(services, stop, cancel, lambda: worker.cancel(job.id),
                   "Cancelled: the index build stops at its next step; the next question with these settings builds "
                   "it again.", "Stopped waiting; the index goes on being built in the background.")
            job = worker.view(job.id)
        if job.status == "failed":
            raise WaitEnded(f"The {asked.method} index could not be built: {error_text(job)}.", "error")
        if job.status == "cancelled":
            raise WaitEnded("The index build was cancelled; ask again to build it.")


def expected_text(seconds: float | None) -> str:
    """'about 17 min on this machine', or 'several minutes on a CPU' before any ingest was timed here."""
    return "several minutes on a CPU" if seconds is None else f"about {format_seconds(seconds)} on this machine"


def queue_text(ahead: int) -> str:
    """What a question queued behind other users' says (engine.serve.Waiting: `ahead` questions before it)."""
    if ahead == 0:
        return "Waiting for the model: yours is next (other users' questions fill it now)."
    return f"Waiting for the model: {ahead} question{'s' * (ahead != 1)} ahead of yours."
