"""Typed wrapper of the group expansion kernel: kept clusters -> a Selection of positions, on the device, no host sync."""

from __future__ import annotations

import torch
import triton

from kernels.jit.compact import expand_groups_kernel
from kernels.selection import Selection

BLOCK_G = 32  # groups (clusters) per program
BLOCK_K = 32  # positions written per group per iteration


def expand_groups(keep: torch.Tensor, starts: torch.Tensor, total: int, tail: int = 0) -> Selection:
    """Same result as `kernels.layout.expand_groups`, computed without the host.

    keep: [rows, G] bool; starts: [Hkv, G + 1] int64 (row r uses head r * Hkv // rows, rows a multiple of Hkv);
    total: positions the groups cover (starts[h, -1] for every h; passed in so that nothing is read back).
    Returns Selection(indptr [rows + 1] int64, indices [rows * num_keys] int32 (only the first indptr[-1] are
    meaningful: the capacity is the worst case, every group kept), num_keys = total positions + tail).
    """
    rows, groups = keep.shape
    hkv = starts.shape[0]
    if starts.shape[1] != groups + 1:
        raise ValueError(f"keep has {groups} groups but starts has {starts.shape[1]} columns (expected {groups + 1})")
    if rows % hkv:
        raise ValueError(f"rows ({rows}) must be a multiple of the heads in starts ({hkv})")
    if keep.device != starts.device:
        raise ValueError(f"keep is on {keep.device} but starts on {starts.device}")
    num_keys = total + tail
    head_starts = starts.repeat_interleave(rows // hkv, dim=0) if rows != hkv else starts  # [rows, G + 1]
    sizes = torch.where(keep, head_starts[:, 1:] - head_starts[:, :-1], 0)  # [rows, G] int64
    inclusive = torch.cumsum(sizes, dim=1)
    offsets = inclusive - sizes
    totals = (inclusive[:, -1] if groups else sizes.new_zeros(rows)) + tail
    indptr = torch.nn.functional.pad(torch.cumsum(totals, dim=0), (1, 0))
    out = torch.empty(max(1, rows * num_keys), dtype=torch.int32, device=keep.device)
    if rows:
        grid = (rows, max(1, triton.cdiv(groups, BLOCK_G)))
        expand_groups_kernel[grid](
            keep.to(torch.int8), starts.contiguous(), offsets.contiguous(), indptr, out,
            groups, rows // hkv, tail, BLOCK_G=BLOCK_G, BLOCK_K=BLOCK_K,
        )
    return Selection(indptr=indptr, indices=out, num_keys=num_keys)

