"""Storage: documents in, tensors and chats on disk.

* :mod:`storage.documents` turns a PDF / text / Markdown file into a :class:`Document`.
* :mod:`storage.blobs` writes tensors atomically as safetensors and reads them back verified.
* :mod:`storage.store` indexes everything in SQLite (:class:`Store`): its connection machinery is
  :mod:`storage.database`, its queries :mod:`storage.repositories` (one module per concept).
* :mod:`storage.errors` holds the store's named exceptions.
"""

from .blobs import BlobInfo, read_tensors, write_tensors
from .documents import (
    CorruptDocumentError,
    Document,
    DocumentError,
    EmptyDocumentError,
    EncryptedPDFError,
    NoTextError,
    NotAFileError,
    UnsupportedTypeError,
    document_kind,
    load_document,
    load_document_bytes,
    read_document,
)
from .errors import AmbiguousIdError, DamagedArtifactError, MissingArtifactError, NotFoundError, StorageError
from .repositories.jobs import INTERRUPTED
from .salvage import SalvageReport, salvage_index
from .store import Store

__all__ = [
    "AmbiguousIdError",
    "BlobInfo",
    "CorruptDocumentError",
    "DamagedArtifactError",
    "Document",
    "DocumentError",
    "EmptyDocumentError",
    "EncryptedPDFError",
    "INTERRUPTED",
    "MissingArtifactError",
    "NoTextError",
    "NotAFileError",
    "NotFoundError",
    "SalvageReport",
    "StorageError",
    "Store",
    "UnsupportedTypeError",
    "document_kind",
    "load_document",
    "load_document_bytes",
    "read_document",
    "read_tensors",
    "salvage_index",
    "write_tensors",
]
