"""Reference of the expansion of kept groups into the positions they occupy (kernels/jit/compact.py)."""

from __future__ import annotations

import torch

from kernels.selection import Fixed, Selection


def expand_groups(keep: torch.Tensor, starts: torch.Tensor, total: int, tail: int = 0, *,
                  fixed: Fixed | None = None) -> Selection:
    """Reference: kept groups to the positions they occupy, plus a dense tail every row keeps.

    keep: [rows, G] bool; starts: [Hkv, G + 1] (row r uses head r * Hkv // rows); the positions 0..total-1
    (total = starts[h, -1] for every head) belong to groups, positions total .. total + tail - 1 are the tail.
    fixed: the rows of the heads it marks read its lists instead of their groups and the tail.
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
    selection = Selection.from_mask(mask)
    return selection if fixed is None else fixed.apply(selection)
