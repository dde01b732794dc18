"""The SQLite schema of the store's index, as numbered migrations.

Each migration is a SQL script (or a Python step over the rows, for what SQL cannot say) applied once, in order,
inside one transaction; ``schema_version`` records which ones ran.  To change the schema, append
``(N, "ALTER TABLE ...")`` to :data:`MIGRATIONS`; never edit an applied one.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import sqlite_utils

from .documents import Document, without_furniture

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

# 2: several sparse-attention methods per context, each built on demand with its own settings (its artifacts
# are the context's, named "{method}.*"), and artifacts learned once per model, kept apart from documents.
_V2 = """
CREATE TABLE method_builds (
    context_id TEXT NOT NULL REFERENCES contexts(id) ON DELETE CASCADE,
    method TEXT NOT NULL,
    settings TEXT NOT NULL,              -- canonical JSON of the settings that built it
    built_at TEXT NOT NULL,
    PRIMARY KEY (context_id, method)
);

CREATE TABLE model_artifacts (
    model TEXT NOT NULL,
    method TEXT NOT NULL,
    settings_key TEXT NOT NULL,          -- sha256 of the canonical settings JSON
    settings TEXT NOT NULL,              -- that canonical JSON
    name TEXT NOT NULL,
    path TEXT NOT NULL,                  -- relative to the store root, POSIX separators
    sha256 TEXT NOT NULL,                -- of the file bytes
    shape TEXT NOT NULL,                 -- JSON list
    dtype TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    PRIMARY KEY (model, method, settings_key, name)
);
"""

# 3: the jobs table becomes the one record of a job's state (the worker keeps only the upload's bytes, the queue
# order and its timing in memory).  A job may precede its document and context (an upload is extracted on the
# worker), so doc_id is no reference and context_id may be NULL; what the job asked for (name, model, settings,
# methods, truncate) and where it stands (stage, done/total units, what is known of the document, the error and
# its kind) are columns.  Rebuilt as SQLite alters tables: new table, copy, drop, rename.  Old rows take the
# model and settings of their context; their progress fraction becomes done/total out of 100.
_V3 = """
CREATE TABLE jobs_v3 (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    doc_id TEXT NOT NULL,                -- the document's id, known from the bytes before it is stored
    name TEXT NOT NULL,                  -- the file name
    model TEXT NOT NULL,
    settings TEXT NOT NULL,              -- canonical JSON: the context settings asked for
    methods TEXT NOT NULL DEFAULT '[]',  -- JSON list: the methods whose indexes the job builds
    truncate INTEGER NOT NULL DEFAULT 0 CHECK (truncate IN (0, 1)),
    context_id TEXT REFERENCES contexts(id) ON DELETE CASCADE,  -- NULL until the upload is extracted
    status TEXT NOT NULL
        CHECK (status IN ('queued', 'running', 'done', 'failed', 'cancelled')),
    stage TEXT NOT NULL DEFAULT 'queued',
    done INTEGER NOT NULL DEFAULT 0 CHECK (done >= 0),    -- units of the stage done ...
    total INTEGER NOT NULL DEFAULT 0 CHECK (total >= 0),  -- ... of this many
    chars INTEGER,                       -- of the extracted text
    pages INTEGER,
    tokens INTEGER,
    cached INTEGER NOT NULL DEFAULT 0 CHECK (cached IN (0, 1)),  -- done: the context was ready before
    error TEXT,                          -- failed: one plain line
    error_kind TEXT CHECK (error_kind IN ('document', 'too_long', 'internal')),
    pid INTEGER,                         -- process that queued or runs the job
    created_at TEXT NOT NULL,
    started_at TEXT,
    finished_at TEXT,
    updated_at TEXT NOT NULL
);

INSERT INTO jobs_v3 (id, doc_id, name, model, settings, context_id, status, stage, done, total, error, pid,
                     created_at, started_at, finished_at, updated_at)
SELECT j.id, c.doc_id, d.name, c.model, c.settings, j.context_id, j.status, COALESCE(j.stage, 'queued'),
       CAST(ROUND(j.progress * 100) AS INTEGER), 100, j.error, j.pid, j.created_at, j.started_at,
       CASE WHEN j.status IN ('done', 'failed', 'cancelled') THEN j.updated_at END, j.updated_at
FROM jobs j JOIN contexts c ON c.id = j.context_id JOIN documents d ON d.id = c.doc_id;

DROP TABLE jobs;
ALTER TABLE jobs_v3 RENAME TO jobs;
CREATE INDEX jobs_doc_id ON jobs(doc_id);
CREATE INDEX jobs_context_id ON jobs(context_id);
CREATE INDEX jobs_status ON jobs(status);
"""

# 4: the results of `squeeze eval` (every sparse method beside full attention at equal KV budgets), one row per run:
# its summary rows apart (listed without the whole document), and the whole JSON document.
_V4 = """
CREATE TABLE evals (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- in the order they were stored: the newest has the highest id
    model TEXT NOT NULL,                 -- the model id the evaluation ran (its document's "model")
    created_at TEXT NOT NULL,            -- when it was stored
    summary TEXT NOT NULL,               -- JSON list: the document's "summary" rows
    doc TEXT NOT NULL                    -- JSON object: the whole document
);
CREATE INDEX evals_model ON evals(model, id);
"""

# 5: a job carries the settings of the methods it builds that its requester asked for (a user's index settings,
# which are that user's own, not the engine's); '{}' for the engine's defaults.
_V5 = """
ALTER TABLE jobs ADD COLUMN method_settings TEXT NOT NULL DEFAULT '{}';  -- JSON object: method -> its settings
"""

# 6: a chat belongs to whoever started it (the app's browser, or API session: an opaque token), and is listed and
# reopened for that owner only; NULL: started outside the app (the command line), or before chats had owners.
_V6 = """
ALTER TABLE chats ADD COLUMN owner TEXT;
CREATE INDEX chats_doc_owner ON chats(doc_id, owner);
"""

# 7: a document deleted in the app stays, hidden, until its undo window has passed (then it is deleted with its
# contexts, chats and files); NULL: in the library.
_V7 = """
ALTER TABLE documents ADD COLUMN deleted_at TEXT;
"""


def _v8(db: sqlite_utils.Database) -> None:
    """8: a PDF's text leaves out its page furniture (storage.documents.strip_page_furniture). Each stored PDF's
    text is made again from its stored pages, with its page map; where that changes the text, its contexts go (their
    tokens and offsets are the old text's; their files are left for Store.remove_orphan_files), its chats and jobs
    stay without them."""
    for row in list(db.query("SELECT * FROM documents WHERE kind = 'pdf'")):
        stored = Document(name=row["name"], kind=row["kind"], text=row["text"],
                          page_starts=tuple(json.loads(row["page_starts"])), sha256=row["sha256"])
        doc = without_furniture(stored)
        if doc.text == stored.text:
            continue
        db.execute("UPDATE documents SET text = ?, chars = ?, page_starts = ? WHERE id = ?",
                   [doc.text, len(doc.text), json.dumps(list(doc.page_starts)), row["id"]])
        db.execute("UPDATE jobs SET context_id = NULL WHERE doc_id = ?", [row["id"]])
        db.execute("DELETE FROM contexts WHERE doc_id = ?", [row["id"]])  # cascades to artifacts and builds


# 9: an uploaded PDF keeps its original file (a blob under blobs/documents/, whose sha256 is the document's), so the
# app can open it at a cited page; NULL: its bytes were not kept (a text file, or a document stored without them).
_V9 = """
ALTER TABLE documents ADD COLUMN source_path TEXT;     -- relative to the store root, POSIX separators
ALTER TABLE documents ADD COLUMN source_nbytes INTEGER;  -- size of that file
"""

Migration = str | Callable[[sqlite_utils.Database], None]  # SQL statements, or a step over the rows

MIGRATIONS: tuple[tuple[int, Migration], ...] = ((1, _V1), (2, _V2), (3, _V3), (4, _V4), (5, _V5), (6, _V6),
                                                 (7, _V7), (8, _v8), (9, _V9))
SCHEMA_VERSION = MIGRATIONS[-1][0]
