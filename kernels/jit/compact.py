"""Expansion of kept groups (clusters, or level-1 clusters' children) into the positions they occupy.

Two steps over a (row, block of BLOCK_G groups) grid, both fully parallel and free of atomics:
    block sums   kept positions per (row, block): `group_block_sums_kernel`, or the centroid lookup's score pass,
                 which computes them while it decides keep (kernels.centroid_ops.cluster_select), saving a launch
    expansion    `expand_groups_kernel`: each block finds its place in the packed list from the block sums (every
                 block of the rows before, then the blocks before it in its row, then a scan inside the block)
                 and writes its kept groups' positions; the row's blocks write its tail (or, for a row of a head
                 marked fixed, that head's list instead of its groups and tail: DuoAttention's streaming windows)
                 BLOCK_T positions each in turn, and its first block writes indptr; BATCHED, the expansions of
                 several lookups in one launch (kernels.compact_ops.launch_expansions).
"""

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior
from kernels.tables import table_pointer

# Arguments that follow a context's size, not specialised on (kernels/README.md)
BLOCK_SUMS_SIZES = ["G", "NB"]
EXPAND_SIZES = ["G", "NB", "W"]


@triton.jit
def kept_sizes(keep_ptr, starts_ptr, r, h, g, G, stride_kr, CACHE: tl.constexpr):
    """Groups g [BLOCK] of row r (head h): sizes (0 where not kept or g >= G) and starts, both int64 [BLOCK];
    CACHE: keep's load's cache modifier ("", or ".cg": keep written by other programs of the same launch; always
    passed: Triton 3.6 cannot take a string default of a nested function's constexpr)."""
    m = g < G
    kept = tl.load(keep_ptr + r * stride_kr + g, mask=m, other=0, cache_modifier=CACHE) != 0
    start = tl.load(starts_ptr + h * (G + 1) + g, mask=m, other=0)
    stop = tl.load(starts_ptr + h * (G + 1) + g + 1, mask=m, other=0)
    return tl.where(kept, stop - start, 0), start


@triton.jit(do_not_specialize=BLOCK_SUMS_SIZES)
def group_block_sums_kernel(
    keep_ptr,  # [rows, G] bool: kept groups
    starts_ptr,  # [Hkv, G + 1] int64: group g of head h occupies [starts[h, g], starts[h, g + 1])
    block_sums_ptr,  # [rows, NB] int64 out: kept positions per block of BLOCK_G groups
    G,
    NB,
    ROWS_PER_HEAD,
    BLOCK_G: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    wait_prior(PDL)
    release_next(PDL)
    r = tl.program_id(0)
    gb = tl.program_id(1)
    g = gb * BLOCK_G + tl.arange(0, BLOCK_G)
    size, _ = kept_sizes(keep_ptr, starts_ptr, r, r // ROWS_PER_HEAD, g, G, G, "")
    tl.store(block_sums_ptr + r * NB + gb, tl.sum(size, axis=0))


@triton.jit
def expand_block(keep_ptr, starts_ptr, block_sums_ptr, indptr_ptr, out_ptr, G, NB, ROWS_PER_HEAD, tail, fixed_ptr,
                 fixed_on_ptr, W, r, gb, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                 RCHUNK: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_T: tl.constexpr, HAS_FIXED: tl.constexpr,
                 CACHE: tl.constexpr):
    """Row r's block gb of BLOCK_G groups expanded (expand_groups_kernel's program; its arguments as there); CACHE:
    the cache modifier of keep's and the block sums' loads (".cg": written by other programs of the same launch,
    kernels.jit.centroid.centroid_decode_lookup_kernel's expansion queue)."""
    h = r // ROWS_PER_HEAD
    rr = tl.arange(0, RCHUNK)[:, None]
    bb = tl.arange(0, BLOCK_NB)[None, :]
    row_start = tl.full([], 0, tl.int64)
    for r0 in range(0, r, RCHUNK):  # every block of the earlier rows
        row = r0 + rr
        # [RCHUNK, BLOCK_NB]
        sums = tl.load(block_sums_ptr + row * NB + bb, mask=(row < r) & (bb < NB), other=0, cache_modifier=CACHE)
        if HAS_FIXED:  # an earlier fixed row holds W positions, none of its groups nor the tail
            on = tl.load(fixed_on_ptr + row // ROWS_PER_HEAD, mask=row < r, other=0) != 0  # [RCHUNK, 1]
            sums = tl.where(on, 0, sums)
            row_start += tl.sum(tl.sum(tl.where(on, W - tail, 0), axis=1), axis=0)
        row_start += tl.sum(tl.sum(sums, axis=1), axis=0)
    row_start += r * tail
    # [1, BLOCK_NB]: this row's blocks
    own = tl.load(block_sums_ptr + r * NB + bb, mask=bb < NB, other=0, cache_modifier=CACHE)
    fixed_row = False
    if HAS_FIXED:
        fixed_row = tl.load(fixed_on_ptr + h) != 0
    if fixed_row:  # the row's list is lists[h], written by its NB programs in turn (BLOCK_T positions each)
        end = row_start + W
        for t in range(gb * BLOCK_T, W, NB * BLOCK_T):
            kt = t + tl.arange(0, BLOCK_T)
            tl.store(out_ptr + row_start + kt, tl.load(fixed_ptr + h * W + kt, mask=kt < W, other=0), mask=kt < W)
    else:
        base = row_start + tl.sum(tl.sum(tl.where(bb < gb, own, 0), axis=1), axis=0)  # this row's earlier blocks
        for sub in tl.static_range(0, BLOCK_G, SUB):  # groups SUB at a time: each loop runs to its SUB's longest
            g = gb * BLOCK_G + sub + tl.arange(0, SUB)
            size, start = kept_sizes(keep_ptr, starts_ptr, r, h, g, G, G, CACHE)
            dest = base + tl.cumsum(size, axis=0) - size  # [SUB]
            base += tl.sum(size, axis=0)
            longest = tl.max(size, axis=0).to(tl.int32)
            for j in range(0, longest, BLOCK_K):
                k = j + tl.arange(0, BLOCK_K)
                m = k[None, :] < size[:, None]
                tl.store(out_ptr + dest[:, None] + k[None, :], (start[:, None] + k[None, :]).to(tl.int32), mask=m)
        end = row_start + tl.sum(tl.sum(own, axis=1), axis=0) + tail
        first = tl.load(starts_ptr + h * (G + 1) + G)
        for t in range(gb * BLOCK_T, tail, NB * BLOCK_T):  # the dense tail closes the list, its programs in turn
            kt = t + tl.arange(0, BLOCK_T)
            tl.store(out_ptr + end - tail + kt, (first + kt).to(tl.int32), mask=kt < tail)
    if gb == 0:  # the row's first program: its end in indptr
        tl.store(indptr_ptr + r + 1, end)
        if r == 0:
            tl.store(indptr_ptr, end * 0)


@triton.jit(do_not_specialize=EXPAND_SIZES)
def expand_groups_kernel(
    keep_ptr,  # [rows, G] bool
    starts_ptr,  # [Hkv, G + 1] int64
    block_sums_ptr,  # [rows, NB] int64: kept positions per block of BLOCK_G groups (the tail not included)
    indptr_ptr,  # [rows + 1] int64 out: where each row's list starts (written by the row's first program)
    out_ptr,  # [capacity] int32 out: positions of kept groups, then the row's tail
    G,
    NB,
    ROWS_PER_HEAD,  # rows // Hkv
    tail,  # tail positions starts[h, G] .. starts[h, G] + tail - 1, kept by every row
    fixed_ptr,  # [Hkv, W] int32 (HAS_FIXED): the list a fixed row reads instead of its groups and the tail
    fixed_on_ptr,  # [Hkv] bool (HAS_FIXED): whether head h's rows are fixed
    W,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB: tl.constexpr,  # groups written together (a divisor of BLOCK_G): lanes per step SUB x BLOCK_K
    RCHUNK: tl.constexpr,  # rows of block sums read per step (RCHUNK * BLOCK_NB values in registers)
    BLOCK_NB: tl.constexpr,  # >= NB, a power of two
    BLOCK_T: tl.constexpr,  # positions of the tail (or of a fixed list) a program writes per step
    HAS_FIXED: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
    table_ptr=None,  # BATCHED: [B, TABLE_W] int64 addresses (EXPAND_POINTERS, kernels/compact_ops.py)
    params_ptr=None,  # BATCHED: [B, PARAMS_W] int64 values (EXPAND_PARAMS)
    BATCHED: tl.constexpr = False,
    TABLE_W: tl.constexpr = 1,
    PARAMS_W: tl.constexpr = 1,
    ALIGNED: tl.constexpr = False,  # BATCHED: the tiles' addresses (EXPAND_TILES) 16-aligned (kernels.tables.aligned)
):
    """Grid (row, block of BLOCK_G groups); BATCHED: (row, block, B), the expansions of several lookups (each
    sequence's keep, starts, block sums, outputs, fixed lists, G, NB, tail and W from row b of the tables; its
    blocks past its NB return at once)."""
    wait_prior(PDL)
    release_next(PDL)
    r = tl.program_id(0)
    gb = tl.program_id(1)
    if BATCHED:
        at = table_ptr + tl.program_id(2) * TABLE_W
        keep_ptr = table_pointer(at, 0, keep_ptr, ALIGNED)
        starts_ptr = table_pointer(at, 1, starts_ptr)
        block_sums_ptr = table_pointer(at, 2, block_sums_ptr)
        indptr_ptr = table_pointer(at, 3, indptr_ptr)
        out_ptr = table_pointer(at, 4, out_ptr, ALIGNED)
        fixed_ptr = table_pointer(at, 5, fixed_ptr)
        fixed_on_ptr = table_pointer(at, 6, fixed_on_ptr)
        at = params_ptr + tl.program_id(2) * PARAMS_W
        G = tl.load(at).to(tl.int32)  # (int32, as a lone launch passes them)
        NB = tl.load(at + 1).to(tl.int32)
        tail = tl.load(at + 2).to(tl.int32)
        W = tl.load(at + 3).to(tl.int32)
        if gb >= NB:
            return
    expand_block(keep_ptr, starts_ptr, block_sums_ptr, indptr_ptr, out_ptr, G, NB, ROWS_PER_HEAD, tail, fixed_ptr,
                 fixed_on_ptr, W, r, gb, BLOCK_G, BLOCK_K, SUB, RCHUNK, BLOCK_NB, BLOCK_T, HAS_FIXED, "")
