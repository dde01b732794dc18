"""The SQLite index's connection machinery: one writer, readers per thread, migrations, close.

:class:`Database` owns the connections of ``root/index.db`` (or of an in-memory index
with a temporary blob directory); the queries live in :mod:`storage.repositories`.

* **One writer.**  Every state change runs in :meth:`Database.transaction`, which
  holds a ``threading.RLock`` and a ``BEGIN IMMEDIATE`` transaction on the one
  write connection (opened with ``check_same_thread=False``).  Nested
  ``transaction()`` blocks become savepoints.
* **Readers per thread.**  For a file-backed index each thread reads through its
  own connection (:meth:`Database.reading`); WAL mode lets those reads run while a
  write is in progress.  Inside a transaction, reads go through the write
  connection so they see the uncommitted rows.  An in-memory index has a single
  connection, so its reads also take the lock.
* **Files outside the lock.**  Repositories write a large file (atomically, see
  :mod:`storage.blobs`) under a fresh name before taking the lock, and delete
  files only after the transaction that dropped their rows has committed
  (:meth:`Database.unlink`): an index row never points at a half-written or
  deleted file; a crash leaves at worst an orphan file.
* **Migrations** (:mod:`storage.schema`) run at open, each in one transaction.

The helpers at the bottom (:func:`now`, :func:`canonical_json`, :func:`first`,
:func:`one`, :func:`require`) are what every repository's queries share.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlite_utils
from sqlite_utils.db import NotFoundError as _RowNotFound

from .errors import NotFoundError, StorageError
from .schema import MIGRATIONS, SCHEMA_VERSION, VERSION_TABLE_SQL

INDEX_FILE = "index.db"
BLOB_DIR = "blobs"
BUSY_TIMEOUT_S = 30.0  # wait this long for another process's write lock


class Database:
    """The connections of one index; see the module docstring for the rules.

    ``Database(root)`` opens (or creates) ``root/index.db`` and ``root/blobs/``;
    ``Database(memory=True)`` keeps the index in memory and the blobs in a
    temporary directory that :meth:`close` removes.
    """

    def __init__(self, root: str | Path | None = None, *, memory: bool = False) -> None:
        if memory == (root is not None):
            raise ValueError("give a root directory, or memory=True (not both)")
        self.in_memory = memory
        self._lock = threading.RLock()
        self._local = threading.local()  # per thread: reader connection, transaction depth
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.read_only = False  # a cache this process may read but not write: queries only (writes are refused)
        if memory:
            self._tmp = tempfile.TemporaryDirectory(prefix="squeeze-store-")
            self.root = Path(self._tmp.name)
            conn = _configure(sqlite3.connect(":memory:", check_same_thread=False))
        else:
            self.root = Path(root)
            index = self.root / INDEX_FILE
            self.read_only = index.is_file() and not (os.access(self.root, os.W_OK) and os.access(index, os.W_OK))
            if not self.read_only:
                self.root.mkdir(parents=True, exist_ok=True)
            conn = self._connect()
        self.blob_dir = self.root / BLOB_DIR
        if not self.read_only:
            self.blob_dir.mkdir(exist_ok=True)
        self._db = sqlite_utils.Database(conn, execute_plugins=False)
        try:
            if not memory:
                self._check_intact()
            if self.read_only:
                self._check_read_only_schema()
            else:
                if not memory:
                    self._db.enable_wal()
                self._migrate()
        except BaseException:
            self.close()
            raise

    @property
    def index_path(self) -> Path | None:
        """``root/index.db``, or None for an in-memory index."""
        return None if self.in_memory else self.root / INDEX_FILE

    def __repr__(self) -> str:
        return f"Database({'memory=True' if self.in_memory else str(self.root)!r})"

    def close(self) -> None:
        """Close every connection (and remove the temporary directory of an in-memory index)."""
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
        path = self.root / INDEX_FILE
        if self.read_only:  # no -wal or -shm file can be made beside it: read the file as it is
            uri = f"{path.resolve().as_uri()}?mode=ro&immutable=1"
            return _configure(sqlite3.connect(uri, uri=True, check_same_thread=False))
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        return _configure(conn)

    def _check_intact(self) -> None:
        """SQLite's quick check of the index file at open: a damaged one is refused here, in words that say what to
        do, before anything reads a wrong row or writes into it."""
        path = self.root / INDEX_FILE
        try:
            problems = [row[0] for row in self._db.conn.execute("PRAGMA quick_check(3)")]
        except sqlite3.DatabaseError as exc:
            problems = [str(exc)]
        if problems != ["ok"]:
            found = "; ".join(line.strip() for p in problems for line in p.splitlines()
                              if line.strip() and not line.startswith("***"))
            raise StorageError(f"the cache index {path} is damaged ({found[:200]}): `squeeze repair --cache-dir "
                               f"{self.root}` rebuilds it from the rows it can still read (the damaged file is kept "
                               "beside it), or move it aside and prepare the documents again")

    def _check_read_only_schema(self) -> None:
        """A read-only index is read as it is: it must be of this version's schema (it cannot be migrated)."""
        version = self.schema_version()
        if version != SCHEMA_VERSION:
            raise StorageError(f"the cache at {self.root} is read-only and its index is of schema {version}; this "
                               f"version reads schema {SCHEMA_VERSION} (open it once where it can be written)")

    def _refuse_writes(self) -> None:
        if self.read_only:
            raise StorageError(f"the cache at {self.root} is read-only here: listing and reading work, changing "
                               "it needs write access (or another --cache-dir)")

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"{self!r} is closed")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite_utils.Database]:
        """One atomic state change: commits on success, rolls back on any exception.

        Holds the writer lock for its duration; nested blocks are savepoints.
        Yields the sqlite-utils ``Database`` to run statements on.
        """
        with self._lock:
            self._check_open()
            self._refuse_writes()
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
    def reading(self) -> Iterator[sqlite_utils.Database]:
        """A consistent read: this thread's own connection, or the writer's (see the module docstring)."""
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
            db = self._local.reader = sqlite_utils.Database(conn, execute_plugins=False)
        db.conn.execute("BEGIN")  # one snapshot for all the queries of this call
        try:
            yield db
        finally:
            db.conn.rollback()

    # ------------------------------------------------------------------ files

    def unlink(self, paths: Iterable[str], *, prune_dirs: bool = False) -> None:
        """Delete files given relative to the root (missing ones are fine); call after the commit that dropped
        their rows. ``prune_dirs``: also remove their directories once empty."""
        dirs = set()
        for rel in paths:
            path = self.root / rel
            path.unlink(missing_ok=True)
            dirs.add(path.parent)
        if prune_dirs:
            for directory in dirs:
                with contextlib.suppress(OSError):
                    directory.rmdir()  # only if empty

    def remove_unknown_files(self, known: set[str], min_age_s: float = 0.0) -> int:
        """Delete the files under ``blobs/`` whose root-relative path is not in ``known`` and that were last written
        at least ``min_age_s`` ago, and empty directories; returns how many files."""
        removed = 0
        cutoff = time.time() - min_age_s
        for path in sorted(self.blob_dir.rglob("*"), reverse=True):  # files before their dirs
            if path.is_dir():
                with contextlib.suppress(OSError):
                    path.rmdir()  # only if empty
            elif path.relative_to(self.root).as_posix() not in known:
                with contextlib.suppress(FileNotFoundError):
                    if path.stat().st_mtime <= cutoff:
                        path.unlink()
                        removed += 1
        return removed

    # ------------------------------------------------------------------ migrations

    def _migrate(self) -> None:
        """Bring the schema up to :data:`SCHEMA_VERSION`, each migration in one transaction.

        A script runs statement by statement on the open transaction (``executescript``
        would commit first and run the rest outside it), and a Python step on that
        transaction's database, so a failed migration leaves the index as it was.
        """
        with self.transaction() as db:
            db.execute(VERSION_TABLE_SQL)
        for version, script in MIGRATIONS:
            with self.transaction() as db:
                current = one(db, "SELECT COALESCE(MAX(version), 0) AS v FROM schema_version")["v"]
                if current > SCHEMA_VERSION:
                    raise StorageError(
                        f"{self.index_path or 'index'} has schema version {current}, newer than"
                        f" this code's {SCHEMA_VERSION}; upgrade the application"
                    )
                if version <= current:
                    continue
                if callable(script):
                    script(db)
                else:
                    for statement in split_statements(script):
                        db.conn.execute(statement)
                db.table("schema_version").insert({"version": version, "applied_at": now()})

    def schema_version(self) -> int:
        """The highest migration applied to this index."""
        with self.reading() as db:
            return one(db, "SELECT COALESCE(MAX(version), 0) AS v FROM schema_version")["v"]


def _configure(conn: sqlite3.Connection) -> sqlite3.Connection:
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


def split_statements(script: str) -> list[str]:
    """The complete SQL statements of a script, in order (``sqlite3.complete_statement`` decides where one ends,
    so semicolons inside strings, comments and triggers do not split)."""
    statements, pending = [], ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            if pending.strip(" \t\r\n;"):
                statements.append(pending.strip())
            pending = ""
    if pending.strip():
        raise StorageError(f"incomplete SQL statement at the end of a migration: {pending.strip()[:60]!r}")
    return statements


# ---------------------------------------------------------------------- helpers for the queries


def now() -> str:
    """The current UTC time as the index stores it (ISO 8601, milliseconds): such strings sort by time."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # torch / numpy scalars and small arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def canonical_json(value: Any, *, allow_nan: bool = False) -> str:
    """Sorted keys, no spaces: equal values give equal strings (and equal keys)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=allow_nan, default=_json_default)


def first(db: sqlite_utils.Database, sql: str, args: list | None = None) -> dict[str, Any] | None:
    """The first row of a query, or None."""
    return next(iter(db.query(sql, args or [])), None)


def one(db: sqlite_utils.Database, sql: str, args: list | None = None) -> dict[str, Any]:
    """The first row of a query that always returns one."""
    row = first(db, sql, args)
    assert row is not None, sql
    return row


def require(db: sqlite_utils.Database, table: str, pk: Any, what: str) -> dict[str, Any]:
    """The row of ``table`` with primary key ``pk``; :class:`NotFoundError` naming ``what`` if there is none."""
    try:
        return db.table(table).get(pk)
    except _RowNotFound:
        raise NotFoundError(f"no {what} {pk!r}") from None

