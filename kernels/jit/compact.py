"""Expansion of kept groups (clusters, or level-1 clusters' children) into the positions they occupy.

Two kernels over the same (row, block of groups) grid, both fully parallel: the first sums the kept groups' sizes
per block (and adds them to the row's total), the second finds its block's place in the packed list from those
sums (rows before it, blocks before it, then a scan inside the block) and writes the positions.
"""

import triton
import triton.language as tl


@triton.jit
def _kept_sizes(keep_ptr, starts_ptr, r, h, gb, G, BLOCK_G: tl.constexpr):
    """Sizes of block gb's groups for row r (0 where not kept), and their starts. Both [BLOCK_G] int64."""
    g = gb * BLOCK_G + tl.arange(0, BLOCK_G)
    m = g < G
    kept = tl.load(keep_ptr + r * G + g, mask=m, other=0) != 0
    start = tl.load(starts_ptr + h * (G + 1) + g, mask=m, other=0)
    stop = tl.load(starts_ptr + h * (G + 1) + g + 1, mask=m, other=0)
    return tl.where(kept, stop - start, 0), start


@triton.jit
def group_block_sums_kernel(
    keep_ptr,  # [rows, G] bool: kept groups
    starts_ptr,  # [Hkv, G + 1] int64: group g of head h occupies [starts[h, g], starts[h, g + 1])
    block_sums_ptr,  # [rows, NB] int64 out: kept positions per block of BLOCK_G groups
    totals_ptr,  # [rows] int64, zeroed: kept positions per row (integer atomics: exact, order-free)
    G,
    NB,
    ROWS_PER_HEAD,
    BLOCK_G: tl.constexpr,
):
    r = tl.program_id(0)
    gb = tl.program_id(1)
    size, _ = _kept_sizes(keep_ptr, starts_ptr, r, r // ROWS_PER_HEAD, gb, G, BLOCK_G)
    total = tl.sum(size, axis=0)
    tl.store(block_sums_ptr + r * NB + gb, total)
    tl.atomic_add(totals_ptr + r, total)


@triton.jit
def expand_groups_kernel(
    keep_ptr,  # [rows, G] bool
    starts_ptr,  # [Hkv, G + 1] int64
    block_sums_ptr,  # [rows, NB] int64 (group_block_sums_kernel)
    totals_ptr,  # [rows] int64 (group_block_sums_kernel; the tail not included)
    indptr_ptr,  # [rows + 1] int64 out: where each row's list starts (written by the row's first program)
    out_ptr,  # [capacity] int32 out: positions of kept groups, then the row's tail
    G,
    NB,
    ROWS_PER_HEAD,  # rows // Hkv
    tail,  # tail positions starts[h, G] .. starts[h, G] + tail - 1, kept by every row
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= rows, a power of two
    BLOCK_NB: tl.constexpr,  # >= NB, a power of two
):
    r = tl.program_id(0)
    gb = tl.program_id(1)
    h = r // ROWS_PER_HEAD
    rr = tl.arange(0, BLOCK_R)
    base = tl.sum(tl.load(totals_ptr + rr, mask=rr < r, other=0) + tl.where(rr < r, tail, 0), axis=0)
    bb = tl.arange(0, BLOCK_NB)
    base += tl.sum(tl.load(block_sums_ptr + r * NB + bb, mask=bb < gb, other=0), axis=0)  # blocks before gb
    size, start = _kept_sizes(keep_ptr, starts_ptr, r, h, gb, G, BLOCK_G)
    dest = base + tl.cumsum(size, axis=0) - size  # [BLOCK_G]
    longest = tl.max(size, axis=0).to(tl.int32)
    for j in range(0, longest, BLOCK_K):
        k = j + tl.arange(0, BLOCK_K)
        m = k[None, :] < size[:, None]
        tl.store(out_ptr + dest[:, None] + k[None, :], (start[:, None] + k[None, :]).to(tl.int32), mask=m)
    if gb == 0:  # the row's first program: its end in indptr, and the dense tail that closes its list
        end = base + tl.load(totals_ptr + r) + tail
        tl.store(indptr_ptr + r + 1, end)
        if r == 0:
            tl.store(indptr_ptr, end * 0)
        first = tl.load(starts_ptr + h * (G + 1) + G)
        for t in range(0, tail, BLOCK_K):
            kt = t + tl.arange(0, BLOCK_K)
            tl.store(out_ptr + end - tail + kt, (first + kt).to(tl.int32), mask=kt < tail)
