"""The engine as the CLI and the app see it: documents in, cached contexts on disk, answers out."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.budget import CALIBRATION_VERSION
from engine.attention.follow import FollowSettings
from engine.context.ingest import ingest_tokens
from engine.context.plan import check_sparsity, turn_plan
from engine.context.session import Answer, ContextSession, Delta
from engine.context.settings import ContextSettings
from engine.context.warm import warm_load
from engine.index import artifacts as names
from engine.methods import REGISTRY, Method, MethodSettings, Preparation, StepPlan, Tensors, build_order, make_method
from engine.model.catalog import DEFAULT_METHOD, DEFAULT_SPARSITY, GenerationOptions, default_cache_dir
from engine.model.compiled import compile_layers, wants_compile
from engine.model.load import EMBEDDED_MODEL, STEP_DONE, LoadedModel, LoadStep, ModelLoadError, load_model, model_id_for
from engine.serve.scheduler import Request, Scheduler, Waiting, default_batch
from engine.serve.writer import ArtifactWriter
from engine.text.prompt import DocumentTooLongError, Exchange, prompt_format, tokenize_document
from kernels.backend import Backend
from kernels.dispatch import backend_for
from storage import (
    DamagedArtifactError,
    Document,
    MissingArtifactError,
    NotFoundError,
    StorageError,
    Store,
    read_document,
)
from storage.repositories.documents import SOURCE_KINDS

STAGES = ("extracting", "tokenizing", "prefill", "clustering", "calibrating", "saving")
# a load step after the weights: the compiled layers' warm-up, then the default method's kernels (engine.context.warm)
STEP_COMPILE = "compiling the model's layers and the default method's kernels for this GPU (once per process)"
Progress = Callable[[str, int, int], None]
Overrides = Mapping[str, "MethodSettings | dict"]  # a request's settings of some methods (the rest: the engine's)
CHECKPOINT = ":checkpoint"  # a preparation's checkpoint in store.models: under the method's name with this suffix
ORPHAN_MIN_AGE_S = 3600.0  # an unindexed blob file this old is no save in progress: swept when an engine opens
WAIT_POLL_S = 0.5  # how often an ingest waiting for another one of the same context looks again
DEFAULT_METHODS = ("squeeze",)  # built when a document is prepared; the others when first asked for
CONTEXT_HEADROOM = 1 << 30  # bytes an open context needs beside its files: its turns' new tokens, buffers, graphs
WARM_MEMORY_SHARE = 0.5  # a waiting turn's context is read ahead into memory only where it takes at most this share
# of the memory available (Engine.read_ahead)
# `squeeze eval` of the embedded model as shipped (read-only): what `latest_eval` shows until one is recorded
SHIPPED_EVAL = Path(__file__).resolve().parents[1] / "bench" / "results" / "cpu-eval.json"


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



class Engine:
    """Owns the model (loaded on first use), the store, and the open context.

    cache_dir: where the SQLite index and the tensors live; model: None for the embedded Gemma 3 270M;
    methods: each method's default settings (its Settings or a dict of their fields; the others at their
    defaults), fixed for the engine's life. A request may ask for others (`overrides`: method name -> settings, for
    that request only); a method's index of a context is (re)built with the settings a request asks for when it is
    missing or was built with others;
    follow: the follow rows every sparse step adds (engine.attention.follow; None: the defaults);
    load_progress: told each step of the model's load as (step, done, total) (the CLI prints them; the app's jobs
    read `load_step`);
    max_batch: the turns answered together, the rest queued (engine.serve.scheduler; None: default_batch).
    """

    def __init__(self, cache_dir: str | Path | None = None, model: str | None = None, device: str = "auto",
                 backend: str | None = None, lm: LoadedModel | None = None, compile: str | bool = "auto",
                 methods: Overrides | None = None, follow: FollowSettings | None = None,
                 load_progress: Progress | None = None, max_batch: int | None = None):
        self.store = Store(Path(cache_dir) if cache_dir else default_cache_dir())
        self.store.jobs.recover_interrupted()
        self.store.remove_orphan_files(min_age_s=ORPHAN_MIN_AGE_S)  # what killed ingests left
        self.model_name, self.device_name, self.backend_name = model, device, backend
        self.compile = compile  # torch.compile the decoder layers once loaded: "auto", "on", "off" (engine.model.compiled)
        self.compile_seconds: float | None = None  # the load's warm-up (compiled layers, the default method's kernels)
        self.model_id = lm.model_id if lm is not None else model_id_for(model)
        _check_names(methods)
        self.method_settings = {name: make_method(name, (methods or {}).get(name)).settings for name in REGISTRY}
        self.follow = FollowSettings() if follow is None else follow
        self._prepared: dict[tuple, Tensors] = {}  # (method, settings) -> its model-level artifacts, once loaded
        self._stored: set[tuple] = set()  # keys of _prepared seen in the store (a status poll asks once)
        self._lm = lm
        self._lm_lock = threading.Lock()  # the app loads the model from a worker thread and from request threads
        self.load_step: LoadStep | None = None  # while the model loads: the step under way (for progress views)
        self.load_progress = load_progress  # told each step of the model's load, whoever loads it
        self._device_lock = threading.RLock()  # building a method's index and answering share the open context
        self._sessions: OrderedDict[str, ContextSession] = OrderedDict()  # open contexts, least recently used first
        self._open_bytes: dict[str, int] = {}  # open context -> the bytes of its files (context_bytes)
        # contexts read into memory for a waiting turn (read_ahead): context id -> ((name, sha256, bytes) of each
        # artifact, the tensors), oldest first
        self._warmed: OrderedDict[str, tuple[tuple[tuple[str, str, int], ...], dict]] = OrderedDict()
        self._warm_lock = threading.Lock()
        self.max_batch = max_batch  # turns answered together (None: default_batch of the model's device)
        self._scheduler: Scheduler | None = None

    @property
    def lm(self) -> LoadedModel:
        return self._lm if self._lm is not None else self.load()

    def load(self) -> LoadedModel:
        """The model, loaded now if it is not yet (the first time, a minute or more: see engine.model.load.load_model).
        While it loads, `load_step` says where it stands, and `load_progress` is told each step as (step, done,
        total)."""
        if self._lm is None:
            with self._lm_lock:
                if self._lm is None:
                    def report(step: str, done: int, total: int) -> None:
                        self.load_step = LoadStep(step, done, total)
                        if self.load_progress is not None:
                            self.load_progress(step, done, total)

                    steps: list[tuple[str, int, int]] = []

                    def loading(step: str, done: int, total: int) -> None:
                        if step == STEP_DONE:  # the compiled layers' warm-up may come after the weights
                            steps.append((step, done, total))
                        else:
                            report(step, done, total)

                    try:
                        lm = load_model(self.model_name, self.device_name, convert_dir=self.store.root / "models",
                                        progress=loading)
                        total = steps[-1][2] if steps else 0
                        if wants_compile(self.compile, lm):
                            report(STEP_COMPILE, total, total + 1)
                            compile_layers(lm)
                            batch = self.max_batch if self.max_batch is not None else default_batch(lm.device)
                            self.compile_seconds = warm_load(lm, backend_for(lm.device, self.backend_name), batch,
                                                             [self.method(n) for n in DEFAULT_METHODS],
                                                             DEFAULT_SPARSITY)
                            total += 1
                        report(STEP_DONE, total, total)
                        self._lm = lm
                    finally:
                        self.load_step = None
        return self._lm

    @property
    def model_loaded(self) -> bool:
        """Whether the model is in memory (the first `lm` access loads it, which can take a minute)."""
        return self._lm is not None

    @property
    def backend(self) -> Backend:
        return backend_for(self.lm.device, self.backend_name)

    def method(self, name: str, overrides: Overrides | None = None) -> Method:
        """Method `name` with the settings `overrides` asks for it, else this engine's."""
        if name not in self.method_settings:
            raise ValueError(f"unknown method {name!r}; choose one of {', '.join(self.method_settings)}")
        _check_names(overrides)
        return make_method(name, (overrides or {}).get(name, self.method_settings[name]))

    def needs_preparation(self, name: str, overrides: Overrides | None = None) -> list[str]:
        """The methods among `name` and what it requires that learn something per model not made yet (neither
        loaded nor stored), in build order; [] when none."""
        out = []
        for n in build_order([name]):
            method = self.method(n, overrides)
            key = _prepared_key(method)
            if not method.learns_per_model() or key in self._prepared or key in self._stored:
                continue
            if self.store.models.names(self.model_id, n, method.prepare_key()):
                self._stored.add(key)
            else:
                out.append(n)
        return out

    def prepared(self, name: str, progress: Progress | None = None, overrides: Overrides | None = None) -> Tensors:
        """Method `name`'s model-level artifacts (learned once per model: `Method.prepare`), from the store, or made
        now and stored (apart from documents: `store.models`); {} for a method that learns nothing per model.
        overrides: the settings asked for (else the engine's); `prepared_for` takes the method itself.

        Making them (e.g. DuoAttention's gates, minutes) holds the device (nothing else runs the model meanwhile),
        reports each step to `progress` as (f"training {name}: ...", done, total), and keeps a checkpoint in the store
        (method f"{name}{CHECKPOINT}") that a stopped preparation resumes from; it is dropped once the artifacts are
        stored."""
        return self.prepared_for(self.method(name, overrides), progress)

    def prepared_for(self, method: Method, progress: Progress | None = None) -> Tensors:
        """`prepared` of a method with its settings as they are."""
        name = method.name
        if not method.learns_per_model():
            return {}
        settings, key = method.prepare_key(), _prepared_key(method)
        with self._device_lock:
            if key not in self._prepared:
                found = self.store.models.load(self.model_id, name, settings)
                if not found:
                    found = self._prepare(method, settings, progress)
                self._prepared[key] = found
            return self._prepared[key]

    def _prepare(self, method: Method, settings: dict, progress: Progress | None) -> Tensors:
        name, report = method.name, progress or (lambda stage, done, total: None)
        checkpoint = name + CHECKPOINT

        def save(state: Tensors) -> None:
            for artifact, tensor in state.items():
                self.store.models.save(self.model_id, checkpoint, settings, artifact, tensor.detach().cpu())

        preparation = Preparation(progress=lambda done, total, message: report(f"training {name}: {message}", done,
                                                                                total),
                                  load=lambda: self.store.models.load(self.model_id, checkpoint, settings), save=save)
        found = {n: t.detach().cpu() for n, t in method.prepare(self.lm, preparation).items()}
        for artifact, tensor in found.items():
            self.store.models.save(self.model_id, name, settings, artifact, tensor)
        self.store.models.remove(self.model_id, checkpoint, settings)  # other settings' runs keep theirs
        return found

    def build_key(self, name: str, overrides: Overrides | None = None) -> dict:
        """What a build of `name` depends on: its settings and those of the methods it requires, as `overrides` asks
        (else the engine's): the cache key of its index within a context."""
        return {"calibration": CALIBRATION_VERSION,
                **{n: self.method(n, overrides).build_entry() for n in build_order([name])}}

    def stale_methods(self, context_id: str, methods: Sequence[str], overrides: Overrides | None = None) -> list[str]:
        """The sparse methods among `methods` (and what they require), in build order, whose index of the context
        is missing or was built with other settings than those asked for (`overrides`, else the engine's)."""
        out = []
        for name in build_order(methods):
            built = self.store.methods.get(context_id, name)
            if built is None or built["settings"] != self.build_key(name, overrides) or \
                    any(r in out for r in self.method(name).requires):
                out.append(name)
        return out

    def ingest(self, source: str | Path | Document, settings: ContextSettings | None = None, truncate: bool = False,
               progress: Progress | None = None, methods: Sequence[str] = DEFAULT_METHODS,
               job: int | None = None, overrides: Overrides | None = None) -> IngestReport:
        """Cache a document's context (a hit when the same bytes, model and settings were ingested before) with the
        indexes of `methods` (built now if missing, also for a cached context), with the settings `overrides` asks
        for (else the engine's).

        job: a job of the store's (`store.jobs`) to record the progress in; whoever created it finishes it (the
        ingest worker). None: the ingest records its own job, from start to finish, unless the context is cached."""
        settings = settings or ContextSettings()
        report = progress or (lambda stage, done, total: None)
        start = time.perf_counter()
        report("extracting", 0, 1)

        def tracked(stage: str, done: int, total: int) -> None:
            if job is not None:
                self.store.jobs.update(job, stage=stage, done=done, total=total)
            report(stage, done, total)

        doc, data = (source, None) if isinstance(source, Document) else read_document(source)
        kept = data if doc.kind in SOURCE_KINDS else None  # a PDF's file, kept: its pages can be opened
        doc_id, created = self.store.documents.add(doc, source=kept)
        ctx = self.store.contexts.context_for(doc_id, self.model_id, settings.as_dict())
        if job is not None:
            self.store.jobs.update(job, context_id=ctx["id"])
        own = job is None
        while True:
            if ctx["status"] == "running":
                ctx = self._after_other_ingest(ctx, report)
            if ctx["status"] == "ready" and self._files_in_place(ctx["id"]):
                self.ensure_methods(ctx["id"], methods, tracked, overrides)
                return IngestReport(doc_id, ctx["id"], ctx["tokens"], doc.pages, time.perf_counter() - start,
                                    cached=True)
            claimed = self._claim(ctx["id"], job, lambda: self.store.jobs.create(
                doc_id, doc.name, self.model_id, settings.as_dict(), methods=methods, truncate=truncate,
                context_id=ctx["id"]))
            if claimed is not None:
                job = claimed
                break
            ctx = self.store.contexts.get(ctx["id"])  # another process claimed it first: wait for its build
        with self._device_lock:  # a failed or damaged build's files, and any session over them: rebuilt below
            self._sessions.pop(ctx["id"], None)
            self._open_bytes.pop(ctx["id"], None)
            self.store.artifacts.clear(ctx["id"])
        try:
            tracked("tokenizing", 0, 1)
            lm = self.lm
            fixed = tokenize_document(lm.tokenizer, doc.text, lm.max_context, truncate=truncate,
                                      prefix=prompt_format(lm.tokenizer).document_prefix())
            self.store.jobs.update(job, tokens=fixed.ids.numel())
            built = build_order(methods)
            with ArtifactWriter(self.store.artifacts, ctx["id"]) as writer:  # saves each artifact while the rest is made
                writer.put(names.OFFSETS, fixed.offsets)
                out = ingest_tokens(lm, fixed.ids, settings, self.backend, [self.method(n, overrides) for n in built],
                                    tracked, on_artifact=writer.put,
                                    prepared={n: self.prepared(n, tracked, overrides) for n in built})
                writer.close(lambda written, handed: tracked("saving", written, handed))
            for name in built:
                self.store.methods.mark_built(ctx["id"], name, self.build_key(name, overrides))
            self.store.contexts.mark_ready(ctx["id"], out.tokens)
            if own:
                self.store.jobs.finish(job, context_id=ctx["id"], tokens=out.tokens)
        except BaseException as exc:  # noqa: BLE001 - also Ctrl-C: the context must not stay "running"
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.store.contexts.set_status(ctx["id"], "failed", error=reason)
            if own:
                self.store.jobs.fail(job, reason, kind=None)
                if created and isinstance(exc, DocumentTooLongError):  # nothing of it kept: only --truncate fits it
                    self.store.documents.delete(doc_id)
            raise
        return IngestReport(doc_id, ctx["id"], out.tokens, doc.pages, time.perf_counter() - start, cached=False,
                            truncated=fixed.truncated)

    def _claim(self, context_id: str, job: int | None, new_job: Callable[[], int]) -> int | None:
        """Mark the context "running" for this process's build, its job (`job`, or new_job()'s) running here, in
        one transaction (one writer at a time, across processes): unless another live process builds it now (its
        claim came first). Returns the job, or None where another process builds it."""
        with self.store.database.transaction():
            if self.store.contexts.get(context_id)["status"] == "running" and \
                    self.store.jobs.building_elsewhere(context_id) is not None:
                return None
            if job is None:
                job = new_job()
                self.store.jobs.start(job)
            self.store.contexts.set_status(context_id, "running")
        return job

    def _after_other_ingest(self, ctx: dict, progress: Progress) -> dict:
        """A context that another process is building now: wait for that ingest (telling its stage every
        WAIT_POLL_S) instead of doing the same work beside it. Returns the context as it left it: ready (a hit), or
        failed or interrupted (built here)."""
        while ctx["status"] == "running":
            other = self.store.jobs.building_elsewhere(ctx["id"])
            if other is None:  # no live process builds it: a killed one's job is failed now, and this one builds it
                self.store.jobs.recover_interrupted()
                return self.store.contexts.get(ctx["id"])
            progress(f"waiting for another ingest of this document ({other['stage'] or 'starting'})",
                     other["done"] or 0, other["total"] or 1)
            time.sleep(WAIT_POLL_S)
            ctx = self.store.contexts.get(ctx["id"])
        return ctx

    def _files_in_place(self, context_id: str) -> bool:
        """Whether a ready context's files are all there with their sizes (a damaged one is marked failed: its
        ingest builds it again)."""
        try:
            self.store.artifacts.check_files(context_id)
        except (MissingArtifactError, DamagedArtifactError):
            return False
        return True

    def ensure_methods(self, context_id: str, methods: Sequence[str], progress: Progress | None = None,
                       overrides: Overrides | None = None) -> list[str]:
        """Build the indexes of `methods` that the context lacks (or has with other settings than `overrides` asks
        for, else the engine's) from its stored K/V, save them and open them in the session. Returns the methods
        built (in build order). On a cache that is read-only here, a missing index is refused in words (StorageError)
        before anything is built."""
        with self._device_lock:
            todo = self.stale_methods(context_id, methods, overrides)
            if not todo:
                return []
            if self.store.database.read_only:
                raise self._read_only_refusal(context_id, todo, overrides)
            session = self.session(context_id)
            for name in todo:
                self.store.methods.remove(context_id, name)
                method = self.method(name, overrides)
                for artifact, tensor in session.build(method, progress, self.prepared_for(method, progress)).items():
                    self.store.artifacts.save(context_id, artifact, tensor.cpu())
                self.store.methods.mark_built(context_id, name, self.build_key(name, overrides))
            return todo

    def _read_only_refusal(self, context_id: str, todo: Sequence[str], overrides: Overrides | None) -> StorageError:
        """Why a question that needs indexes built cannot be answered from a read-only cache, and what can."""
        built = [b["method"] for b in self.store.methods.list(context_id)]
        held = [m for m in built if m in REGISTRY and m not in self.stale_methods(context_id, [m], overrides)]
        has = f" ({', '.join(held)} {'has' if len(held) == 1 else 'have'} one)" if held else ""
        return StorageError(f"the cache at {self.store.root} is read-only here and has no {' or '.join(todo)} index "
                            f"of this document with these settings{has}; building it needs write access")

    def resolve(self, doc_or_path: str, truncate: bool = False, progress: Progress | None = None,
                settings: ContextSettings | None = None) -> str:
        """A context id for a cached document id (or prefix, or file name) or a path (ingested if new).

        settings: the index settings the context must have (a cached document is ingested again with them if it has
        no such context); None: a path gets the defaults, a cached document any ready context of this model."""
        if Path(doc_or_path).is_file():
            return self.ingest(doc_or_path, settings, truncate=truncate, progress=progress).context_id
        doc = self.store.documents.find(doc_or_path)
        if settings is not None:
            return self.ingest(self.store.documents.get(doc["id"]), settings, truncate=truncate,
                               progress=progress).context_id
        for ctx in self.store.contexts.list(doc["id"]):
            if ctx["model"] == self.model_id and ctx["status"] == "ready":
                return ctx["id"]
        raise ValueError(f"document {doc['id']} has no ready context for model {self.model_id}; ingest it first")

    def built_methods(self, context_id: str) -> dict[str, Method]:
        """The methods whose index the context has, each with the settings it was built with (a build of an older
        calibration, or of settings this code no longer reads, is left out: the next request rebuilds it)."""
        out = {}
        for build in self.store.methods.list(context_id):
            name, stored = build["method"], build["settings"]
            if name not in REGISTRY or not isinstance(stored, dict):
                continue
            try:
                overrides = {n: Method.built_settings(stored[n]) for n in build_order([name])}
                if self.build_key(name, overrides) == stored:
                    out[name] = self.method(name, overrides)
            except (KeyError, TypeError, ValueError):
                continue
        return out

    def session(self, context_id: str) -> ContextSession:
        """The context on the model's device, with every method built for it, each with the settings it was built
        with (ensure_methods builds the others). Contexts stay open, up to the scheduler's batch of them (one before
        a turn is asked); opening another first closes the least recently used one that no turn reads now."""
        with self._device_lock:
            session = self._sessions.get(context_id)
            if session is None:
                ctx = self.store.contexts.get(context_id)
                current = self.built_methods(context_id)
                wanted = self._session_artifacts(context_id, current)
                size = sum(row[2] for row in wanted)
                self._make_room(size)  # free the contexts to close before loading the next
                with self._warm_lock:
                    warmed = self._warmed.pop(context_id, None)
                artifacts = warmed[1] if warmed is not None and warmed[0] == wanted else \
                    self.store.artifacts.load(context_id, [row[0] for row in wanted])
                session = ContextSession(self.lm, artifacts, ContextSettings.from_dict(ctx["settings"]), self.backend,
                                         methods=current, prepared={n: self.prepared_for(m) for n, m in current.items()},
                                         follow=self.follow)
                self._sessions[context_id] = session
                self._open_bytes[context_id] = size
            self._sessions.move_to_end(context_id)
            return session

    def _session_artifacts(self, context_id: str, current: dict) -> tuple[tuple[str, str, int], ...]:
        """The artifacts a session of the context reads, as (name, sha256, bytes): the context's own and its built
        methods' (`current`)."""
        return tuple((r["name"], r["sha256"], int(r["nbytes"])) for r in self.store.artifacts.list(context_id)
                     if names.namespace(r["name"], tuple(REGISTRY)) in (None, *current))

    def read_ahead(self, context_id: str, method: str, overrides: Overrides | None = None
                   ) -> Callable[[], None] | None:
        """For a turn that waits to open `context_id`: the work that reads the context's files into memory (each
        checked against its checksum), to be run on any thread (neither the model nor the device touched), so that
        `session` only copies them to the device; None where there is nothing to read ahead: the context open or
        already read, its method's index to build first (that needs the model: the turn's own preparation does it),
        or files that would take more than WARM_MEMORY_SHARE of the memory available. At most the scheduler's batch
        of contexts is held (the oldest let go first); `session` takes its context's."""
        if context_id in self._sessions or self.stale_methods(context_id, [method], overrides):
            return None
        wanted = self._session_artifacts(context_id, self.built_methods(context_id))
        available = available_memory()
        if available is not None and sum(row[2] for row in wanted) > WARM_MEMORY_SHARE * available:
            return None
        with self._warm_lock:
            held = self._warmed.get(context_id)
            if held is not None and held[0] == wanted:
                return None

        def read() -> None:
            artifacts = self.store.artifacts.load(context_id, [row[0] for row in wanted])
            with self._warm_lock:
                if context_id in self._sessions:  # opened meanwhile (by another path): nothing to hand over
                    return
                self._warmed[context_id] = (wanted, artifacts)
                while len(self._warmed) > self._open_limit():
                    self._warmed.popitem(last=False)

        return read

    def _open_limit(self) -> int:
        return self._scheduler.max_batch if self._scheduler is not None else 1

    def _idle_sessions(self) -> list[str]:
        """The open contexts that no turn under way reads, least recently used first."""
        busy = self._scheduler.contexts_in_use() if self._scheduler is not None else set()
        return [c for c in list(self._sessions) if c not in busy]

    def free_bytes(self) -> int | None:
        """Bytes the model's device could still give another context (None: not known, or no model loaded): on a GPU
        the driver's free memory and what torch's allocator holds unused, on the CPU the memory available."""
        if self._lm is None:
            return None
        device = self._lm.device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return available_memory()

    def context_bytes(self, context_id: str) -> int:
        """The bytes of the files a session of `context_id` holds on the device (its K/V, its methods' indexes)."""
        return sum(row[2] for row in self._session_artifacts(context_id, self.built_methods(context_id)))

    def _fits(self, size: int, closable: list[str]) -> bool:
        """Whether a context of `size` bytes (context_bytes) fits the device's memory (CONTEXT_HEADROOM beside it) once
        `closable` are closed."""
        free = self.free_bytes()
        if free is None:
            return True
        freed = sum(self._open_bytes.get(c, 0) for c in closable)
        return size + CONTEXT_HEADROOM <= free + freed

    def _make_room(self, size: int) -> None:
        """Close idle contexts, least recently used first, until one more of `size` bytes fits under the limit and
        in the device's memory (a context a turn reads stays open)."""
        idle = self._idle_sessions()
        while idle and (len(self._sessions) >= self._open_limit() or not self._fits(size, [])):
            closed = idle.pop(0)
            self._sessions.pop(closed, None)
            self._open_bytes.pop(closed, None)

    def can_open(self, context_id: str) -> bool:
        """Whether a turn over `context_id` can start now without closing a context that a turn reads: under the
        limit of open contexts, and in the device's memory beside the contexts turns read (contexts open on a
        GPU with the turns under way and one more that does not fit: the turn waits for their end)."""
        if context_id in self._sessions:
            return True
        idle = self._idle_sessions()
        return ((len(self._sessions) < self._open_limit() or bool(idle))
                and self._fits(self.context_bytes(context_id), idle))

    def _forget(self, context_ids) -> None:
        """Close these contexts (their files change or go); turns under way keep what they read."""
        with self._device_lock:
            for context_id in context_ids:
                self._sessions.pop(context_id, None)
                self._open_bytes.pop(context_id, None)
                with self._warm_lock:
                    self._warmed.pop(context_id, None)

    def plan(self, context_id: str, method: str, sparsity: float = DEFAULT_SPARSITY,
             overrides: Overrides | None = None) -> StepPlan | None:
        """The plan a turn of `method` at `sparsity` runs on the context (engine.context.plan.turn_plan, as the
        session calls it), from the stored calibration: no model loads. None while the method is not built with the
        settings asked for (`overrides`, else the engine's): its first turn builds it."""
        planned = self.plan_and_floor(context_id, method, sparsity, overrides)
        return None if planned is None else planned[0]

    def plan_and_floor(self, context_id: str, method: str, sparsity: float = DEFAULT_SPARSITY,
                       overrides: Overrides | None = None) -> tuple[StepPlan, float | None] | None:
        """`plan`'s plan and the least KV budget the method's lookups read on the context, in the phase that reads
        more: what they read at the fewest keys a plan keeps (its index and the dense rows, mostly), from the
        stored calibration's measured reads (None without them), both from one read of it; None as `plan`."""
        if self.stale_methods(context_id, [method], overrides):
            return None
        built = self.method(method, overrides)
        ctx = self.store.contexts.get(context_id)
        rows = ContextSettings.from_dict(ctx["settings"]).rows(int(ctx["tokens"]))
        calibration = self._calibration(context_id, method)
        curves = [calibration[n] for n in ("budget_decode", "budget_prefill") if n in calibration]
        floor = max(float(c[-1]) for c in curves) if curves else None
        return turn_plan(built, calibration, sparsity, self.follow, rows.tokens), floor

    def _calibration(self, context_id: str, method: str) -> dict:
        """The method's stored calibration of the context, by its short names."""
        prefix = names.method_calib_name(method, "")
        wanted = [a["name"] for a in self.store.artifacts.list(context_id) if a["name"].startswith(prefix)]
        return {n[len(prefix):]: t for n, t in self.store.artifacts.load(context_id, wanted).items()}

    @property
    def scheduler(self) -> Scheduler:
        """The turns' scheduler (engine.serve.scheduler): `max_batch` turns together, the model loaded first to
        choose it where it was not given."""
        if self._scheduler is None:
            batch = self.max_batch if self.max_batch is not None else default_batch(self.lm.device)
            with self._device_lock:
                if self._scheduler is None:
                    self._scheduler = Scheduler(batch, lambda: self.lm)
        return self._scheduler

    def stream(self, context_id: str, question: str, method: str = DEFAULT_METHOD, sparsity: float = DEFAULT_SPARSITY,
               max_new_tokens: int = 64, progress: Progress | None = None, history: Sequence[Exchange] = (),
               options: GenerationOptions | None = None, overrides: Overrides | None = None,
               ) -> Iterator[Delta | Answer | Waiting]:
        """Waiting(ahead) while the turn is queued behind others (engine.serve.scheduler), then the answer's pieces,
        then the Answer; the method's index is built first if the context lacks it with the settings asked for
        (`overrides`: this request's, else the engine's). history, options: ContextSession.stream's (the chat's
        earlier exchanges; how tokens are chosen). Closing the stream early ends the turn."""
        check_sparsity(sparsity)

        def prepare() -> ContextSession:
            with self._device_lock:
                self.ensure_methods(context_id, [method], progress, overrides)
                return self.session(context_id)

        def joinable() -> bool:  # (called by the scheduler's thread under its lock: takes no other lock)
            return self.can_open(context_id) and not self.stale_methods(context_id, [method], overrides)

        def make(session: ContextSession, fork: bool):
            return session.turn(question, method, sparsity, max_new_tokens, history, options, fork=fork)

        self.lm  # noqa: B018 - the model loaded first: its load is the engine's, not counted in the turn's wait
        yield from self.scheduler.stream(Request(context_id, method, prepare, joinable, make,
                                                 warm=lambda: self.read_ahead(context_id, method, overrides)))

    def ask(self, context_id: str, question: str, method: str = DEFAULT_METHOD, sparsity: float = DEFAULT_SPARSITY,
            max_new_tokens: int = 64, history: Sequence[Exchange] = (), options: GenerationOptions | None = None,
            overrides: Overrides | None = None) -> Answer:
        for event in self.stream(context_id, question, method, sparsity, max_new_tokens, history=history,
                                 options=options, overrides=overrides):
            if isinstance(event, Answer):
                return event
        raise AssertionError("stream ended without an answer")

    def list_documents(self) -> list[dict]:
        return self.store.documents.list()

    def record_eval(self, doc: dict) -> int:
        """Store a `squeeze eval` document under the model it names (doc["model"]); returns its id."""
        model = doc.get("model") if isinstance(doc, dict) else None
        if not isinstance(model, str) or not model:
            raise ValueError("an evaluation document names its model (\"model\": the model id it ran)")
        return self.store.evals.add(model, doc)

    def latest_eval(self, model: str | None = None) -> dict | None:
        """The newest `squeeze eval` document of `model` (default: this engine's model, known without loading it), or
        None. For the embedded model, the one shipped with the package (SHIPPED_EVAL) until one is recorded."""
        model = model or self.model_id
        found = self.store.evals.latest(model)
        if found is not None or model != _embedded_model_id():
            return found
        try:
            shipped = json.loads(SHIPPED_EVAL.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{SHIPPED_EVAL.name} cannot be read: {exc}") from exc
        return shipped if isinstance(shipped, dict) and shipped.get("model") == model else None

    def delete_document(self, doc_id: str) -> str:
        doc = self.store.documents.find(doc_id)
        self._forget(c["id"] for c in self.store.contexts.list(doc["id"]))
        self.store.documents.delete(doc["id"])
        return doc["id"]

    def hide_document(self, doc_id: str) -> dict:
        """Take a document out of the library, deleting nothing yet (the app's undo window: `unhide_document`
        brings it back, `delete_hidden` deletes it for good). Returns its summary."""
        return self.store.documents.hide(self.store.documents.find(doc_id)["id"])

    def unhide_document(self, doc_id: str) -> dict:
        return self.store.documents.unhide(doc_id)

    def delete_hidden(self, older_than_s: float = 0.0) -> list[str]:
        """Delete for good the documents hidden at least `older_than_s` seconds ago (with their contexts, chats and
        files); returns their ids."""
        gone = []
        for doc_id in self.store.documents.hidden(older_than_s):
            self._forget(c["id"] for c in self.store.contexts.list(doc_id))  # its contexts may be open
            try:
                self.store.documents.delete(doc_id)
            except NotFoundError:  # another page's poll deleted it first
                continue
            gone.append(doc_id)
        return gone


def _check_names(overrides: Overrides | None) -> None:
    """ValueError for a method name that is not registered."""
    unknown = sorted(set(overrides or {}) - set(REGISTRY))
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(REGISTRY)}")


def _prepared_key(method: Method) -> tuple:
    """The key of a method's model-level artifacts in Engine._prepared: its name and the settings they depend on."""
    return method.name, tuple(sorted(method.prepare_key().items()))


def _embedded_model_id() -> str | None:
    """The embedded model's id, or None when its package is not installed."""
    try:
        return model_id_for(EMBEDDED_MODEL)
    except ModelLoadError:
        return None


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux's MemAvailable), or None where it is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
