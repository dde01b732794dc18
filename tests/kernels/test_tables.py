"""kernels/tables.py: what a BATCHED launch may assume of its tables' entries (ALIGNED): the addresses of the
entries whose tiles it loads a multiple of 16 bytes and every hinted stride a multiple of 16, as Triton specialises
a lone launch's arguments."""

from __future__ import annotations

import inspect
import re

import torch

from kernels.tables import aligned, batch_tables


def test_a_launch_is_aligned_only_where_every_address_and_hinted_stride_is():
    whole = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert aligned([whole, whole[1]], [64, 128])  # a row of 64 bf16: 128 bytes on
    assert not aligned([whole, whole[0, 1:]])  # one element on: 2 bytes
    assert not aligned([whole], [64, 8])  # a stride the kernel would take as a multiple of 16
    assert aligned([])


def test_a_batched_launch_is_aligned_by_its_tiles_entries_only():
    """A sequence's position sliced out of a batch's positions (8 bytes on for every odd sequence) is read as a
    scalar: it must not cost the launch its aligned tiles; a tile entry one element off does."""
    positions = torch.arange(4, dtype=torch.int64)
    keys = torch.zeros(4, 64, dtype=torch.bfloat16)
    calls = [(keys[b], positions[b : b + 1]) for b in range(4)]
    names = (("keys", "position"), ("stride",))
    launch = batch_tables(calls, lambda c: c, lambda c: [64], names, torch.device("cpu"), None, tiles=("keys",))
    assert launch["ALIGNED"] and launch["table_ptr"].shape == (4, 2)
    assert launch["table_ptr"][1, 1] == positions.data_ptr() + 8
    whole = batch_tables(calls, lambda c: c, lambda c: [64], names, torch.device("cpu"), None,
                         tiles=("keys", "position"))
    assert not whole["ALIGNED"]
    shifted = [(keys[b, 1:], positions[:1]) for b in range(4)]
    assert not batch_tables(shifted, lambda c: c, lambda c: [64], names, torch.device("cpu"), None,
                            tiles=("keys",))["ALIGNED"]


def _aligned_entries(*kernels) -> set[int]:
    """The table entries the kernels' code reads as aligned: table_pointer(row, i, ..., ALIGNED)."""
    found = set()
    for kernel in kernels:
        source = inspect.getsource(getattr(kernel, "fn", kernel))
        found |= {int(i) for i in re.findall(r"table_pointer\(at, (\d+), \w+, ALIGNED\)", source)}
    return found


def test_each_batched_kernel_takes_as_aligned_the_entries_its_launch_checks():
    """A BATCHED kernel's ALIGNED entries are exactly those its wrapper's `tiles` name (and checks): an entry the
    kernel took as aligned unchecked would be loaded 16 bytes at a time from anywhere."""
    from kernels import append_ops, centroid_ops, compact_ops, union_ops
    from kernels.jit import append, centroid, compact, union

    cases = [((union.union_attn_fwd_kernel,), union_ops.SPLIT_POINTERS, union_ops.SPLIT_TILES),
             ((union.union_merge_kernel,), union_ops.MERGE_POINTERS, union_ops.MERGE_TILES),
             ((centroid._sequence, centroid.centroid_denominator_kernel), centroid_ops.DENOMINATOR_POINTERS,
              centroid_ops.DENOMINATOR_TILES),
             ((centroid._sequence, centroid.centroid_score_kernel), centroid_ops.SCORE_POINTERS,
              centroid_ops.SCORE_TILES),
             ((centroid.centroid_cut_kernel,), centroid_ops.CUT_POINTERS, centroid_ops.CUT_TILES),
             ((compact.expand_groups_kernel,), compact_ops.EXPAND_POINTERS, compact_ops.EXPAND_TILES),
             ((append.append_tokens_kernel,), append_ops.APPEND_POINTERS, append_ops.APPEND_TILES)]
    for kernels, names, tiles in cases:
        assert _aligned_entries(*kernels) == {names.index(t) for t in tiles}, kernels
