"""Which sparse-attention methods are built for a context, with which settings (``store.methods``).

A method's index of a context is the set of the context's artifacts named
``{method}.*`` (e.g. ``quest.layer3.page_min``, ``quest.calib.x``), saved through
:class:`storage.repositories.contexts.Artifacts`; a row here says that set is
complete and records the settings that built it.  Removing a build removes its
artifacts too (rows in one transaction, files after the commit).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..database import Database, canonical_json, first, now, require

METHOD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # no dot: "{method}." prefixes its artifacts


class MethodBuilds:
    """Builds of (context, method).  Rows come back with ``settings`` decoded."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def get(self, context_id: str, method: str) -> dict[str, Any] | None:
        """The build of ``method`` for a context, or None when it is not built."""
        with self.database.reading() as db:
            row = first(db, "SELECT * FROM method_builds WHERE context_id = ? AND method = ?",
                        [context_id, method])
        return None if row is None else _build_dict(row)

    def list(self, context_id: str) -> list[dict[str, Any]]:
        """Every method built for a context, by method name."""
        with self.database.reading() as db:
            rows = db.query("SELECT * FROM method_builds WHERE context_id = ? ORDER BY method", [context_id])
            return [_build_dict(r) for r in rows]

    def mark_built(self, context_id: str, method: str, settings: dict[str, Any]) -> dict[str, Any]:
        """Record that ``method``'s artifacts of the context are complete, built with ``settings`` (replacing an
        earlier build's row); returns the row.  :class:`NotFoundError` for an unknown context."""
        _check_method(method)
        row = {"context_id": context_id, "method": method, "settings": canonical_json(settings),
               "built_at": now()}
        with self.database.transaction() as db:
            require(db, "contexts", context_id, "context")
            db.table("method_builds").upsert(row, pk=("context_id", "method"))
        return _build_dict(row)

    def remove(self, context_id: str, method: str) -> int:
        """Forget ``method``'s build of a context and delete the context's artifacts named ``{method}.*`` (also
        those of an unfinished build without a row), rows in one transaction, files after it; returns how many
        artifacts.  :class:`NotFoundError` for an unknown context."""
        _check_method(method)
        prefix = f"{method}."
        match = "context_id = ? AND substr(name, 1, ?) = ?"  # not LIKE: "_" in a method name is no wildcard
        args = [context_id, len(prefix), prefix]
        with self.database.transaction() as db:
            require(db, "contexts", context_id, "context")
            paths = [r["path"] for r in db.query(f"SELECT path FROM artifacts WHERE {match}", args)]
            db.execute(f"DELETE FROM artifacts WHERE {match}", args)
            db.execute("DELETE FROM method_builds WHERE context_id = ? AND method = ?", [context_id, method])
        self.database.unlink(paths)
        return len(paths)


def _check_method(method: str) -> None:
    if not isinstance(method, str) or not METHOD_NAME.fullmatch(method):
        raise ValueError(f"method name must match {METHOD_NAME.pattern}, got {method!r}")


def _build_dict(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "settings": json.loads(row["settings"])}
