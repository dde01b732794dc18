"""Typed wrapper of the group expansion kernel: kept clusters -> a Selection of positions, on the device, no host sync."""

from __future__ import annotations

import torch
import triton

from kernels.jit.compact import expand_groups_kernel, group_block_sums_kernel
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
    dev = keep.device
    nb = max(1, triton.cdiv(groups, BLOCK_G))
    block_sums = torch.empty(rows, nb, dtype=torch.int64, device=dev)
    totals = torch.zeros(rows, dtype=torch.int64, device=dev)
    indptr = torch.zeros(rows + 1, dtype=torch.int64, device=dev) if rows == 0 else torch.empty(rows + 1, dtype=torch.int64, device=dev)
    out = torch.empty(max(1, rows * num_keys), dtype=torch.int32, device=dev)
    if rows:
        keep, starts = keep.contiguous(), starts.contiguous()
        grid = (rows, nb)
        group_block_sums_kernel[grid](keep, starts, block_sums, totals, groups, nb, rows // hkv, BLOCK_G=BLOCK_G)
        expand_groups_kernel[grid](
            keep, starts, block_sums, totals, indptr, out, groups, nb, rows // hkv, tail,
            BLOCK_G=BLOCK_G, BLOCK_K=BLOCK_K, BLOCK_R=max(2, triton.next_power_of_2(rows)),
            BLOCK_NB=max(2, triton.next_power_of_2(nb)),
        )
    return Selection(indptr=indptr, indices=out, num_keys=num_keys)
