"""Results of ``squeeze eval``, per model (``store.evals``).

An evaluation is one JSON document (every sparse method beside full attention at equal KV budgets); it is kept
whole, with its ``summary`` rows in a column of their own so that a listing needs no document.  Keys the store
does not know are kept as they are.  The newest evaluation of a model is the one stored last.
"""

from __future__ import annotations

import json
from typing import Any

from ..database import Database, canonical_json, first, now, require


class Evals:
    """Add, read and list evaluations.  Missing rows raise :class:`NotFoundError`; bad arguments ``ValueError``."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def add(self, model: str, doc: dict[str, Any]) -> int:
        """Store an evaluation of ``model`` (the whole document ``doc``, JSON-serialisable); returns its id."""
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"an evaluation needs a model id, got {model!r}")
        if not isinstance(doc, dict):
            raise ValueError(f"an evaluation is a JSON object, got {type(doc).__name__}")
        summary = doc.get("summary", [])
        if not isinstance(summary, list):
            raise ValueError(f"an evaluation's summary is a list of rows, got {type(summary).__name__}")
        row = {"model": model, "created_at": now(), "summary": canonical_json(summary, allow_nan=True),
               "doc": canonical_json(doc, allow_nan=True)}  # a NaN metric is still a metric
        with self.database.transaction() as db:
            return int(db.table("evals").insert(row).last_pk)

    def get(self, eval_id: int) -> dict[str, Any]:
        """The whole document of evaluation ``eval_id``."""
        with self.database.reading() as db:
            return json.loads(require(db, "evals", eval_id, "evaluation")["doc"])

    def latest(self, model: str) -> dict[str, Any] | None:
        """The whole document of the newest evaluation of ``model``, or None when it has none."""
        with self.database.reading() as db:
            row = first(db, "SELECT doc FROM evals WHERE model = ? ORDER BY id DESC LIMIT 1", [model])
        return None if row is None else json.loads(row["doc"])

    def list(self, model: str | None = None) -> list[dict[str, Any]]:
        """The evaluations (of ``model``, or of every model), newest first: id, model, created_at and the summary
        rows, without the documents."""
        where, args = ("WHERE model = ?", [model]) if model is not None else ("", [])
        with self.database.reading() as db:
            rows = db.query(f"SELECT id, model, created_at, summary FROM evals {where} ORDER BY id DESC", args)
            return [{**r, "summary": json.loads(r["summary"])} for r in rows]
