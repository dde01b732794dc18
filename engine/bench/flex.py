"""FlexAttention given the same selection: the peer that a sparse prefill kernel must beat (DESIGN.md).

`flex_attention` (torch.nn.attention.flex_attention, compiled) runs over 128-key blocks; a block mask built from a
Selection lists, per query head, the key blocks that hold at least one selected key ("full" blocks, every key
selected, skip the mask function; "partial" ones call it). The selection is the same for every question token of a
row, as the engine's prefill selection is, so every query block gets the same key blocks. This is what a user of
FlexAttention would run to reproduce our attention exactly, on the same cluster-permuted K/V.
"""

from __future__ import annotations

import torch

from kernels.selection import Selection

BLOCK = 128  # FlexAttention's default block size, for queries and keys


def block_mask_from_selection(selection: Selection, hq: int, lq: int):
    """selection: rows in {Hq, Hkv} over num_keys keys -> (BlockMask [1, Hq, lq, num_keys], keep [rows, num_keys]
    bool). num_keys and lq must be multiples of BLOCK."""
    from torch.nn.attention.flex_attention import BlockMask

    keys = selection.num_keys
    if keys % BLOCK or lq % BLOCK:
        raise ValueError(f"keys ({keys}) and question tokens ({lq}) must be multiples of {BLOCK}")
    keep = selection.to_mask()  # [rows, keys]
    group = hq // selection.rows
    per_block = keep.view(selection.rows, keys // BLOCK, BLOCK).sum(dim=-1)  # [rows, key blocks]
    q_blocks = lq // BLOCK

    def listing(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """chosen [rows, key blocks] bool -> (num [1, Hq, q_blocks] int32, indices [1, Hq, q_blocks, kb] int32),
        the chosen blocks first in ascending order."""
        order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True).to(torch.int32)
        num = chosen.sum(dim=1).to(torch.int32)
        num = num.repeat_interleave(group)[None, :, None].expand(1, hq, q_blocks).contiguous()
        idx = order.repeat_interleave(group, dim=0)[None, :, None, :].expand(1, hq, q_blocks, -1).contiguous()
        return num, idx

    partial_num, partial_idx = listing((per_block > 0) & (per_block < BLOCK))
    full_num, full_idx = listing(per_block == BLOCK)

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[h // group, kv_idx]

    mask = BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(lq, keys))
    return mask, keep


def flex_attention_fn():
    """The compiled flex_attention (compiled once per process by torch.compile's cache)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_sparse(flex, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """q [Hq, Lq, D], k/v [Hkv, L, D] (the cluster-permuted fixed context) -> out [Hq, Lq, D]."""
    return flex(q[None], k[None], v[None], block_mask=mask, scale=scale, enable_gqa=True)[0]

