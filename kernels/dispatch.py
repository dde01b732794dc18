"""One dispatch point: the engine asks for a backend once and calls its kernels; Triton on CUDA, PyTorch elsewhere."""

from __future__ import annotations

import importlib.util
import os

import torch

from kernels.backend import REFERENCE, TRITON, Backend


def backend_for(device: torch.device | str, prefer: str | None = None) -> Backend:
    """The backend for tensors on `device`. prefer="torch" forces the reference (tests, debugging)."""
    device = torch.device(device)
    if prefer not in (None, "torch", "triton"):
        raise ValueError(f"unknown kernel backend {prefer!r}; choose 'torch' or 'triton'")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # kernels run on the CPU, slowly (tests)
    if prefer == "torch" or (device.type != "cuda" and not (prefer == "triton" and interpreted)):
        if prefer == "triton":
            raise ValueError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for tests on the CPU)")
        return REFERENCE
    if importlib.util.find_spec("triton") is None:
        if prefer == "triton":
            raise ImportError("the triton backend needs the triton package")
        return REFERENCE
    return TRITON
