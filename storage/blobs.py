"""Blobs on disk: files written atomically and read back verified.

A blob is one ``.safetensors`` file of tensors (never pickle), or a file of raw
bytes (an uploaded document's original file).  :func:`write_tensors` and
:func:`write_bytes` write a temporary file in the target directory, fsync it,
then ``os.replace`` it into place, so a reader sees either the old file or the
complete new one, never a torn write.  They return the sha256 of the bytes on
disk; :func:`read_tensors` and :func:`read_bytes` refuse a file whose sha256
differs.

An *artifact* is one named tensor in its own blob, indexed by a row with its
path, sha256, shape, dtype and size (a context's, or a model's).  The helpers
below are what the two artifact repositories share: name checks, fresh file
names, the row's file fields, and verified reads whose errors name the artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from .errors import DamagedArtifactError, MissingArtifactError

if TYPE_CHECKING:  # torch loads where tensors are read or written (`squeeze list` stays quick)
    import torch

HASH_CHUNK_BYTES = 8 << 20  # read files in 8 MiB chunks while hashing
TEMP_SUFFIX = ".tmp"  # temporary files are ".<name>.<random>.tmp" beside the target
ARTIFACT_SUFFIX = ".safetensors"
ARTIFACT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
FILE_TOKEN_BYTES = 6  # random hex in artifact file names: <name>.<12 hex>.safetensors


@dataclass(frozen=True)
class BlobInfo:
    """What was written: sha256 (hex) and size in bytes of the file on disk."""

    sha256: str
    nbytes: int


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in chunks (bounded memory for multi-GB blobs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> BlobInfo:
    """Atomically write ``tensors`` to ``path`` as safetensors; returns its :class:`BlobInfo`.

    Tensors are detached, moved to CPU and made contiguous first; tensors that
    share storage with an earlier one are cloned (safetensors refuses aliases).
    """
    from safetensors.torch import save_file  # noqa: PLC0415

    return _write_atomic(Path(path), lambda tmp: save_file(_prepare(tensors), tmp))


def write_bytes(path: str | Path, data: bytes) -> BlobInfo:
    """Atomically write ``data`` to ``path``; returns its :class:`BlobInfo`."""
    return _write_atomic(Path(path), lambda tmp: tmp.write_bytes(data))


def _write_atomic(path: Path, write: Callable[[Path], object]) -> BlobInfo:
    """``write`` a temporary file beside ``path``, fsync it, then move it into place (see the module docstring)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        info = BlobInfo(sha256=file_sha256(tmp), nbytes=tmp.stat().st_size)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return info


def read_tensors(
    path: str | Path, expected_sha256: str, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Load a safetensors file after checking its sha256.

    Raises :class:`MissingArtifactError` if the file is absent and
    :class:`DamagedArtifactError` if its bytes are not the expected ones.
    """
    path = Path(path)
    try:
        actual = file_sha256(path)
    except FileNotFoundError:
        raise MissingArtifactError(path) from None
    if actual != expected_sha256:
        raise DamagedArtifactError(path, expected_sha256, actual)
    from safetensors.torch import load_file  # noqa: PLC0415

    return load_file(path, device=str(device))


def read_bytes(path: str | Path, expected_sha256: str) -> bytes:
    """The bytes of a file whose sha256 is ``expected_sha256``.

    Raises :class:`MissingArtifactError` if the file is absent and
    :class:`DamagedArtifactError` if its bytes are not the expected ones.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise MissingArtifactError(path) from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise DamagedArtifactError(path, expected_sha256, actual)
    return data


# ---------------------------------------------------------------------- artifacts


def check_artifact(name: str, tensor: Any) -> None:
    """``ValueError`` for a name that is not a safe file name, ``TypeError`` for a value that is not a tensor."""
    if not isinstance(name, str) or not ARTIFACT_NAME.fullmatch(name):
        raise ValueError(f"artifact name must match {ARTIFACT_NAME.pattern}, got {name!r}")
    import torch  # noqa: PLC0415

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"artifact {name!r} must be a torch.Tensor, got {type(tensor).__name__}")


def artifact_path(folder: PurePosixPath, name: str) -> PurePosixPath:
    """A fresh file for artifact ``name`` in ``folder``: ``<name>.<random hex>.safetensors``.

    Every save gets its own file, so a row never points at a file that a
    concurrent save of the same name replaced.
    """
    return folder / f"{name}.{secrets.token_hex(FILE_TOKEN_BYTES)}{ARTIFACT_SUFFIX}"


def write_artifact(root: Path, rel: PurePosixPath, name: str, tensor: torch.Tensor) -> dict[str, Any]:
    """Write ``tensor`` as ``name`` to ``root/rel``; returns the file fields of its index row
    (path, sha256, shape as JSON, dtype, nbytes)."""
    info = write_tensors(root / rel, {name: tensor})
    return {
        "path": rel.as_posix(),
        "sha256": info.sha256,
        "shape": json.dumps(list(tensor.shape)),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "nbytes": info.nbytes,
    }


def read_artifact(
    root: Path, row: Mapping[str, Any], label: str, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """The tensor of an artifact row, after checking the file's sha256; errors name the artifact ``label``."""
    try:
        tensors = read_tensors(root / row["path"], row["sha256"], device=device)
    except DamagedArtifactError as exc:
        raise DamagedArtifactError(exc.path, exc.expected, exc.actual, artifact=label) from None
    except MissingArtifactError as exc:
        raise MissingArtifactError(exc.path, artifact=label) from None
    return tensors[row["name"]]


def check_artifact_file(root: Path, row: Mapping[str, Any], label: str) -> None:
    """A quick check that an artifact row's file exists with its recorded size (no hashing unless it differs)."""
    path = root / row["path"]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise MissingArtifactError(path, artifact=label) from None
    if size != row["nbytes"]:
        raise DamagedArtifactError(path, row["sha256"], file_sha256(path), artifact=label)


def _prepare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two tensors sharing storage."""
    import torch  # noqa: PLC0415

    out: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        t = tensor.detach().to("cpu").contiguous()
        storage = t.untyped_storage().data_ptr()
        if t.numel() and storage in seen_storages:
            t = t.clone()
        seen_storages.add(storage)
        out[name] = t
    return out


def _fsync_dir(directory: Path) -> None:
    """Persist the rename itself (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
