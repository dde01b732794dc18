"""Typed wrappers of the group expansion kernels: kept clusters -> a Selection of positions, on the device, no host
sync. plan_expansion / launch_expansions: the expansion planned now and launched later, those of several lookups of
one kind in one launch (BATCHED: kernels.centroid_ops.select_now)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.jit.compact import expand_groups_kernel, group_block_sums_kernel
from kernels.launch import dependent_launch
from kernels.selection import Fixed, Selection
from kernels.tables import Keep, batch_tables

BLOCK_G = 256  # groups (clusters) per program of the standalone expansion
# Write tiles of the expansion: a step writes SUB_G groups x BLOCK_K positions, up to the longest of its SUB_G groups.
# H200, 512K tokens, 8 rows, 26K clusters of ~20 keys (engine/bench/tune.py): SUB_G 128 x BLOCK_K 8
# 8.9 us, 256 x 8 9.2, 32 x 32 20.2. Wide, short steps: the time goes to each step's loads of
# keep/starts, which wait on the stores before them, not to the masked lanes.
BLOCK_K = 8
SUB_G = 128
LARGE_GROUP = 64  # mean positions per group from which the large-group tiles are used
# Large groups (Saap's buckets, hundreds of keys): one group at a time, 512 positions per step, so that a program's
# steps are those of its kept groups only. H100, 128K tokens, 8 rows, 10% kept: 256 buckets 5.2 us
# (16 groups x 64 positions, the small-group tiles: 10.9), 1024 buckets 5.9 (7.3).
LARGE_BLOCK_G = 16
LARGE_SUB_G = 1
LARGE_BLOCK_K = 512
BLOCK_T = 64  # tail (or fixed-list) positions a program writes per step; a row's programs share them
SUM_TILE = 2048  # block sums an expansion program reads per step


def _check(keep: torch.Tensor, starts: torch.Tensor, fixed: Fixed | None = None) -> None:
    rows, groups = keep.shape
    hkv = starts.shape[0]
    if fixed is not None:
        fixed.check(hkv, keep.device)
    if starts.shape[1] != groups + 1:
        raise ValueError(f"keep has {groups} groups but starts has {starts.shape[1]} columns (expected {groups + 1})")
    if rows % hkv:
        raise ValueError(f"rows ({rows}) must be a multiple of the heads in starts ({hkv})")
    if keep.device != starts.device:
        raise ValueError(f"keep is on {keep.device} but starts on {starts.device}")


def expand_groups(keep: torch.Tensor, starts: torch.Tensor, total: int, tail: int = 0, *,
                  fixed: Fixed | None = None) -> Selection:
    """Same result as `kernels.layout.expand_groups`, computed without the host.

    keep: [rows, G] bool; starts: [Hkv, G + 1] int64 (row r uses head r * Hkv // rows, rows a multiple of Hkv);
    total: positions the groups cover (starts[h, -1] for every h; passed in so that nothing is read back);
    fixed: rows whose head it marks read its list instead (kernels.selection.Fixed).
    Returns Selection(indptr [rows + 1] int64, indices [rows * num_keys] int32 (only the first indptr[-1] are
    meaningful: the capacity is the worst case, every group kept), num_keys = total positions + tail).
    """
    _check(keep, starts, fixed)
    rows, groups = keep.shape
    block_g, sub, block_k = write_tiles(total, groups)
    nb = max(1, triton.cdiv(groups, block_g))
    block_sums = torch.empty(rows, nb, dtype=torch.int64, device=keep.device)
    if rows:
        keep, starts = keep.contiguous(), starts.contiguous()
        group_block_sums_kernel[(rows, nb)](keep, starts, block_sums, groups, nb, rows // starts.shape[0],
                                           BLOCK_G=block_g, num_stages=1, **dependent_launch(keep.device))
    return expand_block_sums(keep, starts, block_sums, block_g, total, tail, fixed=fixed, sub=sub, block_k=block_k)


def write_tiles(total: int, groups: int) -> tuple[int, int, int]:
    """(groups per program, groups written together, positions per group and step) for groups of total / groups
    positions on average: small groups (squeeze's clusters, ~20 keys) many to a program; large ones (Saap's buckets,
    hundreds of keys) few to a program, one at a time, 512 positions per step, so that a row's work spreads over
    many programs and a step writes one kept group's positions, not masked lanes of many."""
    if groups and total >= LARGE_GROUP * groups:
        return LARGE_BLOCK_G, LARGE_SUB_G, LARGE_BLOCK_K
    return BLOCK_G, SUB_G, BLOCK_K


def expand_block_sums(keep: torch.Tensor, starts: torch.Tensor, block_sums: torch.Tensor, block_g: int, total: int,
                      tail: int = 0, *, fixed: Fixed | None = None, sub: int = SUB_G,
                      block_k: int = BLOCK_K) -> Selection:
    """The expansion step alone, from the kept positions of each block of `block_g` groups (computed by
    group_block_sums_kernel or by the lookup's score pass). keep, starts, total, tail: as expand_groups;
    block_sums: [rows, cdiv(G, block_g)] int64; sub, block_k: write tiles (tuning). Returns the same Selection as
    expand_groups."""
    selection, expansion = plan_expansion(keep, starts, block_sums, block_g, total, tail, fixed=fixed, sub=sub,
                                          block_k=block_k)
    if expansion is not None:
        launch_expansions([expansion])
    return selection


@dataclass(frozen=True)
class Expansion:
    """An expansion planned (plan_expansion), its outputs allocated: what launch_expansions launches. The tensors
    as the kernel reads them; fixed_args: (lists, on, W) or dummies."""

    keep: torch.Tensor
    starts: torch.Tensor
    block_sums: torch.Tensor
    indptr: torch.Tensor
    out: torch.Tensor
    fixed_args: tuple
    tail: int
    block_g: int
    sub: int
    block_k: int
    has_fixed: bool

    @property
    def nb(self) -> int:
        return self.block_sums.shape[1]

    def kind(self) -> tuple:
        """What expansions launched together share: the rows per head, the tiles, fixed lists or none."""
        return (self.keep.device, self.keep.shape[0], self.starts.shape[0], self.block_g, self.sub, self.block_k,
                self.has_fixed)

    def params(self) -> list[int]:
        """Row of EXPAND_PARAMS."""
        return [self.keep.shape[1], self.nb, self.tail, self.fixed_args[2]]


# Row b of a batched expansion's tables (kernels/jit/compact.py reads them by these positions)
EXPAND_POINTERS = ("keep", "starts", "block_sums", "indptr", "out", "fixed", "fixed_on")
EXPAND_PARAMS = ("G", "NB", "tail", "W")
EXPAND_TILES = ("keep", "out")  # the entries taken as 16-byte aligned under ALIGNED (kernels/tables.py)


def plan_expansion(keep: torch.Tensor, starts: torch.Tensor, block_sums: torch.Tensor, block_g: int, total: int,
                   tail: int = 0, *, fixed: Fixed | None = None, sub: int = SUB_G,
                   block_k: int = BLOCK_K) -> tuple[Selection, Expansion | None]:
    """expand_block_sums checked and planned, its Selection allocated (filled by launch_expansions; None to launch
    where there are no rows). keep and block_sums are read at the launch: where they are written after this, pass
    them contiguous (a copy made here would hold what they held before)."""
    _check(keep, starts, fixed)
    rows, groups = keep.shape
    nb = max(1, triton.cdiv(groups, block_g))
    if tuple(block_sums.shape) != (rows, nb) or block_sums.dtype != torch.int64:
        raise ValueError(f"block_sums must be int64 [rows, cdiv(G, block_g)] = [{rows}, {nb}], got "
                         f"{block_sums.dtype} {tuple(block_sums.shape)}")
    num_keys = total + tail
    dev = keep.device
    indptr = (torch.zeros if rows == 0 else torch.empty)(rows + 1, dtype=torch.int64, device=dev)
    out = torch.empty(max(1, rows * num_keys), dtype=torch.int32, device=dev)
    selection = Selection(indptr=indptr, indices=out, num_keys=num_keys)
    if not rows:
        return selection, None
    return selection, Expansion(keep.contiguous(), starts.contiguous(), block_sums.contiguous(), indptr, out,
                                fixed.launch_args() if fixed is not None else (out, out, 0), int(tail), block_g,
                                min(sub, block_g), block_k, fixed is not None)


def sum_tiles(rows: int, nb: int) -> tuple[int, int]:
    """(RCHUNK, BLOCK_NB) of an expansion of `rows` rows and up to `nb` blocks: the rows of block sums a program
    reads per step, and the blocks, a power of two (the block sums' integer sums: any order)."""
    block_nb = max(2, triton.next_power_of_2(nb))
    return max(1, min(triton.next_power_of_2(rows), SUM_TILE // block_nb)), block_nb


def launch_expansions(plans: list[Expansion], keep: Keep = None) -> None:
    """expand_groups_kernel for expansions of one kind (Expansion.kind): one as it is, several BATCHED (their
    tensors and values in tables; keep: as kernels.union_ops.union_attention_batch's)."""
    e = plans[0]
    rows = e.keep.shape[0]
    rchunk, block_nb = sum_tiles(rows, max(p.nb for p in plans))
    batch = {}
    if len(plans) > 1:
        batch = batch_tables(plans, lambda p: (p.keep, p.starts, p.block_sums, p.indptr, p.out, *p.fixed_args[:2]),
                             Expansion.params, (EXPAND_POINTERS, EXPAND_PARAMS), e.keep.device, keep,
                             tiles=EXPAND_TILES)
    expand_groups_kernel[(rows, max(p.nb for p in plans), len(plans))](
        e.keep, e.starts, e.block_sums, e.indptr, e.out, e.keep.shape[1], e.nb, rows // e.starts.shape[0], e.tail,
        *e.fixed_args, BLOCK_G=e.block_g, BLOCK_K=e.block_k, SUB=e.sub,
        RCHUNK=rchunk, BLOCK_NB=block_nb, BLOCK_T=BLOCK_T,
        HAS_FIXED=e.has_fixed, num_stages=1,  # no pipeline buffers: they would only cost occupancy
        **dependent_launch(e.keep.device), **batch,
    )
