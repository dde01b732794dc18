"""The FlexAttention peer of the kernel benchmark computes the same attention as the reference, given a Selection."""

import pytest
import torch

from engine.bench.flex import BLOCK, block_mask_from_selection, flex_sparse
from kernels.reference import sparse as reference
from kernels.selection import Selection


@pytest.mark.parametrize("rows_are_kv", [True, False])
def test_flex_with_selection_matches_reference(rows_are_kv):
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    hq, hkv, lq, keys, d = 4, 2, BLOCK, 4 * BLOCK, 16
    q, k, v = torch.randn(hq, lq, d), torch.randn(hkv, keys, d), torch.randn(hkv, keys, d)
    rows = hkv if rows_are_kv else hq
    keep = torch.rand(rows, keys) < 0.3
    keep[:, BLOCK : 2 * BLOCK] = True  # a full block (no mask function) beside partial ones
    keep[:, 3 * BLOCK :] = False  # and an empty one
    sel = Selection.from_mask(keep)
    mask, dense = block_mask_from_selection(sel, hq, lq)
    assert torch.equal(dense, keep)
    out = flex_sparse(flex_attention, q, k, v, mask, d**-0.5)
    expected, _ = reference.sparse_attention(q, k, v, sel, d**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_sizes_must_be_whole_blocks():
    sel = Selection.from_mask(torch.ones(2, BLOCK + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiples"):
        block_mask_from_selection(sel, 4, BLOCK)
