"""The store: a SQLite index (through sqlite-utils) plus a directory of tensor blobs.

Layout of ``Store(root)``::

    root/index.db                                   documents, contexts, artifacts, jobs, chats
    root/blobs/<context_id>/<name>.<hex>.safetensors  one tensor per artifact file

Concurrency (Gradio handlers run on worker threads):

* **One writer.**  Every state change runs in :meth:`Store.transaction`, which
  holds a ``threading.RLock`` and a ``BEGIN IMMEDIATE`` transaction on the one
  write connection (opened with ``check_same_thread=False``).  Nested
  ``transaction()`` blocks become savepoints.
* **Readers per thread.**  For a file-backed store each thread reads through its
  own connection; WAL mode lets those reads run while a write is in progress.
  Inside a transaction, reads go through the write connection so they see the
  uncommitted rows.  An in-memory store has a single connection, so its reads
  also take the lock.
* **Files outside the lock.**  A large artifact is written (atomically, see
  :mod:`storage.blobs`) under a fresh name before the lock is taken; only the
  index row is written under it, after the file is in place.  An index row
  therefore never points at a half-written or since-replaced file.

Document text is kept in the ``documents.text`` column (it is small next to the
KV tensors, and this keeps a document and its text in one transaction).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import sqlite3
import tempfile
import threading
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from sqlite_utils import Database
from sqlite_utils.db import NotFoundError as _RowNotFound

from .blobs import file_sha256, read_tensors, write_tensors
from .documents import Document
from .errors import (
    AmbiguousIdError,
    DamagedArtifactError,
    MissingArtifactError,
    NotFoundError,
    StorageError,
)
from .schema import MIGRATIONS, SCHEMA_VERSION, VERSION_TABLE_SQL

INDEX_FILE = "index.db"
BLOB_DIR = "blobs"
ARTIFACT_SUFFIX = ".safetensors"
CONTEXT_ID_CHARS = 16  # a context id is this many leading hex chars of its key
BUSY_TIMEOUT_S = 30.0  # wait this long for another process's write lock
CONTEXT_STATUSES = ("pending", "running", "ready", "failed")
JOB_STATUSES = ("queued", "running", "done", "failed", "cancelled")
ACTIVE_JOB_STATUSES = ("queued", "running")
INTERRUPTED = "interrupted"  # error text of jobs and contexts found dead at start-up
_FILE_TOKEN_BYTES = 6  # random hex in artifact file names: <name>.<12 hex>.safetensors
CHAT_TITLE_CHARS = 80  # an untitled chat is named after its first question, cut to this
_ARTIFACT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_HEX = re.compile(r"[0-9a-f]+")

_DOCUMENT_SUMMARY_SQL = """
WITH best AS (
    SELECT doc_id, id, status, tokens,
           ROW_NUMBER() OVER (
               PARTITION BY doc_id
               ORDER BY status = 'ready' DESC, updated_at DESC, rowid DESC
           ) AS rank
    FROM contexts
)
SELECT d.id, d.name, d.kind, d.pages, d.chars, d.sha256, d.added_at,
       b.id AS context_id, b.status, b.tokens
FROM documents d LEFT JOIN best b ON b.doc_id = d.id AND b.rank = 1
"""


class Store:
    """Documents, prepared contexts and their tensors, ingest jobs, and chats.

    ``Store(root)`` opens (or creates) ``root/index.db`` and ``root/blobs/``.
    ``Store(memory=True)`` or ``Store.memory()`` keeps the index in memory and the
    blobs in a temporary directory that :meth:`close` removes; meant for tests.

    Rows come back as plain dicts with JSON columns decoded.  Missing rows raise
    :class:`NotFoundError`; bad arguments raise ``ValueError``.
    """

    def __init__(self, root: str | Path | None = None, *, memory: bool = False) -> None:
        if memory == (root is not None):
            raise ValueError("give Store a root directory, or memory=True (not both)")
        self.in_memory = memory
        self._lock = threading.RLock()
        self._local = threading.local()  # per thread: reader Database, transaction depth
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False
        self._tmp: tempfile.TemporaryDirectory | None = None
        if memory:
            self._tmp = tempfile.TemporaryDirectory(prefix="squeeze-store-")
            self.root = Path(self._tmp.name)
            conn = self._configure(sqlite3.connect(":memory:", check_same_thread=False))
        else:
            self.root = Path(root)
            self.root.mkdir(parents=True, exist_ok=True)
            conn = self._connect()
        self.blob_dir = self.root / BLOB_DIR
        self.blob_dir.mkdir(exist_ok=True)
        self._db = Database(conn, execute_plugins=False)
        try:
            if not memory:
                self._db.enable_wal()
            self._migrate()
        except BaseException:
            self.close()
            raise

    @classmethod
    def memory(cls) -> Store:
        """An in-memory index with a temporary blob directory (for tests)."""
        return cls(memory=True)

    @property
    def index_path(self) -> Path | None:
        """``root/index.db``, or None for an in-memory store."""
        return None if self.in_memory else self.root / INDEX_FILE

    def __repr__(self) -> str:
        return f"Store({'memory=True' if self.in_memory else str(self.root)!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection (and remove the temporary directory of a memory store)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._db.close()
            with self._readers_lock:
                for conn in self._readers:
                    conn.close()
                self._readers.clear()
            if self._tmp is not None:
                self._tmp.cleanup()

    # ------------------------------------------------------------------ connections

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.root / INDEX_FILE, timeout=BUSY_TIMEOUT_S, check_same_thread=False
        )
        return self._configure(conn)

    @staticmethod
    def _configure(conn: sqlite3.Connection) -> sqlite3.Connection:
        conn.execute("PRAGMA foreign_keys = ON")
        return conn

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"{self!r} is closed")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        """One atomic state change: commits on success, rolls back on any exception.

        Holds the writer lock for its duration; nested blocks are savepoints.
        Yields the sqlite-utils ``Database`` to run statements on.
        """
        with self._lock:
            self._check_open()
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1
            try:
                if depth:
                    with self._db.atomic():
                        yield self._db
                    return
                conn = self._db.conn
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    conn.rollback()
                    raise
                try:
                    conn.commit()
                except BaseException:
                    conn.rollback()
                    raise
            finally:
                self._local.depth = depth

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Database]:
        """A consistent read: this thread's own connection, or the writer's (see module doc)."""
        self._check_open()
        if self.in_memory or getattr(self._local, "depth", 0):
            with self._lock:
                yield self._db
            return
        db = getattr(self._local, "reader", None)
        if db is None:
            conn = self._connect()
            with self._readers_lock:
                self._readers.append(conn)
            db = self._local.reader = Database(conn, execute_plugins=False)
        db.conn.execute("BEGIN")  # one snapshot for all the queries of this call
        try:
            yield db
        finally:
            db.conn.rollback()

    def _migrate(self) -> None:
        """Bring the schema up to :data:`SCHEMA_VERSION`, one transaction per migration."""
        with self.transaction() as db:
            db.execute(VERSION_TABLE_SQL)
        for version, script in MIGRATIONS:
            with self.transaction() as db:
                current = _one(db, "SELECT COALESCE(MAX(version), 0) AS v FROM schema_version")["v"]
                if current > SCHEMA_VERSION:
                    raise StorageError(
                        f"{self.index_path or 'index'} has schema version {current}, newer than"
                        f" this code's {SCHEMA_VERSION}; upgrade the application"
                    )
                if version <= current:
                    continue
                db.executescript(script)
                db.table("schema_version").insert({"version": version, "applied_at": _now()})

    def schema_version(self) -> int:
        """The highest migration applied to this index."""
        with self._reading() as db:
            return _one(db, "SELECT COALESCE(MAX(version), 0) AS v FROM schema_version")["v"]

    # ------------------------------------------------------------------ documents

    def add_document(self, doc: Document) -> tuple[str, bool]:
        """Index ``doc``; returns ``(doc_id, created)``.

        The id comes from the file's sha256, so adding the same bytes again is a
        hit: nothing changes (not even the name) and ``created`` is False.
        """
        doc_id = doc.doc_id
        with self.transaction() as db:
            existing = _first(db, "SELECT sha256 FROM documents WHERE id = ?", [doc_id])
            if existing is not None:
                if existing["sha256"] != doc.sha256:
                    raise StorageError(f"document id {doc_id} collides with a different file")
                return doc_id, False
            db.table("documents").insert(
                {
                    "id": doc_id,
                    "sha256": doc.sha256,
                    "name": doc.name,
                    "kind": doc.kind,
                    "pages": doc.pages,
                    "chars": len(doc.text),
                    "page_starts": json.dumps(list(doc.page_starts)),
                    "text": doc.text,
                    "added_at": _now(),
                }
            )
        return doc_id, True

    def get_document(self, doc_id: str) -> Document:
        """Rebuild the :class:`Document` stored under ``doc_id``."""
        with self._reading() as db:
            row = _require(db, "documents", doc_id, "document")
        return Document(
            name=row["name"],
            kind=row["kind"],
            text=row["text"],
            page_starts=tuple(json.loads(row["page_starts"])),
            sha256=row["sha256"],
        )

    def find_document(self, prefix_or_id: str) -> dict[str, Any]:
        """The summary (as in :meth:`list_documents`) of one document.

        Matches, in order: an id or unique id prefix (hex), then an exact file name.
        Raises :class:`NotFoundError`, or :class:`AmbiguousIdError` when several match.
        """
        key = prefix_or_id.strip()
        matchers = [("d.name = ?", [key])]
        if key and _HEX.fullmatch(key.lower()):  # an exact id is a prefix of itself
            matchers.insert(0, ("substr(d.id, 1, ?) = ?", [len(key), key.lower()]))
        with self._reading() as db:
            for where, args in matchers:
                rows = self._document_summaries(db, where, args)
                if len(rows) == 1:
                    return rows[0]
                if len(rows) > 1:
                    ids = ", ".join(r["id"] for r in rows[:5])
                    raise AmbiguousIdError(
                        f"{key!r} matches {len(rows)} documents ({ids}); be more specific"
                    )
        raise NotFoundError(f"no document matches {key!r}")

    def list_documents(self) -> list[dict[str, Any]]:
        """Every document, newest first, without its text.

        Keys: id, name, kind, pages, chars, sha256, added_at, and for its best
        context (the latest ready one, else the latest of any status; None if
        none): context_id, status, tokens.
        """
        with self._reading() as db:
            return self._document_summaries(db)

    @staticmethod
    def _document_summaries(
        db: Database, where: str | None = None, args: list | None = None
    ) -> list[dict[str, Any]]:
        sql = _DOCUMENT_SUMMARY_SQL + (f" WHERE {where}" if where else "")
        return list(db.query(sql + " ORDER BY d.added_at DESC, d.rowid DESC", args or []))

    def delete_document(self, doc_id: str) -> None:
        """Delete a document, its contexts, artifacts, jobs and chats, then its blob files."""
        with self.transaction() as db:
            _require(db, "documents", doc_id, "document")
            contexts = db.query("SELECT id FROM contexts WHERE doc_id = ?", [doc_id])
            context_ids = [r["id"] for r in contexts]
            paths = [
                r["path"]
                for r in db.query(
                    "SELECT a.path FROM artifacts a JOIN contexts c ON c.id = a.context_id"
                    " WHERE c.doc_id = ?",
                    [doc_id],
                )
            ]
            db.execute("DELETE FROM documents WHERE id = ?", [doc_id])  # cascades to the rest
        # Rows first, files second: a crash in between leaves orphan files, never dangling rows.
        for path in paths:
            (self.root / path).unlink(missing_ok=True)
        for context_id in context_ids:
            shutil.rmtree(self.blob_dir / context_id, ignore_errors=True)

    # ------------------------------------------------------------------ contexts

    @staticmethod
    def context_key(doc_sha256: str, model: str, settings: dict[str, Any]) -> str:
        """sha256 over the document's sha256, the model name and the canonical settings JSON."""
        return hashlib.sha256(_canonical_json([doc_sha256, model, settings]).encode()).hexdigest()

    def context_for(self, doc_id: str, model: str, settings: dict[str, Any]) -> dict[str, Any]:
        """The context for (document, model, settings), created as "pending" if new.

        An existing context is returned whatever its status (a "failed" one is
        for the caller to retry via :meth:`set_context_status`).
        """
        settings_json = _canonical_json(settings)
        with self.transaction() as db:
            doc = _require(db, "documents", doc_id, "document")
            key = self.context_key(doc["sha256"], model, settings)
            row = _first(db, "SELECT * FROM contexts WHERE key = ?", [key])
            if row is None:
                now = _now()
                row = {
                    "id": key[:CONTEXT_ID_CHARS],
                    "doc_id": doc_id,
                    "model": model,
                    "settings": settings_json,
                    "key": key,
                    "status": "pending",
                    "tokens": None,
                    "error": None,
                    "created_at": now,
                    "updated_at": now,
                }
                db.table("contexts").insert(row)
        return _context_dict(row)

    def get_context(self, context_id: str) -> dict[str, Any]:
        """One context row (settings decoded)."""
        with self._reading() as db:
            return _context_dict(_require(db, "contexts", context_id, "context"))

    def list_contexts(self, doc_id: str) -> list[dict[str, Any]]:
        """Every context of a document, most recently updated first."""
        with self._reading() as db:
            rows = db.query(
                "SELECT * FROM contexts WHERE doc_id = ? ORDER BY updated_at DESC, rowid DESC",
                [doc_id],
            )
            return [_context_dict(r) for r in rows]

    def set_context_status(
        self, context_id: str, status: str, *, tokens: int | None = None, error: str | None = None
    ) -> dict[str, Any]:
        """Move a context to ``status``; returns the updated row.

        ``error`` is stored for "failed" and cleared otherwise; ``tokens`` is
        updated when given.  "ready" goes through :meth:`mark_ready` (and its
        checks), so ``tokens`` is required for it.
        """
        if status not in CONTEXT_STATUSES:
            raise ValueError(f"context status must be one of {CONTEXT_STATUSES}, got {status!r}")
        if status == "ready":
            if tokens is None:
                raise ValueError("a ready context needs its token count")
            return self.mark_ready(context_id, tokens)
        updates: dict[str, Any] = {"status": status, "updated_at": _now(),
                                   "error": error if status == "failed" else None}
        if tokens is not None:
            updates["tokens"] = _check_tokens(tokens)
        with self.transaction() as db:
            _require(db, "contexts", context_id, "context")
            db.table("contexts").update(context_id, updates)
            return _context_dict(_require(db, "contexts", context_id, "context"))

    def mark_ready(
        self, context_id: str, tokens: int, *, required: Iterable[str] = ()
    ) -> dict[str, Any]:
        """Mark a context "ready" with its token count; returns the updated row.

        Refuses (:class:`MissingArtifactError`) unless every artifact row's file
        exists with its recorded size and every name in ``required`` has a row;
        a file of the wrong size raises :class:`DamagedArtifactError`.
        """
        tokens = _check_tokens(tokens)
        with self.transaction() as db:
            _require(db, "contexts", context_id, "context")
            artifacts = db.query("SELECT * FROM artifacts WHERE context_id = ?", [context_id])
            rows = {r["name"]: r for r in artifacts}
            for name in required:
                if name not in rows:
                    path = self.blob_dir / context_id / f"{name}.*{ARTIFACT_SUFFIX}"
                    raise MissingArtifactError(path, artifact=f"{context_id}/{name}")
            for row in rows.values():
                self._check_file(context_id, row)
            ready = {"status": "ready", "tokens": tokens, "error": None, "updated_at": _now()}
            db.table("contexts").update(context_id, ready)
            return _context_dict(_require(db, "contexts", context_id, "context"))

    # ------------------------------------------------------------------ artifacts

    def save_artifact(self, context_id: str, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        """Write one tensor to its own file, then upsert its index row; returns the row.

        The file is written atomically before the transaction (so the writer
        lock is not held during a large write); the row is written only once the
        file is in place.  Every save gets a fresh file name
        (``<name>.<random>.safetensors``), so a row never points at a file that a
        concurrent save of the same name replaced; the file of the row being
        replaced is deleted after the commit.  Raises :class:`NotFoundError` if
        the context does not exist (or is deleted meanwhile).
        """
        if not _ARTIFACT_NAME.fullmatch(name):
            raise ValueError(f"artifact name must match {_ARTIFACT_NAME.pattern}, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            kind = type(tensor).__name__
            raise TypeError(f"artifact {name!r} must be a torch.Tensor, got {kind}")
        self.get_context(context_id)  # fail before writing a large file
        rel = PurePosixPath(
            BLOB_DIR, context_id, f"{name}.{secrets.token_hex(_FILE_TOKEN_BYTES)}{ARTIFACT_SUFFIX}"
        )
        info = write_tensors(self.root / rel, {name: tensor})
        row = {
            "context_id": context_id,
            "name": name,
            "path": rel.as_posix(),
            "sha256": info.sha256,
            "shape": json.dumps(list(tensor.shape)),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "nbytes": info.nbytes,
        }
        try:
            with self.transaction() as db:
                _require(db, "contexts", context_id, "context")
                sql = "SELECT path FROM artifacts WHERE context_id = ? AND name = ?"
                old = _first(db, sql, [context_id, name])
                db.table("artifacts").upsert(row, pk=("context_id", "name"))
        except BaseException:
            (self.root / rel).unlink(missing_ok=True)  # not indexed: nothing may point at it
            raise
        if old is not None:
            (self.root / old["path"]).unlink(missing_ok=True)
        return _artifact_dict(row)

    def remove_orphan_files(self) -> int:
        """Delete blob files that no artifact row points to; returns how many.

        Such files are left by a crash between writing a file and indexing it
        (or by a failed temporary write).  Call this only while no ingest is
        running, e.g. at start-up: a file being saved has no row yet.
        """
        with self._reading() as db:
            known = {r["path"] for r in db.query("SELECT path FROM artifacts")}
        removed = 0
        for path in sorted(self.blob_dir.rglob("*"), reverse=True):  # files before their dirs
            if path.is_dir():
                with contextlib.suppress(OSError):
                    path.rmdir()  # only if empty
            elif path.relative_to(self.root).as_posix() not in known:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def list_artifacts(self, context_id: str) -> list[dict[str, Any]]:
        """The artifact rows of a context (shape decoded), by name."""
        with self._reading() as db:
            _require(db, "contexts", context_id, "context")
            sql = "SELECT * FROM artifacts WHERE context_id = ? ORDER BY name"
            rows = db.query(sql, [context_id])
            return [_artifact_dict(r) for r in rows]

    def load_artifacts(
        self,
        context_id: str,
        names: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Load artifacts (all of them, or ``names`` in that order), verifying every sha256.

        Raises :class:`NotFoundError` for a name without a row,
        :class:`MissingArtifactError` for a row without its file and
        :class:`DamagedArtifactError` for a file whose bytes changed; both name
        the artifact as ``<context_id>/<name>``.
        """
        rows = {r["name"]: r for r in self.list_artifacts(context_id)}
        wanted = list(rows) if names is None else list(names)
        unknown = [n for n in wanted if n not in rows]
        if unknown:
            raise NotFoundError(f"context {context_id} has no artifact(s) {', '.join(unknown)}")
        out: dict[str, torch.Tensor] = {}
        for name in wanted:
            row = rows[name]
            label = f"{context_id}/{name}"
            try:
                tensors = read_tensors(self.root / row["path"], row["sha256"], device=device)
            except DamagedArtifactError as exc:
                raise DamagedArtifactError(
                    exc.path, exc.expected, exc.actual, artifact=label
                ) from None
            except MissingArtifactError as exc:
                raise MissingArtifactError(exc.path, artifact=label) from None
            out[name] = tensors[name]
        return out

    def _check_file(self, context_id: str, row: dict[str, Any]) -> None:
        path = self.root / row["path"]
        label = f"{context_id}/{row['name']}"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise MissingArtifactError(path, artifact=label) from None
        if size != row["nbytes"]:
            raise DamagedArtifactError(path, row["sha256"], file_sha256(path), artifact=label)

    # ------------------------------------------------------------------ jobs

    def create_job(self, context_id: str) -> int:
        """A new "queued" job for a context, owned by this process; returns its id."""
        now = _now()
        with self.transaction() as db:
            _require(db, "contexts", context_id, "context")
            table = db.table("jobs").insert(
                {
                    "context_id": context_id,
                    "status": "queued",
                    "progress": 0.0,
                    "pid": os.getpid(),
                    "created_at": now,
                    "updated_at": now,
                }
            )
            return int(table.last_pk)

    def update_job(
        self,
        job_id: int,
        *,
        stage: str | None = None,
        progress: float | None = None,
        message: str | None = None,
        status: str | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        """Change the given fields of a job; returns the updated row.

        Moving to "running" records this process's pid and the start time;
        moving to "done" sets progress to 1 unless given.
        """
        updates: dict[str, Any] = {"updated_at": _now()}
        if status is not None:
            if status not in JOB_STATUSES:
                raise ValueError(f"job status must be one of {JOB_STATUSES}, got {status!r}")
            updates["status"] = status
            if status == "done" and progress is None:
                progress = 1.0
        if progress is not None:
            progress = float(progress)
            if not 0.0 <= progress <= 1.0:
                raise ValueError(f"job progress must be within [0, 1], got {progress}")
            updates["progress"] = progress
        for column, value in (("stage", stage), ("message", message), ("error", error)):
            if value is not None:
                updates[column] = value
        with self.transaction() as db:
            job = _require(db, "jobs", job_id, "job")
            if status == "running":
                updates["pid"] = os.getpid()
                if job["started_at"] is None:
                    updates["started_at"] = updates["updated_at"]
            db.table("jobs").update(job_id, updates)
            return _require(db, "jobs", job_id, "job")

    def get_job(self, job_id: int) -> dict[str, Any]:
        """One job row."""
        with self._reading() as db:
            return _require(db, "jobs", job_id, "job")

    def latest_job(self, context_id: str) -> dict[str, Any] | None:
        """The most recently created job of a context, or None."""
        with self._reading() as db:
            sql = "SELECT * FROM jobs WHERE context_id = ? ORDER BY id DESC LIMIT 1"
            return _first(db, sql, [context_id])

    def recover_interrupted(self, *, all: bool = False) -> int:  # noqa: A002 (name is the contract)
        """Fail jobs that can no longer finish; returns how many.

        A "queued" or "running" job whose pid is not a live process (or every
        such job when ``all=True``, i.e. at start-up of the only process that
        runs jobs) becomes "failed" with error "interrupted", and so does its
        context unless it is ready.  With ``all=True``, contexts left "running"
        without a job are failed too.
        """
        fail_job = "UPDATE jobs SET status = 'failed', error = ?, updated_at = ? WHERE id = ?"
        fail_context = (
            "UPDATE contexts SET status = 'failed', error = ?, updated_at = ?"
            " WHERE id = ? AND status != 'ready'"
        )
        with self.transaction() as db:
            placeholders = ", ".join("?" for _ in ACTIVE_JOB_STATUSES)
            active = db.query(
                f"SELECT id, context_id, pid FROM jobs WHERE status IN ({placeholders})",
                list(ACTIVE_JOB_STATUSES),
            )
            dead = [job for job in active if all or not _pid_alive(job["pid"])]
            now = _now()
            for job in dead:
                db.execute(fail_job, [INTERRUPTED, now, job["id"]])
                db.execute(fail_context, [INTERRUPTED, now, job["context_id"]])
            if all:
                db.execute(
                    "UPDATE contexts SET status = 'failed', error = ?, updated_at = ?"
                    " WHERE status = 'running'",
                    [INTERRUPTED, now],
                )
        return len(dead)

    # ------------------------------------------------------------------ chats

    def create_chat(
        self, doc_id: str, context_id: str | None = None, *, title: str | None = None
    ) -> int:
        """A new chat about a document (answered from ``context_id``); returns its id."""
        with self.transaction() as db:
            _require(db, "documents", doc_id, "document")
            if context_id is not None:
                context = _require(db, "contexts", context_id, "context")
                if context["doc_id"] != doc_id:
                    raise ValueError(
                        f"context {context_id} belongs to document {context['doc_id']},"
                        f" not {doc_id}"
                    )
            table = db.table("chats").insert(
                {"doc_id": doc_id, "context_id": context_id, "created_at": _now(), "title": title}
            )
            return int(table.last_pk)

    def get_chat(self, chat_id: int) -> dict[str, Any]:
        """One chat row."""
        with self._reading() as db:
            return _require(db, "chats", chat_id, "chat")

    def add_turn(
        self,
        chat_id: int,
        question: str,
        answer: str,
        method: str | None,
        sparsity: float | None,
        stats: dict[str, Any],
    ) -> int:
        """Append a question/answer to a chat; returns the turn id.

        ``idx`` counts from 0 within the chat.  An untitled chat takes its first
        question as title.  ``stats`` must be JSON-serialisable (tensor and
        numpy scalars are converted).
        """
        stats_json = _canonical_json(stats, allow_nan=True)  # a NaN metric is still a metric
        with self.transaction() as db:
            chat = _require(db, "chats", chat_id, "chat")
            next_idx = "SELECT COALESCE(MAX(idx), -1) + 1 AS n FROM turns WHERE chat_id = ?"
            idx = _one(db, next_idx, [chat_id])["n"]
            table = db.table("turns").insert(
                {
                    "chat_id": chat_id,
                    "idx": idx,
                    "question": question,
                    "answer": answer,
                    "method": method,
                    "sparsity": None if sparsity is None else float(sparsity),
                    "stats": stats_json,
                    "created_at": _now(),
                }
            )
            if chat["title"] is None:
                title = " ".join(question.split())[:CHAT_TITLE_CHARS]
                db.table("chats").update(chat_id, {"title": title})
            return int(table.last_pk)

    def list_chats(self, doc_id: str) -> list[dict[str, Any]]:
        """The chats of a document, newest first, each with its number of turns."""
        with self._reading() as db:
            return list(
                db.query(
                    "SELECT c.*,"
                    " (SELECT COUNT(*) FROM turns t WHERE t.chat_id = c.id) AS turn_count"
                    " FROM chats c WHERE c.doc_id = ? ORDER BY c.created_at DESC, c.id DESC",
                    [doc_id],
                )
            )

    def get_turns(self, chat_id: int) -> list[dict[str, Any]]:
        """The turns of a chat in order (stats decoded)."""
        with self._reading() as db:
            _require(db, "chats", chat_id, "chat")
            rows = db.query("SELECT * FROM turns WHERE chat_id = ? ORDER BY idx", [chat_id])
            return [{**r, "stats": json.loads(r["stats"])} for r in rows]


# ---------------------------------------------------------------------- helpers


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # torch / numpy scalars and small arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _canonical_json(value: Any, *, allow_nan: bool = False) -> str:
    """Sorted keys, no spaces: equal values give equal strings (and equal context keys)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=allow_nan, default=_json_default)


def _check_tokens(tokens: int) -> int:
    if isinstance(tokens, bool) or int(tokens) != tokens or tokens < 0:
        raise ValueError(f"tokens must be a non-negative integer, got {tokens!r}")
    return int(tokens)


def _first(db: Database, sql: str, args: list | None = None) -> dict[str, Any] | None:
    return next(iter(db.query(sql, args or [])), None)


def _one(db: Database, sql: str, args: list | None = None) -> dict[str, Any]:
    row = _first(db, sql, args)
    assert row is not None, sql
    return row


def _require(db: Database, table: str, pk: Any, what: str) -> dict[str, Any]:
    try:
        return db.table(table).get(pk)
    except _RowNotFound:
        raise NotFoundError(f"no {what} {pk!r}") from None


def _context_dict(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "settings": json.loads(row["settings"])}


def _artifact_dict(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "shape": json.loads(row["shape"])}


def _pid_alive(pid: int | None) -> bool:
    """Whether ``pid`` is a running process (POSIX; elsewhere assume it is)."""
    if pid is None:
        return False
    if pid == os.getpid():
        return True
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True
