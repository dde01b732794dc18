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

from kernels.selection import Selection


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


def expand_groups(keep: torch.Tensor, starts: torch.Tensor, total: int, tail: int = 0) -> Selection:
    """Reference: kept groups to the positions they occupy, plus a dense tail every row keeps.

    keep: [rows, G] bool; starts: [Hkv, G + 1] (row r uses head r * Hkv // rows); the positions 0..total-1
    (total = starts[h, -1] for every head) belong to groups, positions total .. total + tail - 1 are the tail.
    Returns a Selection over num_keys = total + tail, sorted within each row.
    """
    rows, groups = keep.shape
    hkv = starts.shape[0]
    head = torch.arange(rows, device=keep.device) * hkv // rows
    n = starts.shape[1] - 1
    if n != groups:
        raise ValueError(f"keep has {groups} groups but starts describes {n}")
    pos = torch.arange(total, device=keep.device)
    group_of = torch.searchsorted(starts[head, 1:].contiguous(), pos.expand(rows, total).contiguous(), right=True)
    mask = torch.gather(keep, 1, group_of.clamp(max=max(groups - 1, 0))) if groups else torch.zeros(rows, total, dtype=torch.bool, device=keep.device)
    mask = torch.cat([mask, torch.ones(rows, tail, dtype=torch.bool, device=keep.device)], dim=1)
    return Selection.from_mask(mask)
