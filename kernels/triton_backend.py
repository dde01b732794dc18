"""The Triton backend: the lookup, the expansion of kept clusters and the sparse attention on CUDA tensors.

Dense attention over the few new tokens (and the sliding windows) and the log-sum-exp merge stay in PyTorch:
they are small, and the reference runs them on the GPU without host synchronisation.
"""

from __future__ import annotations

from kernels import attention_ops, compact_ops, lookup_ops, reference
from kernels.dispatch import Backend
from kernels.selection import Selection


def _cluster_keep_among(q, centroids, counts, scale, threshold, rows, candidates: Selection):
    return lookup_ops.cluster_keep_list(q, centroids, counts, scale, threshold, rows, candidates.indptr, candidates.indices)


BACKEND = Backend(
    name="triton",
    attention_with_lse=reference.attention_with_lse,
    sparse_attention=attention_ops.sparse_attention,
    centroid_log_scores=reference.centroid_log_scores,
    merge_attention=reference.merge_attention,
    cluster_keep=lookup_ops.cluster_keep,
    cluster_keep_among=_cluster_keep_among,
    expand_groups=compact_ops.expand_groups,
    cluster_select=lookup_ops.cluster_select,
)
