"""Prepared contexts and their artifacts (``store.contexts``, ``store.artifacts``).

A context is one document prepared for one model with one set of settings,
keyed by the sha256 of the three.  Its artifacts are tensors, one file each::

    root/blobs/<context_id>/<name>.<hex>.safetensors

A context becomes "ready" only once every artifact row's file is in place
(:meth:`Contexts.mark_ready`); artifacts are saved file first, row second
(:meth:`Artifacts.save`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from ..blobs import ARTIFACT_SUFFIX, artifact_path, check_artifact, check_artifact_file, read_artifact, write_artifact
from ..database import BLOB_DIR, Database, canonical_json, first, now, require
from ..errors import DamagedArtifactError, MissingArtifactError, NotFoundError, StorageError

if TYPE_CHECKING:  # (torch loads where tensors are read or written: `squeeze list` stays quick)
    import torch

CONTEXT_ID_CHARS = 16  # a context id is this many leading hex chars of its key
# Artifact files a context's load reads and hashes at once: a context of an 8B model at 32K tokens is 4 GiB in 64
# K/V files, and sha256 runs at 1-2 GB/s on one core
LOAD_THREADS = min(8, os.cpu_count() or 1)
CONTEXT_STATUSES = ("pending", "running", "ready", "failed")


class Contexts:
    """Contexts of (document, model, settings), their status and token count.

    Rows come back as dicts with ``settings`` decoded.
    """

    def __init__(self, database: Database) -> None:
        self.database = database

    @staticmethod
    def key(doc_sha256: str, model: str, settings: dict[str, Any]) -> str:
        """sha256 over the document's sha256, the model name and the canonical settings JSON."""
        return hashlib.sha256(canonical_json([doc_sha256, model, settings]).encode()).hexdigest()

    def context_for(self, doc_id: str, model: str, settings: dict[str, Any]) -> dict[str, Any]:
        """The context for (document, model, settings), created as "pending" if new.

        An existing context is returned whatever its status (a "failed" one is
        for the caller to retry via :meth:`set_status`).
        """
        settings_json = canonical_json(settings)
        with self.database.reading() as db:  # an existing context is read, not written (a read-only cache has it)
            doc = require(db, "documents", doc_id, "document")
            key = self.key(doc["sha256"], model, settings)
            row = first(db, "SELECT * FROM contexts WHERE key = ?", [key])
        if row is not None:
            return _context_dict(row)
        with self.database.transaction() as db:
            doc = require(db, "documents", doc_id, "document")
            row = first(db, "SELECT * FROM contexts WHERE key = ?", [key])
            if row is None:
                stamp = now()
                row = {
                    "id": key[:CONTEXT_ID_CHARS],
                    "doc_id": doc_id,
                    "model": model,
                    "settings": settings_json,
                    "key": key,
                    "status": "pending",
                    "tokens": None,
                    "error": None,
                    "created_at": stamp,
                    "updated_at": stamp,
                }
                db.table("contexts").insert(row)
        return _context_dict(row)

    def get(self, context_id: str) -> dict[str, Any]:
        """One context row."""
        with self.database.reading() as db:
            return _context_dict(require(db, "contexts", context_id, "context"))

    def list(self, doc_id: str) -> list[dict[str, Any]]:
        """Every context of a document, most recently updated first."""
        with self.database.reading() as db:
            rows = db.query(
                "SELECT * FROM contexts WHERE doc_id = ? ORDER BY updated_at DESC, rowid DESC",
                [doc_id],
            )
            return [_context_dict(r) for r in rows]

    def set_status(
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
        updates: dict[str, Any] = {"status": status, "updated_at": now(),
                                   "error": error if status == "failed" else None}
        if tokens is not None:
            updates["tokens"] = check_count(tokens, "tokens")
        with self.database.transaction() as db:
            require(db, "contexts", context_id, "context")
            db.table("contexts").update(context_id, updates)
            return _context_dict(require(db, "contexts", context_id, "context"))

    def mark_ready(
        self, context_id: str, tokens: int, *, required: Iterable[str] = ()
    ) -> dict[str, Any]:
        """Mark a context "ready" with its token count; returns the updated row.

        Refuses (:class:`MissingArtifactError`) unless every artifact row's file
        exists with its recorded size and every name in ``required`` has a row;
        a file of the wrong size raises :class:`DamagedArtifactError`.
        """
        tokens = check_count(tokens, "tokens")
        with self.database.transaction() as db:
            require(db, "contexts", context_id, "context")
            artifacts = db.query("SELECT * FROM artifacts WHERE context_id = ?", [context_id])
            rows = {r["name"]: r for r in artifacts}
            for name in required:
                if name not in rows:
                    path = self.database.blob_dir / context_id / f"{name}.*{ARTIFACT_SUFFIX}"
                    raise MissingArtifactError(path, artifact=f"{context_id}/{name}")
            for row in rows.values():
                check_artifact_file(self.database.root, row, f"{context_id}/{row['name']}")
            ready = {"status": "ready", "tokens": tokens, "error": None, "updated_at": now()}
            db.table("contexts").update(context_id, ready)
            return _context_dict(require(db, "contexts", context_id, "context"))


class Artifacts:
    """The tensors of a context, one verified file each.  Rows come back with ``shape`` decoded."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def save(self, context_id: str, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        """Write one tensor to its own file, then upsert its index row; returns the row.

        The file is written atomically before the transaction (so the writer
        lock is not held during a large write); the row is written only once the
        file is in place.  Every save gets a fresh file name, so a row never
        points at a file that a concurrent save of the same name replaced; the
        file of the row being replaced is deleted after the commit.  Raises
        :class:`NotFoundError` if the context does not exist (or is deleted meanwhile).
        """
        check_artifact(name, tensor)
        with self.database.reading() as db:  # fail before writing a large file
            require(db, "contexts", context_id, "context")
        rel = artifact_path(PurePosixPath(BLOB_DIR, context_id), name)
        row = {"context_id": context_id, "name": name,
               **write_artifact(self.database.root, rel, name, tensor)}
        try:
            with self.database.transaction() as db:
                require(db, "contexts", context_id, "context")
                old = first(db, "SELECT path FROM artifacts WHERE context_id = ? AND name = ?",
                            [context_id, name])
                db.table("artifacts").upsert(row, pk=("context_id", "name"))
        except BaseException:
            self.database.unlink([rel.as_posix()])  # not indexed: nothing may point at it
            raise
        if old is not None:
            self.database.unlink([old["path"]])
        return _artifact_dict(row)

    def list(self, context_id: str) -> list[dict[str, Any]]:
        """The artifact rows of a context, by name."""
        with self.database.reading() as db:
            require(db, "contexts", context_id, "context")
            sql = "SELECT * FROM artifacts WHERE context_id = ? ORDER BY name"
            return [_artifact_dict(r) for r in db.query(sql, [context_id])]

    def load(
        self,
        context_id: str,
        names: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Load artifacts (all of them, or ``names`` in that order), verifying every sha256: up to LOAD_THREADS
        files read and hashed at once (the files' reads and hashing release the GIL).

        Raises :class:`NotFoundError` for a name without a row,
        :class:`MissingArtifactError` for a row without its file and
        :class:`DamagedArtifactError` for a file whose bytes changed; both name
        the artifact as ``<context_id>/<name>``.
        """
        rows = {r["name"]: r for r in self.list(context_id)}
        wanted = list(rows) if names is None else list(names)
        unknown = [n for n in wanted if n not in rows]
        if unknown:
            raise NotFoundError(f"context {context_id} has no artifact(s) {', '.join(unknown)}")
        root = self.database.root

        def read(name: str) -> torch.Tensor:
            return read_artifact(root, rows[name], f"{context_id}/{name}", device)

        try:
            with ThreadPoolExecutor(max(1, min(LOAD_THREADS, len(wanted)))) as pool:
                return dict(zip(wanted, pool.map(read, wanted)))  # (the first error in `wanted`'s order)
        except (MissingArtifactError, DamagedArtifactError) as exc:
            self._mark_damaged(context_id, exc)
            raise

    def _mark_damaged(self, context_id: str, exc: StorageError) -> None:
        """A ready context whose file is missing or damaged is ready no more: "failed", with the error, so that the next
        ingest of its document rebuilds it (the repair the error advises). Best effort: a store that cannot be
        written (read-only) keeps the error alone."""
        try:
            with self.database.transaction() as db:
                db.execute("UPDATE contexts SET status = 'failed', error = ?, updated_at = ?"
                           " WHERE id = ? AND status = 'ready'", [f"damaged: {exc}", now(), context_id])
        except (StorageError, sqlite3.Error, OSError):
            pass

    def check_files(self, context_id: str) -> None:
        """A quick check that every artifact file of the context exists with its recorded size (no hashing);
        raises :class:`MissingArtifactError` / :class:`DamagedArtifactError` and marks the context failed, as
        :meth:`load` does, where one is not."""
        root = self.database.root
        try:
            for row in self.list(context_id):
                check_artifact_file(root, row, f"{context_id}/{row['name']}")
        except (MissingArtifactError, DamagedArtifactError) as exc:
            self._mark_damaged(context_id, exc)
            raise

    def clear(self, context_id: str) -> int:
        """Delete every artifact and method build of a context (before it is built again from its document: what
        a failed or damaged build left is not trusted), rows first, then their files. Returns the artifacts
        deleted."""
        with self.database.transaction() as db:
            require(db, "contexts", context_id, "context")
            paths = [r["path"] for r in db.query("SELECT path FROM artifacts WHERE context_id = ?", [context_id])]
            db.execute("DELETE FROM artifacts WHERE context_id = ?", [context_id])
            db.execute("DELETE FROM method_builds WHERE context_id = ?", [context_id])
        self.database.unlink(paths)
        return len(paths)

    def paths(self) -> set[str]:
        """The file of every artifact row (root-relative)."""
        with self.database.reading() as db:
            return {r["path"] for r in db.query("SELECT path FROM artifacts")}


def check_count(value: int, what: str) -> int:
    """A non-negative integer (not a bool), or ``ValueError``."""
    if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def _context_dict(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "settings": json.loads(row["settings"])}


def _artifact_dict(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "shape": json.loads(row["shape"])}
