"""Chats about a document and their turns (``store.chats``)."""

from __future__ import annotations

import json
from typing import Any

from ..database import Database, canonical_json, now, one, require

CHAT_TITLE_CHARS = 80  # an untitled chat is named after its first question, cut to this


class ANY_OWNER:  # noqa: N801 - a sentinel: Chats.list of every owner's chats
    """Chats.list(doc_id) lists every owner's chats."""


class Chats:
    """Create chats, append turns, read them back.  Missing rows raise :class:`NotFoundError`."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def create(self, doc_id: str, context_id: str | None = None, *, title: str | None = None,
               owner: str | None = None) -> int:
        """A new chat about a document (answered from ``context_id``), started by ``owner`` (an opaque token: the
        app's browser or session; None outside the app); returns its id."""
        with self.database.transaction() as db:
            require(db, "documents", doc_id, "document")
            if context_id is not None:
                context = require(db, "contexts", context_id, "context")
                if context["doc_id"] != doc_id:
                    raise ValueError(
                        f"context {context_id} belongs to document {context['doc_id']}, not {doc_id}"
                    )
            row = {"doc_id": doc_id, "context_id": context_id, "created_at": now(), "title": title}
            if owner is not None:
                row["owner"] = owner
            table = db.table("chats").insert(row)
            return int(table.last_pk)

    def get(self, chat_id: int) -> dict[str, Any]:
        """One chat row."""
        with self.database.reading() as db:
            return require(db, "chats", chat_id, "chat")

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
        stats_json = canonical_json(stats, allow_nan=True)  # a NaN metric is still a metric
        with self.database.transaction() as db:
            chat = require(db, "chats", chat_id, "chat")
            next_idx = "SELECT COALESCE(MAX(idx), -1) + 1 AS n FROM turns WHERE chat_id = ?"
            idx = one(db, next_idx, [chat_id])["n"]
            table = db.table("turns").insert(
                {
                    "chat_id": chat_id,
                    "idx": idx,
                    "question": question,
                    "answer": answer,
                    "method": method,
                    "sparsity": None if sparsity is None else float(sparsity),
                    "stats": stats_json,
                    "created_at": now(),
                }
            )
            if chat["title"] is None:
                title = " ".join(question.split())[:CHAT_TITLE_CHARS]
                db.table("chats").update(chat_id, {"title": title})
            return int(table.last_pk)

    def list(self, doc_id: str, owner: str | None | type[ANY_OWNER] = ANY_OWNER) -> list[dict[str, Any]]:
        """The chats of a document, newest first, each with its number of turns: every one, or ``owner``'s only
        (None: the chats started without an owner)."""
        mine = "" if owner is ANY_OWNER else " AND c.owner IS ?"
        with self.database.reading() as db:
            return [*db.query(
                "SELECT c.*, (SELECT COUNT(*) FROM turns t WHERE t.chat_id = c.id) AS turn_count"
                f" FROM chats c WHERE c.doc_id = ?{mine} ORDER BY c.created_at DESC, c.id DESC",
                [doc_id] if owner is ANY_OWNER else [doc_id, owner],
            )]

    def turns(self, chat_id: int) -> list[dict[str, Any]]:
        """The turns of a chat in order (stats decoded)."""
        with self.database.reading() as db:
            require(db, "chats", chat_id, "chat")
            rows = db.query("SELECT * FROM turns WHERE chat_id = ? ORDER BY idx", [chat_id])
            return [{**r, "stats": json.loads(r["stats"])} for r in rows]
