"""One dispatch point: the engine asks for a backend once and calls its kernels; Triton on CUDA, PyTorch elsewhere."""

from __future__ import annotations

import os

import torch

from kernels.backend import REFERENCE, Backend


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
    try:
        from kernels import triton_backend  # noqa: PLC0415 - optional until the Triton kernels land
    except ImportError:
        if prefer == "triton":
            raise
        return REFERENCE
    return triton_backend.BACKEND
