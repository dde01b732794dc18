"""The kernel interface: a `Backend` names where each kernel family's ops live.

A family F is one operation of the engine with its three name-matched files: the Triton kernel kernels/jit/F.py,
its typed wrapper kernels/F_ops.py, and its PyTorch reference kernels/reference/F.py. The wrapper and the reference
expose the same functions with the same signatures and semantics, so `backend.kernel(F).op(...)` runs the Triton
kernels ("triton") or the references ("torch") alike. A new family (a method's own kernel) needs no edit here.
kernels.dispatch.backend_for picks the backend for a device.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType

BACKENDS = ("torch", "triton")


@lru_cache(maxsize=None)
def families() -> tuple[str, ...]:
    """The kernel families: the modules of kernels/reference/ (each has its kernel and wrapper where Triton runs it)."""
    here = Path(__file__).parent / "reference"
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_")))


@dataclass(frozen=True)
class Backend:
    """name: "torch" (kernels.reference.<family>) or "triton" (kernels.<family>_ops)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in BACKENDS:
            raise ValueError(f"unknown kernel backend {self.name!r}; choose one of {BACKENDS}")

    def kernel(self, family: str) -> ModuleType:
        """The module implementing `family`'s ops (imported on first use; a dictionary lookup after that: the
        engine asks for it per layer and step)."""
        return _module(self.name, family)


@lru_cache(maxsize=None)
def _module(backend: str, family: str) -> ModuleType:
    if family not in families():
        raise ValueError(f"unknown kernel family {family!r}; the families are {', '.join(families())}")
    return importlib.import_module(f"kernels.reference.{family}" if backend == "torch" else f"kernels.{family}_ops")


REFERENCE = Backend("torch")
TRITON = Backend("triton")
