"""One dispatch point: the engine asks for a backend once and calls its kernels; Triton on CUDA, PyTorch elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels import reference


@dataclass(frozen=True)
class Backend:
    """The kernels one engine uses, all with the signatures and semantics of `kernels.reference`."""

    name: str
    attention_with_lse: Callable
    sparse_attention: Callable
    centroid_log_scores: Callable
    merge_attention: Callable


REFERENCE = Backend(
    name="torch",
    attention_with_lse=reference.attention_with_lse,
    sparse_attention=reference.sparse_attention,
    centroid_log_scores=reference.centroid_log_scores,
    merge_attention=reference.merge_attention,
)


def backend_for(device: torch.device | str, prefer: str | None = None) -> Backend:
    """The backend for tensors on `device`. prefer="torch" forces the reference (tests, debugging)."""
    device = torch.device(device)
    if prefer not in (None, "torch", "triton"):
        raise ValueError(f"unknown kernel backend {prefer!r}; choose 'torch' or 'triton'")
    if prefer == "torch" or device.type != "cuda":
        if prefer == "triton":
            raise ValueError("the triton backend needs CUDA tensors")
        return REFERENCE
    try:
        from kernels import triton_backend  # noqa: PLC0415 - optional until the Triton kernels land
    except ImportError:
        if prefer == "triton":
            raise
        return REFERENCE
    return triton_backend.BACKEND
