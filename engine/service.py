"""The engine as the CLI and the app see it: documents in, cached contexts on disk, answers out."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from engine.compiled import compile_layers
from engine.config import IndexSettings
from engine.ingest import ingest_tokens
from engine.model import LoadedModel, load_model, model_id_for
from engine.prompt import tokenize_document
from engine.session import Answer, ContextSession, Delta
from engine.writer import ArtifactWriter
from kernels.backend import Backend
from kernels.dispatch import backend_for
from storage import Document, Store, load_document

STAGES = ("extracting", "tokenizing", "prefill", "clustering", "calibrating", "saving")
Progress = Callable[[str, int, int], None]


def default_cache_dir() -> Path:
    return Path(os.environ.get("SQUEEZE_CACHE_DIR") or Path.home() / ".cache" / "squeeze")


@dataclass
class IngestReport:
    """The public result of an ingest (the CLI prints it as JSON)."""

    doc_id: str
    context_id: str
    tokens: int
    pages: int
    seconds: float
    cached: bool
    truncated: bool = False

    def to_json(self) -> dict:
        return {"doc_id": self.doc_id, "context_id": self.context_id, "tokens": self.tokens, "pages": self.pages,
                "seconds": round(self.seconds, 3), "cached": self.cached, "truncated": self.truncated}


def settings_from_dict(data: dict) -> IndexSettings:
    names = {f.name for f in fields(IndexSettings)}
    return IndexSettings(**{k: v for k, v in data.items() if k in names})


class Engine:
    """Owns the model (loaded on first use), the store, and the open context.

    cache_dir: where the SQLite index and the tensors live; model: None for the embedded Gemma 3 270M.
    """

    def __init__(self, cache_dir: str | Path | None = None, model: str | None = None, device: str = "auto",
                 backend: str | None = None, lm: LoadedModel | None = None, compile: bool = False):
        self.store = Store(Path(cache_dir) if cache_dir else default_cache_dir())
        self.store.recover_interrupted()
        self.model_name, self.device_name, self.backend_name = model, device, backend
        self.compile = compile  # torch.compile the decoder layers once loaded (engine.compiled)
        self.model_id = lm.model_id if lm is not None else model_id_for(model)
        self._lm = lm
        self._lm_lock = threading.Lock()  # the app loads the model from a worker thread and from request threads
        self._session: tuple[str, ContextSession] | None = None

    @property
    def lm(self) -> LoadedModel:
        if self._lm is None:
            with self._lm_lock:
                if self._lm is None:
                    lm = load_model(self.model_name, self.device_name, convert_dir=self.store.root / "models")
                    if self.compile:
                        compile_layers(lm)
                    self._lm = lm
        return self._lm

    @property
    def model_loaded(self) -> bool:
        """Whether the model is in memory (the first `lm` access loads it, which can take a minute)."""
        return self._lm is not None

    @property
    def backend(self) -> Backend:
        return backend_for(self.lm.device, self.backend_name)

    def ingest(self, source: str | Path | Document, settings: IndexSettings | None = None, truncate: bool = False,
               progress: Progress | None = None) -> IngestReport:
        """Cache a document's context (a hit when the same bytes, model and settings were ingested before)."""
        settings = settings or IndexSettings()
        report = progress or (lambda stage, done, total: None)
        start = time.perf_counter()
        report("extracting", 0, 1)
        doc = source if isinstance(source, Document) else load_document(source)
        doc_id, _ = self.store.add_document(doc)
        ctx = self.store.context_for(doc_id, self.model_id, settings.as_dict())
        if ctx["status"] == "ready":
            return IngestReport(doc_id, ctx["id"], ctx["tokens"], doc.pages, time.perf_counter() - start, cached=True)
        job = self.store.create_job(ctx["id"])
        self.store.set_context_status(ctx["id"], "running")

        def tracked(stage: str, done: int, total: int) -> None:
            self.store.update_job(job, stage=stage, progress=done / max(total, 1), message=f"{stage} {done}/{total}")
            report(stage, done, total)

        try:
            tracked("tokenizing", 0, 1)
            lm = self.lm
            fixed = tokenize_document(lm.tokenizer, doc.text, lm.max_context, truncate=truncate)
            with ArtifactWriter(self.store, ctx["id"]) as writer:  # saves each artifact while the rest is made
                writer.put("offsets", fixed.offsets)
                out = ingest_tokens(lm, fixed.ids, settings, self.backend, tracked, on_artifact=writer.put)
                writer.close(lambda written, handed: tracked("saving", written, handed))
            self.store.mark_ready(ctx["id"], out.tokens)
            self.store.update_job(job, status="done", progress=1.0, message="ready")
        except BaseException as exc:  # noqa: BLE001 - also Ctrl-C: the context must not stay "running"
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.store.set_context_status(ctx["id"], "failed", error=reason)
            self.store.update_job(job, status="failed", error=reason)
            raise
        return IngestReport(doc_id, ctx["id"], out.tokens, doc.pages, time.perf_counter() - start, cached=False,
                            truncated=fixed.truncated)

    def resolve(self, doc_or_path: str, truncate: bool = False, progress: Progress | None = None,
                settings: IndexSettings | None = None) -> str:
        """A context id for a cached document id (or prefix, or file name) or a path (ingested if new).

        settings: the index settings the context must have (a cached document is ingested again with them if it has
        no such context); None: a path gets the defaults, a cached document any ready context of this model."""
        if Path(doc_or_path).is_file():
            return self.ingest(doc_or_path, settings, truncate=truncate, progress=progress).context_id
        doc = self.store.find_document(doc_or_path)
        if settings is not None:
            return self.ingest(self.store.get_document(doc["id"]), settings, truncate=truncate,
                               progress=progress).context_id
        for ctx in self.store.list_contexts(doc["id"]):
            if ctx["model"] == self.model_id and ctx["status"] == "ready":
                return ctx["id"]
        raise ValueError(f"document {doc['id']} has no ready context for model {self.model_id}; ingest it first")

    def session(self, context_id: str) -> ContextSession:
        """The context on the model's device (the last one opened stays open)."""
        if self._session is None or self._session[0] != context_id:
            self._session = None  # free the previous context before loading the next
            ctx = self.store.get_context(context_id)
            artifacts = self.store.load_artifacts(context_id)
            self._session = (context_id, ContextSession(self.lm, artifacts, settings_from_dict(ctx["settings"]), self.backend))
        return self._session[1]

    def stream(self, context_id: str, question: str, method: str = "squeeze", sparsity: float = 0.9,
               max_new_tokens: int = 64) -> Iterator[Delta | Answer]:
        yield from self.session(context_id).stream(question, method, sparsity, max_new_tokens)

    def ask(self, context_id: str, question: str, method: str = "squeeze", sparsity: float = 0.9,
            max_new_tokens: int = 64) -> Answer:
        return self.session(context_id).ask(question, method, sparsity, max_new_tokens)

    def list_documents(self) -> list[dict]:
        return self.store.list_documents()

    def delete_document(self, doc_id: str) -> str:
        doc = self.store.find_document(doc_id)
        self._session = None
        self.store.delete_document(doc["id"])
        return doc["id"]
