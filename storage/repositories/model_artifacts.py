"""Tensors learned once per model and method, not per document (``store.models``), e.g. trained gates.

A set of them is keyed by (model, method, settings): the same model and method
with other settings is another set.  ``settings_key`` is the sha256 of the
settings' canonical JSON.  Files live apart from the contexts' blobs::

    root/blobs/models/<16 hex of sha256(model|method|settings_key)>/<name>.<hex>.safetensors

and are saved and verified like a context's artifacts (file first, row second;
checksum on load).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from ..blobs import artifact_path, check_artifact, read_artifact, write_artifact
from ..database import BLOB_DIR, Database, canonical_json, first

if TYPE_CHECKING:  # (torch loads where tensors are read or written: `squeeze list` stays quick)
    import torch

MODEL_BLOB_DIR = "models"  # under blobs/; a context's folder is 16 hex chars, so the two never collide
FOLDER_CHARS = 16
_KEY = "model = ? AND method = ? AND settings_key = ?"


class ModelArtifacts:
    """Model-level artifacts of (model, method, settings).  Rows come back with ``shape`` and ``settings``
    decoded."""

    def __init__(self, database: Database) -> None:
        self.database = database

    @staticmethod
    def settings_key(settings: dict[str, Any]) -> str:
        """sha256 (hex) of the canonical JSON of ``settings``."""
        return hashlib.sha256(canonical_json(settings).encode()).hexdigest()

    @staticmethod
    def folder(model: str, method: str, settings_key: str) -> PurePosixPath:
        """The root-relative folder of one set's files."""
        digest = hashlib.sha256(f"{model}|{method}|{settings_key}".encode()).hexdigest()
        return PurePosixPath(BLOB_DIR, MODEL_BLOB_DIR, digest[:FOLDER_CHARS])

    def save(
        self, model: str, method: str, settings: dict[str, Any], name: str, tensor: torch.Tensor
    ) -> dict[str, Any]:
        """Write one tensor (atomically, under a fresh file name), then upsert its row; returns the row.

        The file of a row being replaced is deleted after the commit.
        """
        check_artifact(name, tensor)
        key = self.settings_key(settings)
        rel = artifact_path(self.folder(model, method, key), name)
        row = {"model": model, "method": method, "settings_key": key, "name": name,
               "settings": canonical_json(settings),
               **write_artifact(self.database.root, rel, name, tensor)}
        try:
            with self.database.transaction() as db:
                old = first(db, f"SELECT path FROM model_artifacts WHERE {_KEY} AND name = ?",
                            [model, method, key, name])
                db.table("model_artifacts").upsert(row, pk=("model", "method", "settings_key", "name"))
        except BaseException:
            self.database.unlink([rel.as_posix()])  # not indexed: nothing may point at it
            raise
        if old is not None:
            self.database.unlink([old["path"]])
        return _row_dict(row)

    def list(self, model: str, method: str, settings: dict[str, Any]) -> list[dict[str, Any]]:
        """The rows of one set, by name."""
        with self.database.reading() as db:
            rows = db.query(f"SELECT * FROM model_artifacts WHERE {_KEY} ORDER BY name",
                            [model, method, self.settings_key(settings)])
            return [_row_dict(r) for r in rows]

    def names(self, model: str, method: str, settings: dict[str, Any]) -> list[str]:
        """The names in one set, sorted ([] when none)."""
        return [r["name"] for r in self.list(model, method, settings)]

    def load(
        self, model: str, method: str, settings: dict[str, Any], device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Every tensor of one set by name ({} when none), each file's sha256 verified.

        :class:`MissingArtifactError` / :class:`DamagedArtifactError` name the
        artifact as ``<model>/<method>/<name>``.
        """
        root = self.database.root
        return {r["name"]: read_artifact(root, r, f"{model}/{method}/{r['name']}", device)
                for r in self.list(model, method, settings)}

    def remove(self, model: str, method: str, settings: dict[str, Any] | None = None) -> int:
        """Delete the artifacts of (model, method) with `settings` (every set of them when None): rows, then files
        and their emptied folders; returns how many."""
        where, args = ("model = ? AND method = ?", [model, method]) if settings is None else \
            (_KEY, [model, method, self.settings_key(settings)])
        with self.database.transaction() as db:
            paths = [r["path"] for r in db.query(f"SELECT path FROM model_artifacts WHERE {where}", args)]
            db.execute(f"DELETE FROM model_artifacts WHERE {where}", args)
        self.database.unlink(paths, prune_dirs=True)
        return len(paths)

    def paths(self) -> set[str]:
        """The file of every row (root-relative)."""
        with self.database.reading() as db:
            return {r["path"] for r in db.query("SELECT path FROM model_artifacts")}


def _row_dict(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "shape": json.loads(row["shape"]), "settings": json.loads(row["settings"])}
