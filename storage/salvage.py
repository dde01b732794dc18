"""A damaged index rebuilt from what can still be read: `salvage_index(root)`.

The damaged ``index.db`` (with its ``-wal`` and ``-shm``) is moved aside as ``index.db.damaged-<time>``, a fresh
index is made by the migrations, and every row of every table that SQLite can still read is copied into it, table by
table in the schema's order, a block of rows at a time and row by row inside a block that fails (a garbled page
loses the rows it held, not the table). Rows whose parent was lost go too (the foreign keys checked at the end), so
the new index is whole; the documents' files under ``blobs/`` are untouched (those no row names any more are swept
as orphans by the next open of the store). The damaged file is kept for whoever wants to look at it.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from .database import INDEX_FILE, Database
from .errors import StorageError

BLOCK_ROWS = 256  # rows read per query while the table reads cleanly


@dataclass
class SalvageReport:
    """What a salvage kept: rows per table (copied, and lost where their pages could not be read or their parent
    was lost), and where the damaged file went."""

    damaged: Path
    copied: dict[str, int] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """One line per table that held rows, then where the damaged file is."""
        out = [f"{table}: {n} kept" + (f", {self.lost[table]} lost" if self.lost.get(table) else "")
               for table, n in self.copied.items() if n or self.lost.get(table)]
        return [*out, f"the damaged index is kept as {self.damaged}"]


def salvage_index(root: str | Path) -> SalvageReport:
    """Rebuild ``root/index.db`` from its readable rows (see the module docstring). Raises StorageError when there
    is no index there, or when the cache cannot be written."""
    root = Path(root)
    index = root / INDEX_FILE
    if not index.is_file():
        raise StorageError(f"there is no cache index at {index}")
    damaged = root / f"{INDEX_FILE}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        index.rename(damaged)
        for suffix in ("-wal", "-shm"):
            side = root / (INDEX_FILE + suffix)
            if side.exists():
                side.rename(root / (damaged.name + suffix))
    except OSError as exc:
        raise StorageError(f"cannot move the damaged index aside in {root}: {exc}") from exc
    report = SalvageReport(damaged=damaged)
    try:
        _rebuild(root, damaged, report)
    except BaseException:  # nothing half-made is left in its place: the damaged index goes back where it was
        for suffix in ("", "-wal", "-shm"):
            (root / (INDEX_FILE + suffix)).unlink(missing_ok=True)
            side = root / (damaged.name + suffix)
            if side.exists():
                side.rename(root / (INDEX_FILE + suffix))
        raise
    return report


def _rebuild(root: Path, damaged: Path, report: SalvageReport) -> None:
    """A fresh index at root holding the damaged one's readable rows, the counts in `report`."""
    source = sqlite3.connect(f"{damaged.resolve().as_uri()}?mode=ro", uri=True)
    try:
        database = Database(root)
        try:
            with database.transaction() as db:  # all or nothing: the keys are checked once every table is in
                target = db.conn
                target.execute("PRAGMA defer_foreign_keys = ON")
                read, unreadable = {}, {}
                for table in _tables(target):
                    read[table], unreadable[table] = _copy_table(source, target, table)
                _drop_orphans(target)
                for table in read:
                    kept = target.execute(f'SELECT COUNT(*) FROM "{table}"').fetchone()[0]
                    report.copied[table] = kept
                    report.lost[table] = unreadable[table] + max(0, read[table] - kept)
        finally:
            database.close()
    finally:
        source.close()


def _tables(conn: sqlite3.Connection) -> list[str]:
    """The fresh index's tables in creation order (parents before children), the schema's version table aside."""
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
                        "AND name != 'schema_version' ORDER BY rowid").fetchall()
    return [name for (name,) in rows]


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')]


def _copy_table(source: sqlite3.Connection, target: sqlite3.Connection, table: str) -> tuple[int, int]:
    """Copy the readable rows of `table` (the columns both indexes have); returns (read, unreadable): unreadable,
    the rowids within the damaged table's bounds whose lookup failed (in a garbled block, a rowid deleted long ago
    may count too: SQLite cannot tell it from a lost row)."""
    try:
        shared = [c for c in _columns(target, table) if c in set(_columns(source, table))]
    except sqlite3.DatabaseError:
        return 0, 0
    if not shared:
        return 0, 0
    names = ", ".join(f'"{c}"' for c in shared)
    insert = f'INSERT OR IGNORE INTO "{table}" ({names}) VALUES ({", ".join("?" for _ in shared)})'
    try:
        low, high = source.execute(f'SELECT MIN(rowid), MAX(rowid) FROM "{table}"').fetchone()
    except sqlite3.DatabaseError:
        low = high = None
    if low is None:  # empty, or its bounds unreadable: whatever a plain scan still gives
        rows = _scan(source, f'SELECT {names} FROM "{table}"')
        target.executemany(insert, rows)
        return len(rows), 0
    copied = lost = 0
    for start in range(low, high + 1, BLOCK_ROWS):
        stop = min(start + BLOCK_ROWS - 1, high)
        query = f'SELECT {names} FROM "{table}" WHERE rowid BETWEEN ? AND ?'
        try:
            rows = source.execute(query, (start, stop)).fetchall()
        except sqlite3.DatabaseError:  # a garbled page in this block: row by row
            rows = []
            for rowid in range(start, stop + 1):
                try:
                    rows.extend(source.execute(f'SELECT {names} FROM "{table}" WHERE rowid = ?', (rowid,)))
                except sqlite3.DatabaseError:
                    lost += 1
        target.executemany(insert, rows)
        copied += len(rows)
    return copied, lost


def _scan(source: sqlite3.Connection, query: str) -> list[tuple]:
    """The rows a plain scan returns before it meets damage."""
    rows: list[tuple] = []
    try:
        for row in source.execute(query):
            rows.append(row)
    except sqlite3.DatabaseError:
        pass
    return rows


def _drop_orphans(target: sqlite3.Connection) -> None:
    """Delete the rows whose parent row was lost, until none is left (their own children go with them)."""
    while True:
        orphans = target.execute("PRAGMA foreign_key_check").fetchall()  # (table, rowid, parent, fk index)
        if not orphans:
            return
        for table, rowid, _, _ in orphans:
            target.execute(f'DELETE FROM "{table}" WHERE rowid = ?', (rowid,))
