"""The kernel interface: `Backend`, the functions one engine calls, and `REFERENCE`, the PyTorch implementation of
every one of them (kernels.reference; the Triton backend lives in kernels.triton_backend, picked by
kernels.dispatch.backend_for)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
