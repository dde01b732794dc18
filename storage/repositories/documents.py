"""Documents in the index (``store.documents``): the extracted text with its pages, keyed by the file's sha256.

Document text is kept in the ``documents.text`` column (it is small next to the
KV tensors, and this keeps a document and its text in one transaction).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from datetime import datetime, timezone
from typing import Any

import sqlite_utils

from ..database import Database, first, now, require
from ..documents import Document
from ..errors import AmbiguousIdError, NotFoundError, StorageError

_HEX = re.compile(r"[0-9a-f]+")

_SUMMARY_SQL = """
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
WHERE d.deleted_at IS NULL
"""


class Documents:
    """Add, look up, list and delete documents.  Missing rows raise :class:`NotFoundError`."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def add(self, doc: Document) -> tuple[str, bool]:
        """Index ``doc``; returns ``(doc_id, created)``.

        The id comes from the file's sha256, so adding the same bytes again is a
        hit: nothing changes (not even the name) and ``created`` is False; a
        document deleted within its undo window (:meth:`hide`) is back.
        """
        doc_id = doc.doc_id
        with self.database.reading() as db:  # a hit writes nothing (a read-only cache answers it too)
            existing = first(db, "SELECT * FROM documents WHERE id = ?", [doc_id])
        if existing is not None and existing["sha256"] == doc.sha256 and existing.get("deleted_at") is None:
            return doc_id, False
        with self.database.transaction() as db:
            existing = first(db, "SELECT * FROM documents WHERE id = ?", [doc_id])
            if existing is not None:
                if existing["sha256"] != doc.sha256:
                    raise StorageError(f"document id {doc_id} collides with a different file")
                if existing.get("deleted_at") is not None:
                    db.execute("UPDATE documents SET deleted_at = NULL WHERE id = ?", [doc_id])
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
                    "added_at": now(),
                }
            )
        return doc_id, True

    def get(self, doc_id: str) -> Document:
        """Rebuild the :class:`Document` stored under ``doc_id``."""
        with self.database.reading() as db:
            row = require(db, "documents", doc_id, "document")
        return Document(
            name=row["name"],
            kind=row["kind"],
            text=row["text"],
            page_starts=tuple(json.loads(row["page_starts"])),
            sha256=row["sha256"],
        )

    def find(self, prefix_or_id: str) -> dict[str, Any]:
        """The summary (as in :meth:`list`) of one document.

        Matches, in order: an id or unique id prefix (hex), then an exact file name.
        Raises :class:`NotFoundError`, or :class:`AmbiguousIdError` when several match.
        """
        key = prefix_or_id.strip()
        matchers = [("d.name = ?", [key])]
        if key and _HEX.fullmatch(key.lower()):  # an exact id is a prefix of itself
            matchers.insert(0, ("substr(d.id, 1, ?) = ?", [len(key), key.lower()]))
        with self.database.reading() as db:
            for where, args in matchers:
                rows = _summaries(db, where, args)
                if len(rows) == 1:
                    return rows[0]
                if len(rows) > 1:
                    ids = ", ".join(r["id"] for r in rows[:5])
                    raise AmbiguousIdError(
                        f"{key!r} matches {len(rows)} documents ({ids}); be more specific"
                    )
        raise NotFoundError(f"no document matches {key!r}")

    def list(self) -> list[dict[str, Any]]:
        """Every document, newest first, without its text.

        Keys: id, name, kind, pages, chars, sha256, added_at, and for its best
        context (the latest ready one, else the latest of any status; None if
        none): context_id, status, tokens.
        """
        with self.database.reading() as db:
            return _summaries(db)

    def hide(self, doc_id: str) -> dict[str, Any]:
        """Take a document out of the library (:meth:`list`, :meth:`find`) without deleting anything yet: the
        start of its undo window (:meth:`unhide` brings it back, :meth:`hidden` lists it for deletion). Returns
        its summary."""
        with self.database.transaction() as db:
            rows = _summaries(db, "d.id = ?", [doc_id])
            if not rows:
                raise NotFoundError(f"no document {doc_id!r} in the library")
            db.execute("UPDATE documents SET deleted_at = ? WHERE id = ?", [now(), doc_id])
        return rows[0]

    def unhide(self, doc_id: str) -> dict[str, Any]:
        """Bring a hidden document back into the library; returns its summary. Raises :class:`NotFoundError`
        when it is not hidden (deleted for good, or never hidden)."""
        with self.database.transaction() as db:
            changed = db.execute("UPDATE documents SET deleted_at = NULL WHERE id = ? AND deleted_at IS NOT NULL",
                                 [doc_id]).rowcount
            if not changed:
                raise NotFoundError(f"document {doc_id!r} is not waiting to be deleted")
            return _summaries(db, "d.id = ?", [doc_id])[0]

    def hidden(self, older_than_s: float = 0.0) -> list[str]:
        """The ids of the documents hidden at least ``older_than_s`` seconds ago, oldest first."""
        cutoff = datetime.fromtimestamp(time.time() - older_than_s, timezone.utc).isoformat(timespec="milliseconds")
        with self.database.reading() as db:
            rows = db.query("SELECT id FROM documents WHERE deleted_at IS NOT NULL AND deleted_at <= ?"
                            " ORDER BY deleted_at", [cutoff])
            return [r["id"] for r in rows]

    def delete(self, doc_id: str, *, jobs: bool = True) -> None:
        """Delete a document with its contexts, artifacts, method builds, jobs and chats, then its blob files.
        jobs=False keeps its jobs (without their context): a failed preparation's job still tells why."""
        with self.database.transaction() as db:
            require(db, "documents", doc_id, "document")
            context_ids = [r["id"] for r in db.query("SELECT id FROM contexts WHERE doc_id = ?", [doc_id])]
            paths = [
                r["path"]
                for r in db.query(
                    "SELECT a.path FROM artifacts a JOIN contexts c ON c.id = a.context_id"
                    " WHERE c.doc_id = ?",
                    [doc_id],
                )
            ]
            if jobs:
                db.execute("DELETE FROM jobs WHERE doc_id = ?", [doc_id])  # also those without a context
            else:  # (a job's context would take it along)
                db.execute("UPDATE jobs SET context_id = NULL WHERE doc_id = ?", [doc_id])
            db.execute("DELETE FROM documents WHERE id = ?", [doc_id])  # cascades to the rest
        # Rows first, files second: a crash in between leaves orphan files, never dangling rows.
        self.database.unlink(paths)
        for context_id in context_ids:
            shutil.rmtree(self.database.blob_dir / context_id, ignore_errors=True)


def _summaries(
    db: sqlite_utils.Database, where: str | None = None, args: list | None = None
) -> list[dict[str, Any]]:
    sql = _SUMMARY_SQL + (f" AND {where}" if where else "")
    return list(db.query(sql + " ORDER BY d.added_at DESC, d.rowid DESC", args or []))
