"""Ingest jobs (``store.jobs``): the one record of what each job asked for and where it stands.

A job prepares one document for one model with one set of context settings
(and the indexes of some methods).  It may exist before its document and its
context do: an upload's document id is known from its bytes, but the document
row and the context come only once the file is extracted, so ``doc_id`` is not
a reference and ``context_id`` is NULL until then.

Life of a job: :meth:`Jobs.create` (or :meth:`Jobs.submit`, which reuses an
identical active job) -> :meth:`Jobs.start` -> :meth:`Jobs.update` (stage,
done/total units of the stage, what is known about the document) ->
:meth:`Jobs.finish` or :meth:`Jobs.fail`.  A process that dies leaves its jobs
active; :meth:`Jobs.recover_interrupted` fails them.

Rows come back as dicts with ``settings``, ``methods`` and ``method_settings`` decoded and
``truncate``/``cached`` as bools.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import sqlite_utils

from ..database import Database, canonical_json, first, now, require
from .contexts import check_count

JOB_STATUSES = ("queued", "running", "done", "failed", "cancelled")
ACTIVE_JOB_STATUSES = ("queued", "running")
ERROR_KINDS = ("document", "too_long", "internal")  # the file cannot be read; it does not fit; anything else
INTERRUPTED = "interrupted"  # error text of jobs and contexts found dead at start-up
QUEUED_STAGE, DONE_STAGE, FAILED_STAGE, CANCELLED_STAGE = "queued", "ready", "failed", "cancelled"
_ACTIVE_SQL = "status IN ('queued', 'running')"


class Jobs:
    """Create, advance, finish and list ingest jobs.  Missing rows raise :class:`NotFoundError`."""

    def __init__(self, database: Database) -> None:
        self.database = database

    # ------------------------------------------------------------------ creating

    def create(
        self,
        doc_id: str,
        name: str,
        model: str,
        settings: dict[str, Any],
        *,
        methods: Sequence[str] = (),
        truncate: bool = False,
        context_id: str | None = None,
        method_settings: dict[str, Any] | None = None,
    ) -> int:
        """A new "queued" job, owned by this process; returns its id.

        ``settings``: the context settings asked for; ``methods``: the methods
        whose indexes the job builds; ``method_settings``: the settings of some
        of them that the requester asked for (method -> its settings as a dict;
        the others: the engine's); ``context_id``: when the context exists already.
        """
        with self.database.transaction() as db:
            return self._insert(db, doc_id, name, model, settings, methods, truncate, context_id, method_settings)

    def submit(
        self,
        doc_id: str,
        name: str,
        model: str,
        settings: dict[str, Any],
        *,
        methods: Sequence[str] = (),
        truncate: bool = False,
        context_id: str | None = None,
        method_settings: dict[str, Any] | None = None,
    ) -> tuple[int, bool]:
        """The active job that does the same work (document, model, settings, methods and their settings), or a
        new one as :meth:`create` makes; returns ``(job_id, created)``."""
        same = ("doc_id = ? AND model = ? AND settings = ? AND methods = ? AND method_settings = ?"
                f" AND {_ACTIVE_SQL} ORDER BY id LIMIT 1")
        args = [doc_id, model, canonical_json(settings), canonical_json(list(methods)),
                canonical_json(method_settings or {})]
        with self.database.transaction() as db:
            existing = first(db, f"SELECT id FROM jobs WHERE {same}", args)
            if existing is not None:
                return int(existing["id"]), False
            return self._insert(db, doc_id, name, model, settings, methods, truncate, context_id,
                                method_settings), True

    @staticmethod
    def _insert(db: sqlite_utils.Database, doc_id: str, name: str, model: str, settings: dict[str, Any],
                methods: Sequence[str], truncate: bool, context_id: str | None,
                method_settings: dict[str, Any] | None = None) -> int:
        if context_id is not None:
            require(db, "contexts", context_id, "context")
        stamp = now()
        table = db.table("jobs").insert(
            {
                "doc_id": doc_id,
                "name": name,
                "model": model,
                "settings": canonical_json(settings),
                "methods": canonical_json(list(methods)),
                "method_settings": canonical_json(method_settings or {}),
                "truncate": bool(truncate),
                "context_id": context_id,
                "status": "queued",
                "stage": QUEUED_STAGE,
                "pid": os.getpid(),
                "created_at": stamp,
                "updated_at": stamp,
            }
        )
        return int(table.last_pk)

    # ------------------------------------------------------------------ advancing

    def start(self, job_id: int) -> dict[str, Any]:
        """Move a job to "running" in this process (its pid, and the start time the first time)."""
        with self.database.transaction() as db:
            job = require(db, "jobs", job_id, "job")
            stamp = now()
            db.table("jobs").update(job_id, {"status": "running", "pid": os.getpid(), "updated_at": stamp,
                                             "started_at": job["started_at"] or stamp})
            return _job_dict(require(db, "jobs", job_id, "job"))

    def update(
        self,
        job_id: int,
        *,
        stage: str | None = None,
        done: int | None = None,
        total: int | None = None,
        context_id: str | None = None,
        chars: int | None = None,
        pages: int | None = None,
        tokens: int | None = None,
    ) -> dict[str, Any]:
        """Record progress (the stage, and ``done`` of its ``total`` units) or what is now known about the
        document; only the fields given change.  Returns the row."""
        updates: dict[str, Any] = {"updated_at": now()}
        if stage is not None:
            updates["stage"] = str(stage)
        for column, value in (("done", done), ("total", total), ("chars", chars), ("pages", pages),
                              ("tokens", tokens)):
            if value is not None:
                updates[column] = check_count(value, column)
        if context_id is not None:
            updates["context_id"] = context_id
        with self.database.transaction() as db:
            require(db, "jobs", job_id, "job")
            if context_id is not None:
                require(db, "contexts", context_id, "context")
            db.table("jobs").update(job_id, updates)
            return _job_dict(require(db, "jobs", job_id, "job"))

    def finish(self, job_id: int, *, context_id: str, tokens: int, cached: bool = False) -> dict[str, Any]:
        """A job done: its context is ready with ``tokens`` tokens (``cached``: it was before the job)."""
        updates = {"status": "done", "stage": DONE_STAGE, "done": 1, "total": 1, "context_id": context_id,
                   "tokens": check_count(tokens, "tokens"), "cached": bool(cached), "error": None,
                   "error_kind": None}
        return self._end(job_id, updates)

    def cancel(self, job_id: int, reason: str) -> dict[str, Any]:
        """A job stopped by its user (``reason``: one plain line); its context is not ready."""
        return self._end(job_id, {"status": "cancelled", "stage": CANCELLED_STAGE, "error": reason,
                                  "error_kind": None})

    def fail(self, job_id: int, error: str, *, kind: str | None = "internal") -> dict[str, Any]:
        """A job failed with ``error`` (one plain line) of ``kind`` (one of :data:`ERROR_KINDS`, or None)."""
        if kind is not None and kind not in ERROR_KINDS:
            raise ValueError(f"error kind must be one of {ERROR_KINDS}, got {kind!r}")
        return self._end(job_id, {"status": "failed", "stage": FAILED_STAGE, "error": error, "error_kind": kind})

    def _end(self, job_id: int, updates: dict[str, Any]) -> dict[str, Any]:
        stamp = now()
        with self.database.transaction() as db:
            require(db, "jobs", job_id, "job")
            if updates.get("context_id") is not None:
                require(db, "contexts", updates["context_id"], "context")
            db.table("jobs").update(job_id, {**updates, "finished_at": stamp, "updated_at": stamp})
            return _job_dict(require(db, "jobs", job_id, "job"))

    # ------------------------------------------------------------------ reading

    def get(self, job_id: int) -> dict[str, Any]:
        """One job row."""
        with self.database.reading() as db:
            return _job_dict(require(db, "jobs", job_id, "job"))

    def latest(
        self,
        *,
        doc_id: str | None = None,
        context_id: str | None = None,
        model: str | None = None,
        settings: dict[str, Any] | None = None,
        after: int | None = None,
    ) -> dict[str, Any] | None:
        """The most recently created job matching every filter given, or None (``after``: see :meth:`list`)."""
        where, args = _filters(doc_id=doc_id, context_id=context_id, model=model, settings=settings, after=after)
        with self.database.reading() as db:
            row = first(db, f"SELECT * FROM jobs WHERE {where} ORDER BY id DESC LIMIT 1", args)
        return None if row is None else _job_dict(row)

    def list(
        self, *, model: str | None = None, after: int | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Jobs oldest first: of ``model`` when given; with ``after`` (a job id, e.g. :meth:`last_id` when a
        worker started), only the active ones and those created after it; with ``limit``, every active job and
        the newest ``limit`` finished ones."""
        where, args = _filters(model=model, after=after)
        with self.database.reading() as db:
            rows = [_job_dict(r) for r in db.query(f"SELECT * FROM jobs WHERE {where} ORDER BY id", args)]
        if limit is not None:
            finished = [r["id"] for r in rows if r["status"] not in ACTIVE_JOB_STATUSES]
            dropped = set(finished[: max(0, len(finished) - limit)])
            rows = [r for r in rows if r["id"] not in dropped]
        return rows

    def last_id(self) -> int:
        """The id of the newest job ever created (0 if none); ids are never reused."""
        with self.database.reading() as db:
            row = first(db, "SELECT seq FROM sqlite_sequence WHERE name = 'jobs'")
        return 0 if row is None else int(row["seq"])

    def building_elsewhere(self, context_id: str) -> dict[str, Any] | None:
        """The running job of another live process that builds ``context_id`` now (its stage, done and total tell
        how far it is), or None."""
        with self.database.reading() as db:
            rows = db.query("SELECT * FROM jobs WHERE context_id = ? AND status = 'running' ORDER BY id",
                            [context_id])
            jobs = [_job_dict(r) for r in rows]
        return next((j for j in jobs if j["pid"] != os.getpid() and pid_alive(j["pid"])), None)

    # ------------------------------------------------------------------ recovery

    def recover_interrupted(self, *, all: bool = False) -> int:  # noqa: A002 (name is the contract)
        """Fail jobs that can no longer finish; returns how many.

        A "queued" or "running" job whose pid is not a live process (or every
        such job when ``all=True``, i.e. at start-up of the only process that
        runs jobs) becomes "failed" with error "interrupted", and so does its
        context (if it has one) unless it is ready.  With ``all=True``, contexts
        left "running" without a job are failed too.
        """
        if self.database.read_only:  # nothing can be recorded: the jobs stay as they are listed
            return 0
        fail_context = (
            "UPDATE contexts SET status = 'failed', error = ?, updated_at = ?"
            " WHERE id = ? AND status != 'ready'"
        )
        with self.database.transaction() as db:
            active = db.query(f"SELECT id, context_id, pid FROM jobs WHERE {_ACTIVE_SQL}")
            dead = [job for job in active if all or not pid_alive(job["pid"])]
            stamp = now()
            for job in dead:
                db.table("jobs").update(job["id"], {"status": "failed", "stage": FAILED_STAGE, "error": INTERRUPTED,
                                                    "finished_at": stamp, "updated_at": stamp})
                if job["context_id"] is not None:
                    db.execute(fail_context, [INTERRUPTED, stamp, job["context_id"]])
            if all:
                db.execute(
                    "UPDATE contexts SET status = 'failed', error = ?, updated_at = ? WHERE status = 'running'",
                    [INTERRUPTED, stamp],
                )
        return len(dead)


def _filters(**given: Any) -> tuple[str, list]:
    """A WHERE clause (and its arguments) for the filters that are not None."""
    clauses, args = ["1"], []
    for column in ("doc_id", "context_id", "model"):
        if given.get(column) is not None:
            clauses.append(f"{column} = ?")
            args.append(given[column])
    if given.get("settings") is not None:
        clauses.append("settings = ?")
        args.append(canonical_json(given["settings"]))
    if given.get("after") is not None:
        clauses.append(f"({_ACTIVE_SQL} OR id > ?)")
        args.append(given["after"])
    return " AND ".join(clauses), args


def _job_dict(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "settings": json.loads(row["settings"]), "methods": json.loads(row["methods"]),
            "method_settings": json.loads(row.get("method_settings") or "{}"),
            "truncate": bool(row["truncate"]), "cached": bool(row["cached"])}


def pid_alive(pid: int | None) -> bool:
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
