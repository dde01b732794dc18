"""kernels/tables.py: what a BATCHED launch may assume of its tables' entries (ALIGNED): the addresses of the
entries whose tiles it loads a multiple of 16 bytes and every hinted stride a multiple of 16, as Triton specialises
a lone launch's arguments."""

from __future__ import annotations

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
