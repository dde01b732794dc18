"""Background ingest: a worker thread per engine (so one job at a time per model), progress by stage, an estimate
of the time left, and recovery of the jobs a previous process left unfinished.

The request thread only hands over the uploaded bytes (`submit_bytes`) or a stored document with new index
settings (`submit_document`); extraction, tokenizing, prefill, clustering, calibration and saving all run on the
worker. Progress lives in memory (for the estimate) and, through `Engine.ingest`, in the store's jobs table.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import IndexSettings
from engine.prompt import DocumentTooLongError
from engine.service import Engine, settings_from_dict
from storage import DocumentError, load_document_bytes
from storage.documents import DOC_ID_CHARS
from storage.store import INTERRUPTED

LOADING = "loading model"
# Stages of one ingest, with the share of its time each takes before any job has been timed on this machine
# (measured on 2 CPU cores with the embedded model, ~4K tokens); learned again from every finished job.
DEFAULT_STAGE_SHARE = {
    "extracting": 0.01,
    "tokenizing": 0.01,
    "prefill": 0.55,
    "clustering": 0.35,
    "calibrating": 0.04,
    "saving": 0.04,
}
STAGES = tuple(DEFAULT_STAGE_SHARE)
LEARN_RATE = 0.5  # weight of the newest finished job in the learned stage shares and seconds per token
MIN_FRACTION_FOR_ETA = 0.03  # below this, elapsed / fraction is too noisy to extrapolate
CHARS_PER_TOKEN = 4.0  # rough guess for a job whose document is not tokenized yet
KEEP_FINISHED = 100  # finished jobs kept in memory for the UI


@dataclass(eq=False)  # compared by identity
class IngestJob:
    """One document being prepared, as the UI sees it (times from the worker's clock, in seconds).

    status: "queued" | "running" | "done" | "failed"
    stage: LOADING, one of STAGES, or "queued"/"ready"/"failed"; done/total count the stage's units
    error_kind: "document" (the file cannot be read), "too_long", or "internal"; error is one plain line
    """

    key: str
    name: str
    doc_id: str
    settings: IndexSettings
    truncate: bool
    submitted_at: float
    status: str = "queued"
    stage: str = "queued"
    done: int = 0
    total: int = 0
    context_id: str | None = None
    chars: int | None = None
    tokens: int | None = None
    pages: int | None = None
    cached: bool = False
    error: str | None = None
    error_kind: str | None = None
    started_at: float | None = None  # the ingest itself (after the model is loaded)
    finished_at: float | None = None
    stage_started: dict[str, float] = field(default_factory=dict)
    data: bytes | None = field(default=None, repr=False)  # the upload, until it is extracted

    @property
    def active(self) -> bool:
        return self.status in ("queued", "running")


@dataclass(frozen=True)
class JobView:
    """A snapshot of a job for display: `fraction` of the whole ingest done, `eta_s` seconds left (None: unknown),
    `position` in the queue (0: running or finished)."""

    key: str
    name: str
    doc_id: str
    context_id: str | None
    status: str
    stage: str
    done: int
    total: int
    fraction: float
    eta_s: float | None
    elapsed_s: float
    position: int
    tokens: int | None
    pages: int | None
    cached: bool
    error: str | None
    error_kind: str | None
    settings: dict

    def to_json(self) -> dict:
        return dict(self.__dict__)


class IngestWorker:
    """Runs `Engine.ingest` jobs one at a time on a daemon thread.

    start=False: jobs wait in the queue until `start()` (tests; a controlled start-up)
    preload: load the model on the worker as soon as it starts, so the first upload or question does not wait
    resume: queue again the contexts that a previous process left pending or interrupted (for this model)
    seconds_per_token: a prior for the time an ingest takes per token, until a job has been timed here
    """

    def __init__(self, engine: Engine, *, start: bool = True, preload: bool = False, resume: bool = False,
                 seconds_per_token: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.engine, self.store, self.clock = engine, engine.store, clock
        self._cv = threading.Condition()
        self._queue: deque[IngestJob] = deque()
        self._jobs: dict[str, IngestJob] = {}
        self._ids = itertools.count(1)
        self._share = dict(DEFAULT_STAGE_SHARE)
        self._seconds_per_token = seconds_per_token
        self._preload = preload
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"ingest-{engine.model_id}", daemon=True)
        if resume:
            self.resume_interrupted()
        if start:
            self.start()

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking jobs; a running ingest finishes (or is left to `recover_interrupted` at the next start)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no job is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while any(j.active for j in self._jobs.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    # ------------------------------------------------------------------ submitting

    def submit_bytes(self, data: bytes, name: str, settings: IndexSettings | None = None,
                     truncate: bool = False) -> IngestJob:
        """Queue an uploaded file. Its document id is known at once (from its bytes); a problem with the file
        shows up as a failed job, not as an exception here."""
        return self._submit(name, document_id(data), settings or IndexSettings(), truncate, data)

    def submit_document(self, doc_id: str, settings: IndexSettings, truncate: bool = True) -> IngestJob:
        """Queue a stored document with (new) index settings, e.g. another centroid ratio.

        truncate=True by default: the document was ingested before, so it either fits or was truncated then.
        """
        doc = self.store.find_document(doc_id)
        return self._submit(doc["name"], doc["id"], settings, truncate, None)

    def _submit(self, name: str, doc_id: str, settings: IndexSettings, truncate: bool, data: bytes | None) -> IngestJob:
        with self._cv:
            for job in self._jobs.values():  # the same work already waiting or running
                if job.active and job.doc_id == doc_id and job.settings == settings:
                    return job
            job = IngestJob(key=f"job{next(self._ids)}", name=name, doc_id=doc_id, settings=settings,
                            truncate=truncate, submitted_at=self.clock(), data=data)
            self._jobs[job.key] = job
            self._queue.append(job)
            self._forget_old()
            self._cv.notify_all()
            return job

    def resume_interrupted(self) -> list[IngestJob]:
        """Queue the contexts of this model left "pending", or failed as interrupted, by an earlier process."""
        jobs = []
        for doc in self.store.list_documents():
            for ctx in self.store.list_contexts(doc["id"]):
                if ctx["model"] != self.engine.model_id:
                    continue
                if ctx["status"] == "pending" or (ctx["status"] == "failed" and ctx["error"] == INTERRUPTED):
                    jobs.append(self.submit_document(doc["id"], settings_from_dict(ctx["settings"])))
        return jobs

    # ------------------------------------------------------------------ reading

    def view(self, key: str) -> JobView:
        with self._cv:
            return self._view(self._jobs[key])

    def views(self, active_only: bool = False) -> list[JobView]:
        """Every job still remembered, oldest first."""
        with self._cv:
            return [self._view(j) for j in self._jobs.values() if j.active or not active_only]

    def latest_for_document(self, doc_id: str, settings: IndexSettings | None = None) -> JobView | None:
        """The newest job of a document (with these settings, when given)."""
        with self._cv:
            for job in reversed(self._jobs.values()):
                if job.doc_id == doc_id and (settings is None or job.settings == settings):
                    return self._view(job)
        return None

    def _view(self, job: IngestJob) -> JobView:
        now = self.clock()
        fraction = self._fraction(job)
        position = list(self._queue).index(job) + 1 if job.status == "queued" and job in self._queue else 0
        return JobView(
            key=job.key, name=job.name, doc_id=job.doc_id, context_id=job.context_id, status=job.status,
            stage=job.stage, done=job.done, total=job.total, fraction=fraction, eta_s=self._eta(job, now),
            elapsed_s=now - job.submitted_at if job.finished_at is None else job.finished_at - job.submitted_at,
            position=position, tokens=job.tokens, pages=job.pages, cached=job.cached, error=job.error,
            error_kind=job.error_kind, settings=job.settings.as_dict(),
        )

    # ------------------------------------------------------------------ the estimate

    def _fraction(self, job: IngestJob) -> float:
        """Share of the ingest done: the finished stages' shares plus the current stage's share times its progress."""
        if job.status == "done":
            return 1.0
        if job.stage not in STAGES:
            return 0.0
        before = sum(self._share[s] for s in STAGES[: STAGES.index(job.stage)])
        within = job.done / job.total if job.total else 0.0
        return min(1.0, before + self._share[job.stage] * within)

    def _estimate_total(self, job: IngestJob) -> float | None:
        """Seconds a whole ingest of this job should take, from the seconds per token learned on this machine."""
        if self._seconds_per_token is None:
            return None
        tokens = job.tokens or (job.chars / CHARS_PER_TOKEN if job.chars else None)
        if tokens is None and job.data is not None:
            tokens = len(job.data) / CHARS_PER_TOKEN
        return None if tokens is None else self._seconds_per_token * tokens

    def _eta(self, job: IngestJob, now: float) -> float | None:
        if not job.active:
            return 0.0 if job.status == "done" else None
        if job.status == "queued":
            ahead = 0.0
            for other in list(self._jobs.values()):
                if other is job:
                    break
                if other.active:
                    left = self._eta(other, now)
                    if left is None:
                        return None
                    ahead += left
            own = self._estimate_total(job)
            return None if own is None else ahead + own
        if job.stage == LOADING or job.started_at is None:
            return None
        fraction = self._fraction(job)
        by_rate = None
        total = self._estimate_total(job)
        if total is not None:
            by_rate = max(0.0, total * (1.0 - fraction))
        if fraction >= MIN_FRACTION_FOR_ETA:
            elapsed = now - job.started_at
            by_progress = elapsed * (1.0 - fraction) / fraction
            if by_rate is None or fraction >= 0.2:
                return max(0.0, by_progress)
        return by_rate

    def _learn(self, job: IngestJob, end: float) -> None:
        """Update the stage shares and the seconds per token from a finished ingest."""
        if job.started_at is None or not job.tokens:
            return
        total = end - job.started_at
        if total <= 0:
            return
        marks = sorted((t, s) for s, t in job.stage_started.items() if s in STAGES)
        spans = {s: (marks[i + 1][0] if i + 1 < len(marks) else end) - t for i, (t, s) in enumerate(marks)}
        if set(spans) == set(STAGES):
            for stage in STAGES:
                self._share[stage] = (1 - LEARN_RATE) * self._share[stage] + LEARN_RATE * spans[stage] / total
            norm = sum(self._share.values())
            self._share = {s: v / norm for s, v in self._share.items()}
        rate = total / job.tokens
        old = self._seconds_per_token
        self._seconds_per_token = rate if old is None else (1 - LEARN_RATE) * old + LEARN_RATE * rate

    # ------------------------------------------------------------------ the worker

    def _run(self) -> None:
        if self._preload:
            try:
                self.engine.lm  # noqa: B018 - loads the model
            except Exception:  # noqa: BLE001 - the first job reports the same error in plain words
                pass
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                job.status, job.stage = "running", "queued"
            self._execute(job)
            with self._cv:
                self._cv.notify_all()

    def _progress(self, job: IngestJob, stage: str, done: int, total: int) -> None:
        with self._cv:
            now = self.clock()
            if stage not in job.stage_started:
                job.stage_started[stage] = now
            if stage in STAGES and job.started_at is None:
                job.started_at = now
            job.stage, job.done, job.total = stage, int(done), int(total)
            if stage == "prefill":
                job.tokens = int(total)

    def _execute(self, job: IngestJob) -> None:
        try:
            if not self.engine.model_loaded:
                self._progress(job, LOADING, 0, 1)
                self.engine.lm  # noqa: B018 - loads the model (minutes the first time: dequantization)
            self._progress(job, "extracting", 0, 1)
            if job.data is not None:
                doc = load_document_bytes(job.data, job.name)
                job.data = None
            else:
                doc = self.store.get_document(job.doc_id)
            job.chars, job.pages = len(doc.text), doc.pages
            doc_id, _ = self.store.add_document(doc)
            job.context_id = self.store.context_for(doc_id, self.engine.model_id, job.settings.as_dict())["id"]
            self._progress(job, "extracting", 1, 1)
            report = self.engine.ingest(doc, job.settings, truncate=job.truncate,
                                        progress=lambda s, d, t: self._progress(job, s, d, t))
            end = self.clock()
            with self._cv:
                job.tokens, job.cached, job.context_id = report.tokens, report.cached, report.context_id
                job.status, job.stage, job.done, job.total, job.finished_at = "done", "ready", 1, 1, end
                if not report.cached:
                    self._learn(job, end)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a plain message next to the document
            with self._cv:
                job.data = None
                job.status, job.stage, job.finished_at = "failed", "failed", self.clock()
                job.error_kind = ("too_long" if isinstance(exc, DocumentTooLongError)
                                  else "document" if isinstance(exc, DocumentError) else "internal")
                job.error = plain_error(exc)

    def _forget_old(self) -> None:
        finished = [k for k, j in self._jobs.items() if not j.active]
        for key in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._jobs[key]


def document_id(data: bytes) -> str:
    """The store's id of a document with these bytes (see storage.Document.doc_id), known before extraction."""
    return hashlib.sha256(data).hexdigest()[:DOC_ID_CHARS]


def plain_error(exc: BaseException) -> str:
    """One line a reader understands: the exception's first line, or its type when it has no message."""
    if isinstance(exc, MemoryError):
        return "the machine ran out of memory while preparing the document"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
