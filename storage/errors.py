"""Named exceptions raised by the storage layer.

Every error here derives from :class:`StorageError`, so a caller can catch the
whole family at once.  Document loading errors live in
:mod:`storage.documents` because they describe the *input* file, not the store.
"""

from __future__ import annotations

from pathlib import Path


class StorageError(Exception):
    """Base class for every error raised by the store and the blob files."""


class NotFoundError(StorageError, LookupError):
    """A document, context, job, chat or artifact row does not exist."""


class AmbiguousIdError(NotFoundError):
    """An id prefix matches more than one row (give more characters)."""


class MissingArtifactError(StorageError):
    """An artifact file that the index points to is not on disk."""

    def __init__(self, path: str | Path, *, artifact: str | None = None) -> None:
        self.path = str(path)
        self.artifact = artifact
        what = f"artifact {artifact!r} " if artifact else ""
        super().__init__(f"missing {what}file: {self.path} (re-run the ingest to rebuild it)")


class DamagedArtifactError(StorageError):
    """An artifact file exists but its bytes do not match the recorded sha256."""

    def __init__(
        self, path: str | Path, expected: str, actual: str, *, artifact: str | None = None
    ) -> None:
        self.path = str(path)
        self.expected = expected
        self.actual = actual
        self.artifact = artifact
        what = f"artifact {artifact!r} " if artifact else ""
        super().__init__(
            f"damaged {what}file: {self.path} (sha256 {actual[:12]}…,"
            f" expected {expected[:12]}…; re-run the ingest to rebuild it)"
        )
