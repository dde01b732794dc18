"""The fixed context stored as an inverted file: each cluster's keys (and values) contiguous, so a lookup's kept
clusters become a short list of ranges that the GPU expands into key positions without the host.

Permuted position p of KV head h holds the key at original position `order[h, p]`. Cluster c of head h occupies
permuted positions [starts[h, c], starts[h, c + 1]); the dense tail (the last context tokens, never clustered)
follows all clusters, at [Lc, Lc + tail), in its original order. Attention over a set of keys does not depend on
their order, so the engine attends over the permuted K/V with selections of permuted positions.

The same "kept groups -> positions" expansion serves the hierarchical lookup: level-2 clusters are numbered so
that the children of each level-1 cluster are contiguous (see HierarchicalSqueezePolicy.build), and the children
of the kept level-1 clusters are the level-2 candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ClusterLayout:
    """order: [Hkv, Lc + tail] int64 original position of each permuted position; starts: [Hkv, C + 1] int64."""

    order: torch.Tensor
    starts: torch.Tensor
    tail: int

    @staticmethod
    def from_labels(labels: torch.Tensor, num_clusters: int, tail: int) -> "ClusterLayout":
        """labels: [Hkv, Lc] int64 cluster of each clustered key (keys 0..Lc-1; the tail Lc..Lc+tail-1 follows)."""
        hkv, lc = labels.shape
        order = torch.argsort(labels, dim=1, stable=True)  # [Hkv, Lc]: by cluster, original order within one
        tail_pos = torch.arange(lc, lc + tail, device=labels.device).expand(hkv, tail)
        return ClusterLayout(order=torch.cat([order, tail_pos], dim=1), starts=group_starts(labels, num_clusters), tail=tail)

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        """x: [Hkv, Lc + tail, D] in original order -> the same rows in permuted order (contiguous)."""
        return torch.gather(x, 1, self.order[:, :, None].expand(-1, -1, x.shape[2]))


def group_starts(labels: torch.Tensor, num_groups: int) -> torch.Tensor:
    """labels: [H, N] group of each member -> [H, num_groups + 1] int64 start of each group once sorted by group."""
    sizes = torch.zeros(labels.shape[0], num_groups, dtype=torch.int64, device=labels.device)
    sizes.scatter_add_(1, labels, torch.ones_like(labels))
    return torch.nn.functional.pad(torch.cumsum(sizes, dim=1), (1, 0))
