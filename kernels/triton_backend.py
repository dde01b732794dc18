"""The Triton backend: the lookup, the expansion of kept clusters, the sparse attention and every dense attention
on CUDA tensors (no score matrix is materialised: memory O(L * D)).

The log-sum-exp merge of two parts is one kernel that writes the layer's output in the model's dtype and layout.
"""

from __future__ import annotations

from kernels import assign_ops, attention_ops, causal_ops, compact_ops, lookup_ops, merge_ops, reference
from kernels.backend import Backend
from kernels.selection import Selection


def _cluster_keep_among(q, centroids, counts, scale, threshold, rows, candidates: Selection):
    return lookup_ops.cluster_keep_list(q, centroids, counts, scale, threshold, rows, candidates.indptr, candidates.indices)


def _attention_with_lse(q, k, v, scale, mask=None):
    """reference.attention_with_lse: without a mask through the dense mode of the sparse kernel; a boolean mask
    (tests, tools; the engine masks by positions through causal_attention) falls back to the reference."""
    if mask is not None:
        return reference.attention_with_lse(q, k, v, scale, mask)
    return attention_ops.dense_attention(q, k, v, scale)


BACKEND = Backend(
    name="triton",
    attention_with_lse=_attention_with_lse,
    causal_attention=causal_ops.causal_attention,
    sparse_attention=attention_ops.sparse_attention,
    centroid_log_scores=reference.centroid_log_scores,
    merge_attention=merge_ops.merge_attention,
    cluster_keep=lookup_ops.cluster_keep,
    cluster_keep_among=_cluster_keep_among,
    expand_groups=compact_ops.expand_groups,
    cluster_select=lookup_ops.cluster_select,
    nearest_centroid=assign_ops.nearest_centroid,
)
