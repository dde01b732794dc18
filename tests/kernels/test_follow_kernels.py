"""The follow part's kernel (kernels/jit/follow.py) against its reference, and the reference against dense attention
over the union of a selection and its follow rows. Without CUDA the kernel runs in the Triton interpreter
(tests/conftest.py): float32 and float16 there; bfloat16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import follow_ops
from kernels.reference import follow as reference
from kernels.reference.merge import merge_attention
from kernels.reference.sparse import attention_with_lse, sparse_attention
from kernels.selection import Selection

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16]


def case(seed: int, hq: int, hkv: int, rows: int, lq: int, n: int, m: int, first: int, layout: bool,
         index_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    d = 64
    q = torch.randn(hq, lq, d, generator=g)
    k = torch.randn(hkv, n, d, generator=g)
    v = torch.randn(hkv, n, d, generator=g)
    mask = torch.rand(rows, n, generator=g) < 0.3
    sel = Selection.from_mask(mask)
    spare = torch.randint(0, n, (7,), generator=g)  # spare capacity, as the GPU leaves it
    sel = Selection(sel.indptr, torch.cat([sel.indices, spare]).to(index_dtype), n)
    tail = 5
    indexed = n - tail
    pos = torch.randperm(n + first + 3, generator=g)[:m] - 2  # some -1/-2 (none), some in the sink or the tail
    pos = torch.where(pos < 0, -1, pos)
    order = torch.stack([torch.randperm(indexed, generator=g) for _ in range(hkv)]).to(torch.int32) if layout else None
    return q, k, v, sel, pos, first, indexed, order, mask


SHAPES = [  # hq, hkv, rows, lq, n, m, first, layout
    (8, 2, 2, 1, 300, 8, 0, True),
    (8, 2, 8, 1, 300, 8, 2, False),
    (4, 1, 1, 37, 500, 64, 0, True),
    (4, 4, 4, 20, 130, 16, 3, False),
    (8, 2, 2, 1, 400, 72, 1, True),  # a decode step's 8 rows and the question's 64 carried (engine.attention.follow)
]


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_attention_over_the_union(shape):
    q, k, v, sel, pos, first, indexed, order, mask = case(0, *shape)
    hq, hkv = q.shape[0], k.shape[0]
    out, lse, fresh = reference.follow_attention(q, k, v, sel, pos, first, indexed, order, 0.125)
    rows, valid = reference.follow_rows(pos, first, indexed, order, hkv)
    head = torch.arange(sel.rows) * hkv // sel.rows
    union = mask.clone()
    for r in range(sel.rows):
        union[r, rows[head[r]][valid[head[r]]]] = True
    assert torch.equal(fresh, union.gather(1, rows[head]) & ~mask.gather(1, rows[head]) & valid[head])
    merged, _ = merge_attention([sparse_attention(q, k, v, sel, 0.125), (out, lse)])
    per_head = union.repeat_interleave(hq // sel.rows, dim=0)[:, None, :]  # [Hq, 1, N]
    expected, expected_lse = attention_with_lse(q, k, v, 0.125, per_head)
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
    # the selection's own attention as the prior: the union's, in one call
    out, lse, _ = reference.follow_attention(q, k, v, sel, pos, first, indexed, order, 0.125,
                                             prior=sparse_attention(q, k, v, sel, 0.125))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


def random_prior(hq: int, lq: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prior (out, lse) float32 with an empty part (-inf, out 0) in some rows and large and small lse."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(hq, lq, d, generator=g)
    lse = torch.randn(hq, lq, generator=g) * 40
    empty = torch.rand(hq, lq, generator=g) < 0.2
    return out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))


@pytest.mark.parametrize("prior", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape, index_dtype, dtype, prior):
    q, k, v, sel, pos, first, indexed, order, _ = case(1, *shape, index_dtype=index_dtype)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    q, k, v = (x.to(DEVICE, dtype) for x in (q, k, v))
    sel = Selection(sel.indptr.to(DEVICE), sel.indices.to(DEVICE), sel.num_keys)
    before = tuple(x.to(DEVICE) for x in random_prior(q.shape[0], q.shape[1], q.shape[2], 5)) if prior else None
    want = reference.follow_attention(q, k, v, sel, dev(pos), first, indexed, dev(order), 0.125, before)
    mine = tuple(x.clone() for x in before) if prior else None  # the kernel merges into the prior's tensors
    got = follow_ops.follow_attention(q, k, v, sel, dev(pos), first, indexed, dev(order), 0.125, mine)
    if prior and DEVICE == "cuda":
        assert got[0].data_ptr() == mine[0].data_ptr() and got[1].data_ptr() == mine[1].data_ptr()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)


def test_rows_without_fresh_keys_are_empty():
    q, k, v, sel, pos, first, indexed, order, _ = case(2, 8, 2, 2, 1, 300, 8, 0, True)
    everything = Selection.from_mask(torch.ones(2, 300, dtype=torch.bool))
    for op in (reference.follow_attention, follow_ops.follow_attention):
        out, lse, fresh = op(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                             Selection(everything.indptr.to(DEVICE), everything.indices.to(DEVICE), 300),
                             pos.to(DEVICE), first, indexed, order.to(DEVICE), 0.125)
        assert not fresh.any() and torch.isinf(lse).all() and not out.any()
        prior = tuple(x.to(DEVICE) for x in random_prior(8, 1, 64, 6))
        out, lse, _ = op(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                         Selection(everything.indptr.to(DEVICE), everything.indices.to(DEVICE), 300),
                         pos.to(DEVICE), first, indexed, order.to(DEVICE), 0.125, tuple(x.clone() for x in prior))
        torch.testing.assert_close(out, prior[0], atol=1e-6, rtol=1e-6)  # nothing fresh: the prior unchanged
        torch.testing.assert_close(lse, prior[1], atol=1e-6, rtol=1e-6)


def test_arguments_are_checked():
    q, k, v, sel, pos, first, indexed, order, _ = case(3, 8, 2, 2, 1, 300, 8, 0, True)
    with pytest.raises(ValueError):
        follow_ops.follow_attention(q, k, v, sel, pos[None], first, indexed, order, 0.125)
    with pytest.raises(ValueError):
        follow_ops.follow_attention(q, k, v, sel, pos, first, indexed, order.long(), 0.125)
    with pytest.raises(ValueError):  # a prior of the wrong shape
        follow_ops.follow_attention(q, k, v, sel, pos, first, indexed, order, 0.125, random_prior(8, 2, 64, 0))
