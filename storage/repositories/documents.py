"""Documents in the index (``store.documents``): the extracted text with its pages, keyed by the file's sha256.

Document text is kept in the ``documents.text`` column (it is small next to the
KV tensors, and this keeps a document and its text in one transaction).  A PDF
may keep its original file too, as a blob whose sha256 is the document's::

    root/blobs/documents/<doc_id>.<hex>.pdf

That folder holds nothing else (the app serves its files: :attr:`Documents.source_dir`).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

import sqlite_utils

from ..blobs import FILE_TOKEN_BYTES, read_bytes, write_bytes
from ..database import BLOB_DIR, Database, first, now, require
from ..documents import Document
from ..errors import AmbiguousIdError, NotFoundError, StorageError

_HEX = re.compile(r"[0-9a-f]+")
SOURCE_DIR = "documents"  # under blobs/: the original files kept, PDFs only
SOURCE_KINDS = ("pdf",)  # the kinds whose original file is kept

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

    def add(self, doc: Document, source: bytes | None = None) -> tuple[str, bool]:
        """Index ``doc``; returns ``(doc_id, created)``.

        The id comes from the file's sha256, so adding the same bytes again is a
        hit: nothing changes (not even the name) and ``created`` is False; a
        document deleted within its undo window (:meth:`hide`) is back.
        source: the file's original bytes, kept for a PDF (:meth:`source`; a hit
        keeps them when they were not kept yet); ``ValueError`` for another kind,
        or bytes whose sha256 is not the document's.
        """
        doc_id = doc.doc_id
        if source is not None:
            if doc.kind not in SOURCE_KINDS:
                raise ValueError(f"only the original file of a {' or '.join(SOURCE_KINDS)} is kept, not a {doc.kind}'s")
            if hashlib.sha256(source).hexdigest() != doc.sha256:
                raise ValueError(f"{doc.name}: the bytes given are not the document's (sha256 differs)")
        with self.database.reading() as db:  # a hit with nothing to add writes nothing (a read-only cache answers it)
            existing = first(db, "SELECT * FROM documents WHERE id = ?", [doc_id])
        if (existing is not None and existing["sha256"] == doc.sha256 and existing.get("deleted_at") is None
                and (source is None or existing.get("source_path") is not None or self.database.read_only)):
            return doc_id, False
        written = None  # the file written for this call, until a row names it
        if source is not None and not self.database.read_only and self._source_row(doc_id) is None:
            written = PurePosixPath(BLOB_DIR, SOURCE_DIR, f"{doc_id}.{secrets.token_hex(FILE_TOKEN_BYTES)}.pdf")
            write_bytes(self.database.root / written, source)  # file first, row second
        kept = {"source_path": written.as_posix(), "source_nbytes": len(source)} if written else {}
        try:
            with self.database.transaction() as db:
                existing = first(db, "SELECT * FROM documents WHERE id = ?", [doc_id])
                if existing is not None:
                    if existing["sha256"] != doc.sha256:
                        raise StorageError(f"document id {doc_id} collides with a different file")
                    if existing.get("deleted_at") is not None:
                        db.execute("UPDATE documents SET deleted_at = NULL WHERE id = ?", [doc_id])
                    if kept and existing["source_path"] is None:
                        db.execute("UPDATE documents SET source_path = ?, source_nbytes = ? WHERE id = ?",
                                   [kept["source_path"], kept["source_nbytes"], doc_id])
                        written = None
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
                        **kept,
                    }
                )
                written = None
            return doc_id, True
        finally:
            if written is not None:  # no row names it (another add kept its own first, or the add failed)
                self.database.unlink([written.as_posix()])

    def _source_row(self, doc_id: str) -> dict[str, Any] | None:
        """The kept file's columns of a document (source_path, source_nbytes, sha256), or None where none is kept."""
        with self.database.reading() as db:
            row = first(db, "SELECT source_path, source_nbytes, sha256, deleted_at FROM documents WHERE id = ?",
                        [doc_id])
        return row if row is not None and row["source_path"] is not None else None

    @property
    def source_dir(self) -> Path:
        """The folder of the kept original files (PDFs only, named ``<doc_id>.<hex>.pdf``)."""
        return self.database.blob_dir / SOURCE_DIR

    def source(self, doc_id: str) -> bytes | None:
        """The original file of a document, checked against its sha256; None where it was not kept (a text file,
        or a document stored without it). Raises :class:`NotFoundError` for no such document, and
        :class:`~storage.errors.MissingArtifactError` / :class:`~storage.errors.DamagedArtifactError` for a kept
        file that is gone or whose bytes differ."""
        with self.database.reading() as db:
            row = require(db, "documents", doc_id, "document")
        if row["source_path"] is None:
            return None
        return read_bytes(self.database.root / row["source_path"], row["sha256"])

    def source_file(self, doc_id: str) -> Path | None:
        """Where a library document's original file lies, when it was kept and is on disk at its recorded size (a
        quick check, no hashing: :meth:`source` reads it verified); None otherwise, and for a document that is
        hidden or gone."""
        row = self._source_row(doc_id)
        if row is None or row["deleted_at"] is not None:
            return None
        path = self.database.root / row["source_path"]
        try:
            return path if path.stat().st_size == row["source_nbytes"] else None
        except FileNotFoundError:
            return None

    def source_paths(self) -> set[str]:
        """The root-relative paths of every kept original file (for the orphan sweep)."""
        with self.database.reading() as db:
            return {r["source_path"] for r in db.query("SELECT source_path FROM documents"
                                                       " WHERE source_path IS NOT NULL")}

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
        """Delete a document with its contexts, artifacts, method builds, jobs and chats, then its blob files (its
        kept original file among them).
        jobs=False keeps its jobs (without their context): a failed preparation's job still tells why."""
        with self.database.transaction() as db:
            source = require(db, "documents", doc_id, "document")["source_path"]
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
        self.database.unlink(paths + ([source] if source else []))
        for context_id in context_ids:
            shutil.rmtree(self.database.blob_dir / context_id, ignore_errors=True)


def _summaries(
    db: sqlite_utils.Database, where: str | None = None, args: list | None = None
) -> list[dict[str, Any]]:
    sql = _SUMMARY_SQL + (f" AND {where}" if where else "")
    return list(db.query(sql + " ORDER BY d.added_at DESC, d.rowid DESC", args or []))
