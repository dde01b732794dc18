"""The SQLite schema of the store's index, as numbered migrations.

Each migration is a SQL script applied once, in order, inside one
transaction; ``schema_version`` records which ones ran.  To change the
schema, append ``(2, "ALTER TABLE ...")`` to :data:`MIGRATIONS`; never edit an
applied one.
"""

from __future__ import annotations

VERSION_TABLE_SQL = """
CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER PRIMARY KEY,
    applied_at TEXT NOT NULL
)
"""

_V1 = """
CREATE TABLE documents (
    id TEXT PRIMARY KEY,                 -- first 16 hex chars of sha256
    sha256 TEXT NOT NULL UNIQUE,         -- of the raw file bytes
    name TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('pdf', 'txt', 'md')),
    pages INTEGER NOT NULL,
    chars INTEGER NOT NULL,
    page_starts TEXT NOT NULL,           -- JSON list of char offsets
    text TEXT NOT NULL,                  -- the extracted, normalised text
    added_at TEXT NOT NULL
);

CREATE TABLE contexts (
    id TEXT PRIMARY KEY,                 -- first 16 hex chars of key
    doc_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    model TEXT NOT NULL,
    settings TEXT NOT NULL,              -- canonical JSON
    key TEXT NOT NULL UNIQUE,            -- sha256 of [doc sha256, model, settings]
    status TEXT NOT NULL CHECK (status IN ('pending', 'running', 'ready', 'failed')),
    tokens INTEGER,
    error TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE INDEX contexts_doc_id ON contexts(doc_id);

CREATE TABLE artifacts (
    context_id TEXT NOT NULL REFERENCES contexts(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    path TEXT NOT NULL,                  -- relative to the store root, POSIX separators
    sha256 TEXT NOT NULL,                -- of the file bytes
    shape TEXT NOT NULL,                 -- JSON list
    dtype TEXT NOT NULL,                 -- e.g. 'bfloat16'
    nbytes INTEGER NOT NULL,             -- size of the file
    PRIMARY KEY (context_id, name)
);

CREATE TABLE jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    context_id TEXT NOT NULL REFERENCES contexts(id) ON DELETE CASCADE,
    status TEXT NOT NULL
        CHECK (status IN ('queued', 'running', 'done', 'failed', 'cancelled')),
    stage TEXT,
    progress REAL NOT NULL DEFAULT 0 CHECK (progress BETWEEN 0 AND 1),
    message TEXT,
    error TEXT,
    pid INTEGER,                         -- process that queued or runs the job
    created_at TEXT NOT NULL,
    started_at TEXT,
    updated_at TEXT NOT NULL
);
CREATE INDEX jobs_context_id ON jobs(context_id);
CREATE INDEX jobs_status ON jobs(status);

CREATE TABLE chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    doc_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    context_id TEXT REFERENCES contexts(id) ON DELETE SET NULL,
    created_at TEXT NOT NULL,
    title TEXT
);
CREATE INDEX chats_doc_id ON chats(doc_id);

CREATE TABLE turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,                -- 0, 1, 2, ... within the chat
    question TEXT NOT NULL,
    answer TEXT NOT NULL,
    method TEXT,
    sparsity REAL,
    stats TEXT NOT NULL,                 -- JSON object
    created_at TEXT NOT NULL,
    UNIQUE (chat_id, idx)
);
"""

MIGRATIONS: tuple[tuple[int, str], ...] = ((1, _V1),)
SCHEMA_VERSION = MIGRATIONS[-1][0]
