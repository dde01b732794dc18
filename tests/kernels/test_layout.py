"""kernels.layout (the inverted-file layout, its reference expansion) and the Triton expansion against it.

On the CPU the Triton kernel runs in the interpreter (conftest sets TRITON_INTERPRET=1). Results are integers:
the comparison is exact.
"""

from __future__ import annotations

import pytest
import torch

from kernels import compact_ops
from kernels.layout import ClusterLayout, group_starts
from kernels.reference.compact import expand_groups
from kernels.reference.sparse import attention_with_lse, sparse_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def random_labels(hkv: int, lc: int, groups: int, seed: int) -> torch.Tensor:
    """[Hkv, Lc] labels with uneven group sizes and some empty groups."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(groups, generator=g) ** 3  # a few big groups, many small ones
    weights[torch.randperm(groups, generator=g)[: groups // 5]] = 0  # empty groups
    return torch.multinomial(weights, hkv * lc, replacement=True, generator=g).reshape(hkv, lc)


def test_group_starts_and_permutation():
    labels = random_labels(2, 300, 23, 0)
    layout = ClusterLayout.from_labels(labels, 23, tail=7)
    assert torch.equal(layout.starts, group_starts(labels, 23))
    x = torch.randn(2, 307, 4)
    xp = layout.permute(x)
    for h in range(2):
        for c in range(23):
            a, b = layout.starts[h, c], layout.starts[h, c + 1]
            assert torch.equal(xp[h, a:b], x[h, :300][labels[h] == c])  # members, in their original order
        assert torch.equal(xp[h, 300:], x[h, 300:])  # the dense tail stays last, unpermuted
        assert torch.equal(torch.sort(layout.order[h]).values, torch.arange(307))


def test_attention_does_not_depend_on_the_layout():
    """Sparse attention over the permuted K/V with permuted positions = over the original with original ones."""
    g = torch.Generator().manual_seed(1)
    labels = random_labels(2, 90, 11, 1)
    layout = ClusterLayout.from_labels(labels, 11, tail=10)
    q, k, v = torch.randn(4, 3, 16, generator=g), torch.randn(2, 100, 16, generator=g), torch.randn(2, 100, 16, generator=g)
    keep = torch.rand(2, 11, generator=g) > 0.5
    sel = expand_groups(keep, layout.starts, 90, tail=10)
    out, lse = sparse_attention(q, layout.permute(k), layout.permute(v), sel, 0.25)
    original = torch.cat([torch.gather(keep, 1, labels), torch.ones(2, 10, dtype=torch.bool)], dim=1)  # [Hkv, L]
    want_out, want_lse = attention_with_lse(q, k, v, 0.25, original.repeat_interleave(2, dim=0)[:, None, :])
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hkv,rows", [(1, 1), (1, 4), (2, 2), (2, 8)])
@pytest.mark.parametrize("tail", [0, 5, 70])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_triton_expansion_matches_reference(hkv, rows, tail, density):
    groups, lc = 45, 400
    labels = random_labels(hkv, lc, groups, seed=hkv * 100 + rows + tail)
    starts = group_starts(labels, groups)
    g = torch.Generator().manual_seed(7)
    keep = torch.rand(rows, groups, generator=g) < density
    if rows > 1 and density > 0:
        keep[1] = False  # an empty row (only its tail)
    want = expand_groups(keep, starts, lc, tail)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel runs compiled on a GPU, interpreted otherwise
    got = compact_ops.expand_groups(keep.to(dev), starts.to(dev), lc, tail)
    assert got.num_keys == want.num_keys == lc + tail
    assert torch.equal(got.indptr.cpu(), want.indptr)
    n = int(want.indptr[-1])
    assert got.indices.dtype == torch.int32 and got.indices.numel() >= n
    assert torch.equal(got.indices[:n].long().cpu(), want.indices)


def test_expansion_rejects_mismatched_shapes():
    starts = group_starts(torch.zeros(2, 10, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="groups"):
        compact_ops.expand_groups(torch.ones(2, 5, dtype=torch.bool), starts, 10)
    with pytest.raises(ValueError, match="multiple"):
        compact_ops.expand_groups(torch.ones(3, 4, dtype=torch.bool), starts, 10)


def test_triton_expansion_scans_many_groups():
    """Many blocks of groups per row (compact_ops.BLOCK_G each): every block finds its place from the others' sums."""
    groups = compact_ops.BLOCK_G * 70 + 5
    labels = random_labels(2, 6000, groups, seed=11)
    starts = group_starts(labels, groups)
    keep = torch.rand(4, groups, generator=torch.Generator().manual_seed(12)) < 0.4
    want = expand_groups(keep, starts, 6000, tail=3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = compact_ops.expand_groups(keep.to(dev), starts.to(dev), 6000, tail=3)
    assert torch.equal(got.indptr.cpu(), want.indptr)
    assert torch.equal(got.indices[: int(want.indptr[-1])].long().cpu(), want.indices)


@pytest.mark.parametrize("hkv,rows,groups", [(1, 1, 300), (2, 2, 300), (2, 8, 300), (4, 4, 300)])
@pytest.mark.parametrize("width", [0, 9, 130])
def test_triton_expansion_with_fixed_rows_matches_reference(hkv, rows, groups, width):
    """Rows of the heads `Fixed` marks read its lists (DuoAttention's streaming windows) instead of their groups and
    the tail, written by the expansion itself; the other rows, and every row's place in the list, as before. The
    reference is kernels.selection.replace_rows over the plain expansion."""
    from kernels.selection import Fixed

    lc, tail = 400, 5
    labels = random_labels(hkv, lc, groups, seed=hkv + rows + width)
    starts = group_starts(labels, groups)
    g = torch.Generator().manual_seed(width)
    keep = torch.rand(rows, groups, generator=g) < 0.4
    lists = torch.stack([torch.randperm(lc + tail, generator=g)[:width].sort().values for _ in range(hkv)])
    for on in ([h % 2 == 0 for h in range(hkv)], [True] * hkv, [False] * hkv):
        fixed = Fixed(lists.to(torch.int32), torch.tensor(on))
        want = expand_groups(keep, starts, lc, tail, fixed=fixed)
        assert want.counts().tolist()[0] == (width if on[0] else int(want.counts()[0]))
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        fixed_dev = Fixed(fixed.lists.to(dev), fixed.on.to(dev))
        got = compact_ops.expand_groups(keep.to(dev), starts.to(dev), lc, tail, fixed=fixed_dev)
        n = int(want.indptr[-1])  # the reference's buffer has spare capacity past it too
        assert torch.equal(got.indptr.cpu(), want.indptr)
        assert torch.equal(got.indices[:n].long().cpu(), want.indices[:n].long())


def test_fixed_rows_reject_bad_lists():
    from kernels.selection import Fixed

    starts = group_starts(torch.zeros(2, 10, dtype=torch.int64), 4)
    keep = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="int32"):
        compact_ops.expand_groups(keep, starts, 10, fixed=Fixed(torch.zeros(2, 3, dtype=torch.int64),
                                                                torch.ones(2, dtype=torch.bool)))
    with pytest.raises(ValueError, match="bool"):
        compact_ops.expand_groups(keep, starts, 10, fixed=Fixed(torch.zeros(2, 3, dtype=torch.int32),
                                                                torch.ones(3, dtype=torch.bool)))


@pytest.mark.parametrize("rows", [2, 8])
def test_triton_expansion_of_large_groups(rows):
    """Groups of hundreds of positions (Saap's buckets: compact_ops.write_tiles picks other tiles) expand as the
    reference does."""
    groups, lc = 37, 9000
    labels = random_labels(2, lc, groups, seed=rows)
    starts = group_starts(labels, groups)
    assert compact_ops.write_tiles(lc, groups)[0] == compact_ops.LARGE_BLOCK_G
    keep = torch.rand(rows, groups, generator=torch.Generator().manual_seed(3)) < 0.5
    want = expand_groups(keep, starts, lc, tail=5)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = compact_ops.expand_groups(keep.to(dev), starts.to(dev), lc, tail=5)
    assert torch.equal(got.indptr.cpu(), want.indptr)
    assert torch.equal(got.indices[: int(want.indptr[-1])].long().cpu(), want.indices)


def test_fixed_rows_with_block_sums_read_in_chunks():
    """20 rows of 65 blocks of 16 groups: the expansion reads the earlier rows' block sums (and their fixed flags)
    16 rows at a time (RCHUNK = SUM_TILE // 128 < rows: more than 64 blocks), the path of long contexts with many KV
    heads."""
    from kernels.selection import Fixed

    hkv, rows, block_g, lc, tail = 4, 20, 16, 2000, 5
    groups = block_g * 65
    assert compact_ops.SUM_TILE // 128 < rows  # 65 blocks round up to 128: the rows' sums are read in chunks
    labels = random_labels(hkv, lc, groups, seed=7)
    starts = group_starts(labels, groups)
    g = torch.Generator().manual_seed(8)
    keep = torch.rand(rows, groups, generator=g) < 0.4
    lists = torch.stack([torch.randperm(lc + tail, generator=g)[:9].sort().values for _ in range(hkv)])
    fixed = Fixed(lists.to(torch.int32), torch.tensor([True, False, False, True]))
    head = torch.arange(rows) * hkv // rows
    sizes = torch.where(keep, (starts[:, 1:] - starts[:, :-1])[head], 0)
    block_sums = sizes.reshape(rows, -1, block_g).sum(-1)  # [rows, 65]
    want = expand_groups(keep, starts, lc, tail, fixed=fixed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = compact_ops.expand_block_sums(keep.to(dev), starts.to(dev), block_sums.to(dev), block_g, lc, tail,
                                        fixed=Fixed(fixed.lists.to(dev), fixed.on.to(dev)), sub=block_g)
    n = int(want.indptr[-1])
    assert torch.equal(got.indptr.cpu(), want.indptr)
    assert torch.equal(got.indices[:n].long().cpu(), want.indices[:n].long())
