"""Expansion of kept groups (clusters, or level-1 clusters' children) into the positions they occupy."""

import triton
import triton.language as tl


@triton.jit
def expand_groups_kernel(
    keep_ptr,  # [rows, G] int8/bool: kept groups
    starts_ptr,  # [Hkv, G + 1] int64: group g of head h occupies [starts[h, g], starts[h, g + 1])
    offsets_ptr,  # [rows, G] int64: exclusive prefix sum of the kept groups' sizes within the row
    indptr_ptr,  # [rows + 1] int64: where each row's list starts in out
    out_ptr,  # [capacity] int32: positions, written for kept groups (and the tail)
    G,
    ROWS_PER_HEAD,  # rows // Hkv
    tail,  # tail positions starts[h, G] .. starts[h, G] + tail - 1, kept by every row
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0)
    gb = tl.program_id(1)
    h = r // ROWS_PER_HEAD
    g = gb * BLOCK_G + tl.arange(0, BLOCK_G)
    in_range = g < G
    kept = tl.load(keep_ptr + r * G + g, mask=in_range, other=0) != 0
    start = tl.load(starts_ptr + h * (G + 1) + g, mask=in_range, other=0)
    end = tl.load(starts_ptr + h * (G + 1) + g + 1, mask=in_range, other=0)
    size = tl.where(kept, end - start, 0)  # [BLOCK_G]
    base = tl.load(indptr_ptr + r)
    dest = base + tl.load(offsets_ptr + r * G + g, mask=in_range, other=0)  # [BLOCK_G]
    longest = tl.max(size, axis=0)
    for j in range(0, longest, BLOCK_K):
        k = j + tl.arange(0, BLOCK_K)
        m = k[None, :] < size[:, None]
        tl.store(out_ptr + dest[:, None] + k[None, :], (start[:, None] + k[None, :]).to(tl.int32), mask=m)
    if gb == 0:  # the row's dense tail closes its list
        first = tl.load(starts_ptr + h * (G + 1) + G)
        tail_dest = tl.load(indptr_ptr + r + 1) - tail
        for j in range(0, tail, BLOCK_K):
            k = j + tl.arange(0, BLOCK_K)
            tl.store(out_ptr + tail_dest + k, (first + k).to(tl.int32), mask=k < tail)
