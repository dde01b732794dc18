"""Background ingest: a worker thread per engine (so one job at a time per model), progress by stage, an estimate
of the time left, and recovery of the jobs a previous process left unfinished.

The request thread only hands over the uploaded bytes (`submit_bytes`) or a stored document with new settings or
methods to index (`submit_document`); extraction, tokenizing, prefill, clustering, calibration and saving all run on
the worker.

The store's jobs table (`store.jobs`) is the one record of a job: what it asked for, its status and stage, the
units done, what is known of the document, its error. The worker writes the stages it runs itself (loading the
model, extracting) and the outcome; `Engine.ingest(job=...)` writes the rest of the progress into the same row.
In memory the worker keeps the queue order and the timing behind the estimate (each job's marks on the worker's
clock, the learned stage shares and seconds per token). An upload waiting for extraction is also written to the
cache's UPLOADS folder (named by its document id) until it is extracted or refused, so that a queued upload outlives
a killed server: the next worker (`resume_interrupted`) queues it again, its view marked resumed.
A `JobView` is built from the store's row.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from engine.context.settings import ContextSettings
from engine.serve.service import DEFAULT_METHODS, Engine, Overrides
from engine.text.prompt import DocumentTooLongError
from storage import INTERRUPTED, DocumentError, load_document_bytes
from storage.documents import DOC_ID_CHARS, safe_name
from storage.repositories.documents import SOURCE_KINDS

LOADING = "loading model"
CANCELLED = "cancelled by the user"
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
ACTIVE = ("queued", "running")
LEARN_RATE = 0.5  # weight of the newest finished job in the learned stage shares and seconds per token
MIN_FRACTION_FOR_ETA = 0.03  # below this, elapsed / fraction is too noisy to extrapolate
CHARS_PER_TOKEN = 4.0  # rough guess for a job whose document is not tokenized yet
KEEP_FINISHED = 100  # finished jobs a worker lists (and keeps the timing of)
RATE_JOBS = 10  # the latest finished jobs a new worker takes its first seconds per token from
UPLOADS = "uploads"  # the cache's folder of uploads waiting for extraction (a file per document id)
PAGES_EVERY_S = 0.5  # a PDF's extraction writes its pages read into the job's row at most this often


@dataclass
class _Timing:
    """A job's marks on the worker's clock, in seconds: submitted, the ingest's start (its first stage after the
    model is loaded), each stage's start, finished."""

    submitted: float
    started: float | None = None
    stages: dict[str, float] = field(default_factory=dict)
    finished: float | None = None


@dataclass(frozen=True)
class JobView:
    """A snapshot of a job for display, from its row in the store: `fraction` of the job's work done (of the stages
    it runs: an index rebuild starts at clustering), `eta_s` seconds left (None: unknown), `position` in the queue
    (0: running or finished).

    ahead: the jobs this worker runs before a queued one (the one it is running, if any, and those queued before it)
    after: the name of the job being run, while this one is queued behind it (else None)
    resumed: queued again at this worker's start because the process that had it queued or running was stopped

    status: "queued" | "running" | "done" | "failed"
    stage: LOADING, one of STAGES, or "queued"/"ready"/"failed"; done/total count the stage's units (while the
    model loads: its load's steps, `detail` naming the one under way; engine.model.load.LoadStep)
    error_kind: "document" (the file cannot be read), "too_long", or "internal"; error is one plain line
    """

    id: int
    name: str
    doc_id: str
    context_id: str | None
    status: str
    stage: str
    detail: str | None
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
    methods: tuple[str, ...]
    ahead: int = 0
    after: str | None = None
    resumed: bool = False

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    def to_json(self) -> dict:
        return dict(self.__dict__)


class IngestWorker:
    """Runs `Engine.ingest` jobs one at a time on a daemon thread.

    start=False: jobs wait in the queue until `start()` (tests; a controlled start-up)
    preload: load the model on the worker as soon as it starts, so the first upload or question does not wait
    resume: queue again the contexts that a previous process left pending or interrupted (for this model)
    seconds_per_token: a prior for the time an ingest takes per token, until a job has been timed here

    The worker lists (`views`) the jobs of its model that are active or were created since it started.
    """

    def __init__(self, engine: Engine, *, start: bool = True, preload: bool = False, resume: bool = False,
                 seconds_per_token: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.engine, self.store, self.clock = engine, engine.store, clock
        self._after = self.store.jobs.last_id()  # the jobs before the worker started are history (unless active)
        self._cv = threading.Condition()
        self._queue: deque[int] = deque()  # job ids, next first
        self._current: int | None = None  # the job being run
        self._uploads: dict[int, bytes] = {}  # the uploads, until they are extracted
        self._timing: dict[int, _Timing] = {}
        self._share = dict(DEFAULT_STAGE_SHARE)
        self._seconds_per_token = seconds_per_token if seconds_per_token is not None else self._rate_seen()
        self._preload = preload
        self._preloading = False  # the worker is loading the model before its first job
        self._cancelled: set[int] = set()  # jobs asked to stop (queued or running)
        self._resumed: set[int] = set()  # jobs queued again by `resume_interrupted`
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

    def cancel(self, job_id: int) -> bool:
        """Stop a queued or running job: it ends "cancelled" (its error CANCELLED), its context not ready (asking
        for the document again prepares it anew). A running ingest stops at its next progress report (between
        chunks of its prefill, layers of its clustering, files of its saving); one that is loading the model, when
        the model is loaded. False when the job is not active here."""
        with self._cv:
            if job_id != self._current and job_id not in self._queue:
                return False
            self._cancelled.add(job_id)
            self._cv.notify_all()
            return True

    def _check_cancelled(self, job_id: int) -> None:
        with self._cv:
            if job_id in self._cancelled:
                raise JobCancelled(CANCELLED)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no job of this worker is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._current is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    # ------------------------------------------------------------------ submitting

    def submit_bytes(self, data: bytes, name: str, settings: ContextSettings | None = None,
                     truncate: bool = False, methods: Sequence[str] = DEFAULT_METHODS) -> JobView:
        """Queue an uploaded file. Its document id is known at once (from its bytes); a problem with the file
        shows up as a failed job, not as an exception here."""
        return self._submit(name, document_id(data), settings or ContextSettings(), truncate, data, tuple(methods))

    def submit_document(self, doc_id: str, settings: ContextSettings, truncate: bool = True,
                        methods: Sequence[str] = DEFAULT_METHODS, overrides: Overrides | None = None) -> JobView:
        """Queue a stored document with (new) settings, or methods to index (e.g. with another centroid ratio:
        `overrides`, the requester's settings of some methods, Engine.ingest's).

        truncate=True by default: the document was ingested before, so it either fits or was truncated then.
        """
        doc = self.store.documents.find(doc_id)
        return self._submit(doc["name"], doc["id"], settings, truncate, None, tuple(methods), overrides)

    def _submit(self, name: str, doc_id: str, settings: ContextSettings, truncate: bool, data: bytes | None,
                methods: tuple[str, ...], overrides: Overrides | None = None, resumed: bool = False) -> JobView:
        """Queue a job unless the same work is active already; `resumed`: it carries on an interrupted one."""
        name = safe_name(name)  # a label only (hostile paths, control characters, lone surrogates, any length)
        asked = {n: self.engine.method(n, overrides).settings.as_dict() for n in sorted(overrides or {})}
        with self._cv:
            job_id, created = self.store.jobs.submit(doc_id, name, self.engine.model_id, settings.as_dict(),
                                                     methods=methods, truncate=truncate, method_settings=asked)
            if created:  # else the same work is already waiting or running
                self._timing[job_id] = _Timing(submitted=self.clock())
                if data is not None:
                    self._uploads[job_id] = data
                    self._spool(doc_id, data)
                self._queue.append(job_id)
                if resumed:
                    self._resumed.add(job_id)
                self._forget_old()
                self._cv.notify_all()
            return self._views([self.store.jobs.get(job_id)])[0]

    def _spooled(self, doc_id: str) -> Path | None:
        """Where an upload of document `doc_id` waits for extraction (None for a store in memory)."""
        if self.store.in_memory:
            return None
        return Path(self.store.root) / UPLOADS / doc_id

    def _spool(self, doc_id: str, data: bytes) -> None:
        """Keep an upload on disk until it is extracted (written whole or not at all; a full disk keeps it in
        memory only)."""
        path = self._spooled(doc_id)
        if path is None or path.exists():
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(".part")
            part.write_bytes(data)
            os.replace(part, path)
        except OSError:
            pass

    def _unspool(self, doc_id: str) -> None:
        path = self._spooled(doc_id)
        if path is not None:
            path.unlink(missing_ok=True)

    def resume_interrupted(self) -> list[JobView]:
        """Queue what an earlier process of this model left unfinished: the contexts left "pending", or failed as
        interrupted (with what their last job asked for), and the uploads it had queued but not extracted."""
        jobs = []
        for job in self.store.jobs.list(model=self.engine.model_id):
            path = self._spooled(job["doc_id"])
            if (job["status"] == "failed" and job["error"] == INTERRUPTED and job["context_id"] is None
                    and path is not None and path.is_file()):
                jobs.append(self._submit(job["name"], job["doc_id"], ContextSettings.from_dict(job["settings"]),
                                         job["truncate"], path.read_bytes(), tuple(job["methods"] or DEFAULT_METHODS),
                                         job["method_settings"], resumed=True))
        for doc in self.store.documents.list():
            for ctx in self.store.contexts.list(doc["id"]):
                if ctx["model"] != self.engine.model_id:
                    continue
                if ctx["status"] == "pending" or (ctx["status"] == "failed" and ctx["error"] == INTERRUPTED):
                    last = self.store.jobs.latest(context_id=ctx["id"])
                    truncate, methods, overrides = (True, DEFAULT_METHODS, None) if last is None else (
                        last["truncate"], last["methods"] or DEFAULT_METHODS, last["method_settings"])
                    jobs.append(self._submit(doc["name"], doc["id"], ContextSettings.from_dict(ctx["settings"]),
                                             truncate, None, tuple(methods), overrides, resumed=True))
        return jobs

    # ------------------------------------------------------------------ reading

    def view(self, job_id: int) -> JobView:
        """A job's view (NotFoundError for an unknown id)."""
        return self._views([self.store.jobs.get(job_id)])[0]

    def views(self, active_only: bool = False) -> list[JobView]:
        """The jobs of this model that are active or were created since the worker started, oldest first."""
        rows = self.store.jobs.list(model=self.engine.model_id, after=self._after, limit=KEEP_FINISHED)
        return self._views([r for r in rows if r["status"] in ACTIVE or not active_only])

    def latest_for_document(self, doc_id: str, settings: ContextSettings | None = None) -> JobView | None:
        """The newest job of a document (with these settings, when given) among those `views` lists."""
        row = self.store.jobs.latest(doc_id=doc_id, model=self.engine.model_id, after=self._after,
                                     settings=None if settings is None else settings.as_dict())
        return None if row is None else self._views([row])[0]

    def _views(self, rows: list[dict]) -> list[JobView]:
        with self._cv:
            now = self.clock()
            known = {r["id"]: r for r in rows}
            for job_id in (self._current, *self._queue):  # what the estimate of a queued job adds up
                if job_id is not None and job_id not in known:
                    known[job_id] = self.store.jobs.get(job_id)
            return [self._view(row, known, now) for row in rows]

    def _view(self, row: dict, known: dict[int, dict], now: float) -> JobView:
        queued_here = row["status"] == "queued" and row["id"] in self._queue
        stage = LOADING if queued_here and self._preloading else row["stage"]
        step = self.engine.load_step if stage == LOADING and row["status"] in ACTIVE else None
        position = self._queue.index(row["id"]) + 1 if queued_here else 0
        running = known[self._current] if queued_here and self._current is not None else None
        return JobView(
            id=row["id"], name=row["name"], doc_id=row["doc_id"], context_id=row["context_id"],
            status=row["status"], stage=stage, detail=None if step is None else step.name,
            done=row["done"] if step is None else step.done, total=row["total"] if step is None else step.total,
            fraction=self._fraction(row), eta_s=self._eta(row, known, now), elapsed_s=self._elapsed(row, now),
            position=position, tokens=row["tokens"], pages=row["pages"], cached=row["cached"], error=row["error"],
            error_kind=row["error_kind"], settings=row["settings"], methods=tuple(row["methods"]),
            ahead=max(0, position - 1) + (running is not None), after=running["name"] if running else None,
            resumed=row["id"] in self._resumed,
        )

    @property
    def seconds_per_token(self) -> float | None:
        """What an ingest takes per token on this machine with this model, as learned so far (None: unknown)."""
        with self._cv:
            return self._seconds_per_token

    def _rate_seen(self) -> float | None:
        """The seconds per token of the quickest of the latest ingests of this model that the store recorded (the
        quickest: an earlier job's time may include loading the model), or None when none ran here."""
        rates = []
        for row in self.store.jobs.list(model=self.engine.model_id, limit=RATE_JOBS):
            if row["status"] == "done" and not row["cached"] and row["tokens"] and row["started_at"] \
                    and row["finished_at"]:
                seconds = (_parse(row["finished_at"]) - _parse(row["started_at"])).total_seconds()
                if seconds > 0:
                    rates.append(seconds / row["tokens"])
        return min(rates, default=None)

    # ------------------------------------------------------------------ the estimate (callers hold self._cv)

    def _elapsed(self, row: dict, now: float) -> float:
        timing = self._timing.get(row["id"])
        if timing is not None:
            return (timing.finished if timing.finished is not None else now) - timing.submitted
        end = _parse(row["finished_at"]) if row["finished_at"] else datetime.now(timezone.utc)
        return max(0.0, (end - _parse(row["created_at"])).total_seconds())  # a job of another worker

    def _fraction(self, row: dict) -> float:
        """Share of the job's work done: the finished stages' shares plus the current stage's share times its
        progress, over the stages the job runs (an index rebuild over a stored context starts at clustering: the
        stages it passed without running them count neither as done nor as work)."""
        whole = self._whole_fraction(row)
        skipped = self._skipped_share(row)
        return whole if skipped <= 0 else max(0.0, (whole - skipped) / (1.0 - skipped))

    def _whole_fraction(self, row: dict) -> float:
        """Share of a whole ingest behind the job: every stage before the current one counted as done."""
        if row["status"] == "done":
            return 1.0
        if row["stage"] not in STAGES:
            return 0.0
        before = sum(self._share[s] for s in STAGES[: STAGES.index(row["stage"])])
        within = row["done"] / row["total"] if row["total"] else 0.0
        return min(1.0, before + self._share[row["stage"]] * within)

    def _skipped_share(self, row: dict) -> float:
        """Share of a whole ingest in the stages before the current one that this job never began (on this
        worker's marks; none for another worker's job), below 1."""
        timing = self._timing.get(row["id"])
        if timing is None or row["status"] == "done" or row["stage"] not in STAGES:
            return 0.0
        skipped = sum(self._share[s] for s in STAGES[: STAGES.index(row["stage"])] if s not in timing.stages)
        return min(skipped, 0.99)

    def _estimate_total(self, row: dict) -> float | None:
        """Seconds a whole ingest of this job should take, from the seconds per token learned on this machine."""
        if self._seconds_per_token is None:
            return None
        tokens = row["tokens"] or (row["chars"] / CHARS_PER_TOKEN if row["chars"] else None)
        if tokens is None and row["id"] in self._uploads:
            tokens = len(self._uploads[row["id"]]) / CHARS_PER_TOKEN
        return None if tokens is None else self._seconds_per_token * tokens

    def _eta(self, row: dict, known: dict[int, dict], now: float) -> float | None:
        if row["status"] not in ACTIVE:
            return 0.0 if row["status"] == "done" else None
        if row["status"] == "queued" and row["id"] != self._current:  # (the current job may not be marked running yet)
            if row["id"] not in self._queue:
                return None  # queued by another process: its queue is not known here
            ahead = 0.0
            if self._current is not None:
                left = self._eta(known[self._current], known, now)
                if left is None:
                    return None
                ahead += left
            for other in list(self._queue)[: self._queue.index(row["id"])]:
                own = self._estimate_total(known[other])
                if own is None:
                    return None
                ahead += own
            own = self._estimate_total(row)
            return None if own is None else ahead + own
        timing = self._timing.get(row["id"])
        if row["stage"] == LOADING or timing is None:
            return None  # the model's loading time is not known; nor are another worker's marks
        if timing.started is None:
            return self._estimate_total(row)  # the ingest itself has not begun
        fraction = self._fraction(row)  # of the job's own work: the rate below its elapsed time is of that work
        by_rate = None
        total = self._estimate_total(row)  # a whole ingest's: what is left of it is what is left of the job
        if total is not None:
            by_rate = max(0.0, total * (1.0 - self._whole_fraction(row)))
        if fraction >= MIN_FRACTION_FOR_ETA:
            elapsed = now - timing.started
            by_progress = elapsed * (1.0 - fraction) / fraction
            if by_rate is None or fraction >= 0.2:
                return max(0.0, by_progress)
        return by_rate

    def _learn(self, timing: _Timing, tokens: int, end: float) -> None:
        """Update the stage shares and the seconds per token from a finished ingest."""
        if timing.started is None or not tokens:
            return
        total = end - timing.started
        if total <= 0:
            return
        marks = sorted((t, s) for s, t in timing.stages.items() if s in STAGES)
        spans = {s: (marks[i + 1][0] if i + 1 < len(marks) else end) - t for i, (t, s) in enumerate(marks)}
        if set(spans) == set(STAGES):
            for stage in STAGES:
                self._share[stage] = (1 - LEARN_RATE) * self._share[stage] + LEARN_RATE * spans[stage] / total
            norm = sum(self._share.values())
            self._share = {s: v / norm for s, v in self._share.items()}
        rate = total / tokens
        old = self._seconds_per_token
        self._seconds_per_token = rate if old is None else (1 - LEARN_RATE) * old + LEARN_RATE * rate

    def _forget_old(self) -> None:
        finished = [k for k, t in self._timing.items() if t.finished is not None]
        for key in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._timing[key]

    # ------------------------------------------------------------------ the worker

    def _run(self) -> None:
        if self._preload:
            self._preloading = True  # (the queued jobs say so)
            try:
                self.engine.lm  # noqa: B018 - loads the model
            except Exception:  # noqa: BLE001 - the first job reports the same error in plain words
                pass
            finally:
                self._preloading = False
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job_id = self._current = self._queue.popleft()
            try:
                self._execute(job_id)
            finally:
                with self._cv:
                    self._current = None
                    self._cv.notify_all()

    def _mark(self, job_id: int, stage: str) -> None:
        """Note on the worker's clock when a stage starts (the estimate's timing; the stage itself is in the row)."""
        with self._cv:
            timing = self._timing.setdefault(job_id, _Timing(submitted=self.clock()))
            now = self.clock()
            timing.stages.setdefault(stage, now)
            if stage in STAGES and timing.started is None:
                timing.started = now

    def _stage(self, job_id: int, stage: str, done: int, total: int) -> None:
        """A stage the worker runs itself: recorded in the job's row, and marked (a cancelled job stops here)."""
        self._check_cancelled(job_id)
        self.store.jobs.update(job_id, stage=stage, done=done, total=total)
        self._mark(job_id, stage)

    def _pages(self, job_id: int) -> Callable[[int, int], None]:
        """The extraction's progress (pages read, pages) into the job's row, at most every PAGES_EVERY_S and at the
        last page (a PDF of thousands of pages is no thousand writes); a cancelled job stops at the next page."""
        last = [float("-inf")]

        def told(done: int, total: int) -> None:
            self._check_cancelled(job_id)
            now = time.monotonic()
            if done == total or now - last[0] >= PAGES_EVERY_S:
                last[0] = now
                self._stage(job_id, "extracting", done, total)

        return told

    def _progress(self, job_id: int, stage: str) -> None:
        """The ingest's progress: marked; a cancelled job stops here."""
        self._check_cancelled(job_id)
        self._mark(job_id, stage)

    def _finished(self, job_id: int) -> _Timing:
        with self._cv:
            timing = self._timing.setdefault(job_id, _Timing(submitted=self.clock()))
            timing.finished = self.clock()
            self._uploads.pop(job_id, None)
            return timing

    def _execute(self, job_id: int) -> None:
        job = self.store.jobs.start(job_id)
        created = False  # whether this job stored the document (a refused one is not kept)
        try:
            settings = ContextSettings.from_dict(job["settings"])
            if not self.engine.model_loaded:
                self._stage(job_id, LOADING, 0, 1)
                self.engine.lm  # noqa: B018 - loads the model (minutes the first time: dequantization)
            self._stage(job_id, "extracting", 0, 1)
            with self._cv:
                data = self._uploads.get(job_id)
            try:
                doc = (load_document_bytes(data, job["name"], progress=self._pages(job_id)) if data is not None
                       else self.store.documents.get(job["doc_id"]))
                kept = data if data is not None and doc.kind in SOURCE_KINDS else None  # a PDF's file, to open
                doc_id, created = self.store.documents.add(doc, source=kept)
            except DocumentError:
                self._unspool(job["doc_id"])  # refused: nothing to resume
                raise
            self._unspool(doc_id)  # stored: a restart resumes its context
            context = self.store.contexts.context_for(doc_id, self.engine.model_id, settings.as_dict())
            self.store.jobs.update(job_id, context_id=context["id"], chars=len(doc.text), pages=doc.pages)
            with self._cv:
                self._uploads.pop(job_id, None)  # extracted: the estimate goes by the text's length now
            self._stage(job_id, "extracting", 1, 1)
            report = self.engine.ingest(doc, settings, truncate=job["truncate"], methods=tuple(job["methods"]),
                                        progress=lambda stage, done, total: self._progress(job_id, stage), job=job_id,
                                        overrides=job["method_settings"])
        except JobCancelled:
            self._finished(job_id)
            self.store.jobs.cancel(job_id, CANCELLED)
            self._unspool(job["doc_id"])  # (a no-op once extracted)
            return
        except Exception as exc:  # noqa: BLE001 - every failure becomes a plain message next to the document
            self._finished(job_id)
            self.store.jobs.fail(job_id, plain_error(exc), kind=error_kind(exc))
            if created and isinstance(exc, DocumentTooLongError):  # only its start fits: uploaded again, truncated
                self.store.documents.delete(job["doc_id"], jobs=False)  # (the failed job tells why)
            return
        finally:
            with self._cv:
                self._cancelled.discard(job_id)
        timing = self._finished(job_id)
        self.store.jobs.finish(job_id, context_id=report.context_id, tokens=report.tokens, cached=report.cached)
        if not report.cached:
            with self._cv:
                self._learn(timing, report.tokens, timing.finished)


def document_id(data: bytes) -> str:
    """The store's id of a document with these bytes (see storage.Document.doc_id), known before extraction."""
    return hashlib.sha256(data).hexdigest()[:DOC_ID_CHARS]


class JobCancelled(Exception):
    """A job stopped because its user asked (IngestWorker.cancel)."""


def error_kind(exc: BaseException) -> str:
    """How a failed job is told: "too_long" (offer truncation), "document" (the file cannot be read), "internal"."""
    if isinstance(exc, DocumentTooLongError):
        return "too_long"
    return "document" if isinstance(exc, DocumentError) else "internal"


def disk_full(exc: BaseException | None) -> bool:
    """Whether an error is, or was caused by, a full disk (or quota): an OSError's ENOSPC / EDQUOT, or SQLite's
    SQLITE_FULL (the index database met it first)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
                                               or "database or disk is full" in str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def plain_error(exc: BaseException) -> str:
    """One line a reader understands: the exception's first line, or its type when it has no message."""
    if isinstance(exc, MemoryError):
        return "the machine ran out of memory while preparing the document"
    if disk_full(exc):
        return "the disk is full: free some space, then prepare the document again"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _parse(stamp: str) -> datetime:
    try:
        return datetime.fromisoformat(stamp)
    except ValueError:  # not a time the store wrote
        return datetime.now(timezone.utc)
