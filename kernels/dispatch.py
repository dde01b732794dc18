"""One dispatch point: the engine asks for a backend once and calls its kernels; Triton on CUDA, PyTorch elsewhere."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import layout, reference


@dataclass(frozen=True)
class Backend:
    """The kernels one engine uses, all with the signatures and semantics of `kernels.reference`
    (`expand_groups`: of `kernels.layout.expand_groups`)."""

    name: str
    attention_with_lse: Callable  # no mask on the GPU (kernels.attention_ops.dense_attention)
    causal_attention: Callable  # masked by positions: the new tokens, the sliding windows
    sparse_attention: Callable
    centroid_log_scores: Callable
    merge_attention: Callable
    cluster_keep: Callable
    cluster_keep_among: Callable
    expand_groups: Callable
    cluster_select: Callable  # cluster_keep, then expand_groups of its keep (one fused call on the GPU)
    nearest_centroid: Callable  # k-means' assignment step (engine.kmeans)


REFERENCE = Backend(
    name="torch",
    attention_with_lse=reference.attention_with_lse,
    causal_attention=reference.causal_attention,
    sparse_attention=reference.sparse_attention,
    centroid_log_scores=reference.centroid_log_scores,
    merge_attention=reference.merge_attention,
    cluster_keep=reference.cluster_keep,
    cluster_keep_among=reference.cluster_keep_among,
    expand_groups=layout.expand_groups,
    cluster_select=reference.cluster_select,
    nearest_centroid=reference.nearest_centroid,
)


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
