"""The store: a SQLite index (through sqlite-utils) plus a directory of tensor blobs.

Layout of ``Store(root)``::

    root/index.db                                        documents, contexts, artifacts, builds, jobs, chats, evals
    root/blobs/<context_id>/<name>.<hex>.safetensors       a context's artifacts, one tensor per file
    root/blobs/models/<16 hex>/<name>.<hex>.safetensors    artifacts learned once per model and method
    root/blobs/documents/<doc_id>.<hex>.pdf                an uploaded PDF's original file

:class:`Store` owns the connection machinery (:class:`storage.database.Database`:
the one writer, readers per thread, migrations) and one repository per concept
(:mod:`storage.repositories`), reached as attributes::

    store.documents.add(doc)                      store.contexts.context_for(doc_id, model, settings)
    store.artifacts.save(context_id, name, t)     store.methods.mark_built(context_id, method, settings)
    store.models.load(model, method, settings)    store.jobs.create(doc_id, name, model, settings)
    store.chats.add_turn(chat_id, ...)            store.evals.add(model, doc)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import sqlite_utils

from .database import Database
from .repositories import Artifacts, Chats, Contexts, Documents, Evals, Jobs, MethodBuilds, ModelArtifacts


class Store:
    """Documents, prepared contexts and their tensors, method builds, model-level tensors, ingest jobs, chats,
    evaluations.

    ``Store(root)`` opens (or creates) ``root/index.db`` and ``root/blobs/``.
    ``Store(memory=True)`` or ``Store.memory()`` keeps the index in memory and the
    blobs in a temporary directory that :meth:`close` removes; meant for tests.

    Rows come back as plain dicts with JSON columns decoded.  Missing rows raise
    :class:`NotFoundError`; bad arguments raise ``ValueError``.
    """

    def __init__(self, root: str | Path | None = None, *, memory: bool = False) -> None:
        if memory == (root is not None):
            raise ValueError("give Store a root directory, or memory=True (not both)")
        self.database = Database(root, memory=memory)
        self.documents = Documents(self.database)
        self.contexts = Contexts(self.database)
        self.artifacts = Artifacts(self.database)
        self.methods = MethodBuilds(self.database)  # which methods are built for a context, with which settings
        self.models = ModelArtifacts(self.database)  # tensors learned once per model and method
        self.jobs = Jobs(self.database)
        self.chats = Chats(self.database)
        self.evals = Evals(self.database)  # results of `squeeze eval`, per model

    @classmethod
    def memory(cls) -> Store:
        """An in-memory index with a temporary blob directory (for tests)."""
        return cls(memory=True)

    @property
    def root(self) -> Path:
        return self.database.root

    @property
    def blob_dir(self) -> Path:
        return self.database.blob_dir

    @property
    def in_memory(self) -> bool:
        return self.database.in_memory

    @property
    def index_path(self) -> Path | None:
        """``root/index.db``, or None for an in-memory store."""
        return self.database.index_path

    def __repr__(self) -> str:
        return f"Store({'memory=True' if self.in_memory else str(self.root)!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection (and remove the temporary directory of a memory store)."""
        self.database.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite_utils.Database]:
        """One atomic change across repositories (see :meth:`Database.transaction`); nested blocks, including
        the repositories' own, become savepoints."""
        with self.database.transaction() as db:
            yield db

    def schema_version(self) -> int:
        """The highest migration applied to this index."""
        return self.database.schema_version()

    def remove_orphan_files(self, min_age_s: float = 0.0) -> int:
        """Delete blob files that no row (an artifact's, of a context or a model, or a document's kept original
        file) points to; returns how many.

        Such files are left by a crash between writing a file and indexing it
        (or by a failed temporary write).  A file being saved has no row yet:
        call this while nothing is being saved (at start-up), or keep the files
        written in the last ``min_age_s`` seconds (another process may be
        writing them).
        """
        if self.database.read_only:
            return 0
        known = self.artifacts.paths() | self.models.paths() | self.documents.source_paths()
        return self.database.remove_unknown_files(known, min_age_s)
