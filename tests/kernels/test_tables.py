"""kernels/tables.py: what a BATCHED launch may assume of its tables' entries (ALIGNED): every address a multiple of
16 bytes and every hinted stride a multiple of 16, as Triton specialises a lone launch's arguments."""

from __future__ import annotations

import torch

from kernels.tables import aligned


def test_a_launch_is_aligned_only_where_every_address_and_hinted_stride_is():
    whole = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert aligned([whole, whole[1]], [64, 128])  # a row of 64 bf16: 128 bytes on
    assert not aligned([whole, whole[0, 1:]])  # one element on: 2 bytes
    assert not aligned([whole], [64, 8])  # a stride the kernel would take as a multiple of 16
    assert aligned([])
