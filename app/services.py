"""What the tabs share: the engine, the store, the ingest worker, the inspector, and the questions every tab asks
about a document (which context answers, is it ready, how long is left). One `Services` per app, no globals."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from app.config import AppConfig
from app.render import format_date, stage_text, time_left
from engine.serve import ContextInspector, ContextSettings, Engine, IngestWorker, JobView, Overrides, Preparer, Turns
from storage import NotFoundError, Store

STATUS_CHARS = 60  # a library row's status is cut to this
TOO_LONG_HINT = "tick “Keep the start of long documents” and upload it again to use its first part"


class StopFlags:
    """A stop request per browser session (Gradio's session hash), checked by the streaming answer."""

    def __init__(self) -> None:
        self._flags: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def flag(self, session: str) -> threading.Event:
        with self._lock:
            return self._flags.setdefault(session, threading.Event())

    def stop(self, session: str) -> None:
        self.flag(session).set()


def session_of(request) -> str:
    """A browser session's key: Gradio's session hash of the request ("-" for a handler called without one)."""
    return request.session_hash if request is not None else "-"


class ShownChats:
    """The document and chat each browser session shows, as the handlers that change them record it: an answer
    updates the page only while its session still shows the chat it answers in (it is saved to that chat either
    way). A session nothing recorded shows whatever it asks about. Holds the latest MAX_SESSIONS sessions."""

    MAX_SESSIONS = 10_000

    def __init__(self) -> None:
        self._shown: dict[str, tuple[str | None, int | None]] = {}
        self._lock = threading.Lock()

    def show(self, session: str, doc_id: str | None, chat_id: int | None) -> None:
        with self._lock:
            self._shown.pop(session, None)
            self._shown[session] = (doc_id, chat_id)
            while len(self._shown) > self.MAX_SESSIONS:
                del self._shown[next(iter(self._shown))]

    def shows(self, session: str, doc_id: str | None, chat_id: int | None) -> bool:
        with self._lock:
            return self._shown.get(session, (doc_id, chat_id)) == (doc_id, chat_id)


@dataclass
class Services:
    engine: Engine
    store: Store
    worker: IngestWorker
    inspector: ContextInspector
    config: AppConfig
    stops: StopFlags = field(default_factory=StopFlags)
    cancels: StopFlags = field(default_factory=StopFlags)  # Cancel of what a question waits for, per session
    shown: ShownChats = field(default_factory=ShownChats)  # the document and chat each session shows
    turns: Turns | None = None  # made from the engine when not given
    preparer: Preparer | None = None  # likewise: methods' model-level artifacts learned in the background
    _loader: threading.Thread | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.turns is None:
            self.turns = Turns(self.engine)
        if self.preparer is None:
            self.preparer = Preparer(self.engine, lambda: self.worker.seconds_per_token)

    def load_model(self) -> threading.Thread:
        """The model's load on a background thread (started at the first call; a failed load is reported by what
        needs the model next, in plain words): alive while it loads."""
        if self._loader is None:
            self._loader = threading.Thread(target=self._load, name="load-model", daemon=True)
            self._loader.start()
        return self._loader

    def _load(self) -> None:
        try:
            self.engine.load()
        except Exception:  # noqa: BLE001 - the question that needs the model tells the same error
            pass

    @property
    def model_id(self) -> str:
        return self.engine.model_id


@dataclass(frozen=True)
class DocStatus:
    """Where a document stands for the model and the settings the controls ask for.

    state: "ready" | "preparing" | "failed" | "unknown"
    context_id: the ready context that answers (None while there is none)
    exact: the context has the asked method's index with the settings asked for
    job: the newest job of the document, if the worker knows one
    """

    doc_id: str
    name: str
    state: str
    context_id: str | None
    exact: bool
    job: JobView | None
    message: str


def error_text(view: JobView) -> str:
    """A failed job's error in plain words, with what to do about it where there is something to do."""
    if view.error_kind == "too_long":
        return f"{view.error.split(';')[0]}; {TOO_LONG_HINT}"
    return view.error or "unknown error"


def model_contexts(services: Services, doc_id: str) -> list[dict]:
    return [c for c in services.store.contexts.list(doc_id) if c["model"] == services.model_id]


def doc_status(services: Services, doc_id: str, method: str | None = None,
               overrides: Overrides | None = None) -> DocStatus:
    """Which context answers a question about `doc_id` now, or why none does and how long is left. `exact`: the
    context has `method`'s index with the settings asked for (`overrides`: the user's, else the engine's; without
    it the first question builds it)."""
    try:
        name = services.store.documents.find(doc_id)["name"]
        contexts = model_contexts(services, doc_id)
    except NotFoundError:
        name, contexts = None, []
    again = "open it from the library to prepare it" if name is not None else "upload it again to prepare it"
    job = services.worker.latest_for_document(doc_id)
    if name is None and job is not None:
        name = job.name
    wanted = ContextSettings().as_dict()
    ready = next((c for c in contexts if c["settings"] == wanted and c["status"] == "ready"), None)
    active = job is not None and job.status in ("queued", "running")
    if ready is not None:
        stale = services.engine.stale_methods(ready["id"], [method], overrides) if method else []
        if not stale:
            return DocStatus(doc_id, name, "ready", ready["id"], True, job, "ready")
        indexes = f"the {' and '.join(stale)} index{'es' if len(stale) > 1 else ''}"
        if active:
            return DocStatus(doc_id, name, "ready", ready["id"], False, job,
                             f"building {indexes} in the background "
                             f"({stage_text(job)}, {time_left(job.eta_s, job.stage)})")
        return DocStatus(doc_id, name, "ready", ready["id"], False, job,
                         f"ready; {indexes} {'are' if len(stale) > 1 else 'is'} built at the first question with "
                         f"{method}")
    if active:
        progress = f"{stage_text(job)}, {time_left(job.eta_s, job.stage)}"
        return DocStatus(doc_id, name, "preparing", None, False, job, f"still being prepared: {progress}")
    if job is not None and job.status == "failed":
        return DocStatus(doc_id, name, "failed", None, False, job, f"could not be prepared: {error_text(job)}")
    if job is not None and job.status == "cancelled":
        return DocStatus(doc_id, name, "failed", None, False, job,
                         f"its preparation was cancelled; {again}")
    failed = next((c for c in contexts if c["status"] == "failed"), None)
    if failed is not None:
        return DocStatus(doc_id, name, "failed", None, False, job,
                         f"could not be prepared: {failed['error'] or 'unknown error'}")
    if name is None:
        return DocStatus(doc_id, doc_id, "unknown", None, False, None, "no such document")
    return DocStatus(doc_id, name, "unknown", None, False, job,
                     f"not prepared for this model yet; {again}")


def needs_preparing(services: Services, status: DocStatus) -> bool:
    """Whether opening the document should prepare it: it is in the library (its text stored) and has no context
    for this model, none is being prepared, and none failed for a reason a new attempt would meet again (only a
    cancelled preparation is tried again)."""
    if status.state not in ("unknown", "failed") or status.name is None:
        return False
    if status.state == "failed" and not (status.job is not None and status.job.status == "cancelled"):
        return False
    try:
        services.store.documents.find(status.doc_id)
    except NotFoundError:
        return False
    return True


def library_rows(services: Services) -> list[dict]:
    """The documents of the index (newest first) and the uploads still being extracted, with their status."""
    rows = []
    seen = set()
    jobs = {v.doc_id: v for v in services.worker.views()}  # the newest job per document wins
    for doc in services.store.documents.list():
        seen.add(doc["id"])
        contexts = model_contexts(services, doc["id"])
        ready = next((c for c in contexts if c["status"] == "ready"), None)
        job = jobs.get(doc["id"])
        if job is not None and job.status in ("queued", "running"):
            status = f"preparing {round(100 * job.fraction)}%"
        elif ready is not None:
            status = "ready"
        elif job is not None and job.status in ("failed", "cancelled"):
            status = ended_text(job)
        elif contexts and contexts[0]["status"] == "failed":
            status = f"failed: {contexts[0]['error']}"
        else:
            status = "not prepared"
        tokens = (ready or {}).get("tokens") or doc.get("tokens") or (job.tokens if job else None)
        rows.append({"id": doc["id"], "name": doc["name"], "pages": doc["pages"], "tokens": tokens or "-",
                     "status": status, "added": format_date(doc["added_at"])})
    for job in jobs.values():  # uploads not in the index (yet): being extracted, or unreadable
        if job.doc_id in seen or not (job.status in ("queued", "running") or job.context_id is None):
            continue
        status = ended_text(job) if job.status in ("failed", "cancelled") else \
            f"preparing {round(100 * job.fraction)}%"
        rows.insert(0, {"id": job.doc_id, "name": job.name, "pages": job.pages or "-", "tokens": job.tokens or "-",
                        "status": status, "added": "-"})
    return rows


def ended_text(job: JobView) -> str:
    """A library row's status for a job that ended without a context: failed (why), or cancelled."""
    return "cancelled" if job.status == "cancelled" else f"failed: {error_text(job)}"


def library_table(rows: list[dict]) -> list[list]:
    """Rows for the library table (columns: name, pages, tokens, status, added, id); a long status is cut (the
    whole error is shown with the job)."""
    return [[r["name"], r["pages"], r["tokens"], _cut(r["status"], STATUS_CHARS), r["added"], r["id"]] for r in rows]


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


def doc_choices(rows: list[dict]) -> list[tuple[str, str]]:
    """(label, id) pairs for a document picker; a document that is not ready says so in its label."""
    return [(r["name"] if r["status"] == "ready" else f"{r['name']} ({r['status']})", r["id"]) for r in rows]
