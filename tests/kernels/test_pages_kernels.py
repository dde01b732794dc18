"""Quest's page-score kernel (kernels/pages_ops.py) against kernels.reference.pages, and the reference against the
bound's definition, sum_i max(q_i min_i, q_i max_i), computed elementwise.

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py), so the shapes are small: P = 37 and 130
pages (block tails), Lq 1 (decode), 5 and 33 (a question's prefill), 1..4 query heads per row. The GPU tests
(marker `gpu`) add bfloat16 bounds at the shape of a 128K context (8192 pages of 16 keys).
"""

from __future__ import annotations

import pytest
import torch

from engine.methods.quest import page_bounds
from kernels.reference.pages import page_scores as reference_scores

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernel and the reference sum the same float32 products in another order (D terms, heads, tokens): a few
# ulps of a score of size ~sqrt(D) * heads. A wrong head, page or token moves a score by far more.
TOL = dict(rtol=1e-5, atol=1e-4)
# (Hq, Hkv, rows): GQA 1, 2, 4 with one selection per KV head or per query head
GROUPS = [(2, 2, 2), (4, 2, 2), (4, 2, 4), (4, 1, 1), (4, 1, 4)]


def make_bounds(hkv, pages, d, page_size=16, dtype=torch.float32, seed=0):
    """Bounds of random keys with a per-page offset (pages differ), as QuestPolicy.build makes them."""
    g = torch.Generator().manual_seed(seed)
    length = pages * page_size - 3  # a short last page
    offsets = torch.randn(hkv, pages, d, generator=g).repeat_interleave(page_size, dim=1)[:, :length]
    keys = torch.randn(hkv, length, d, generator=g) + offsets
    lo, hi = page_bounds(keys.to(dtype), page_size)
    return lo.to(DEVICE), hi.to(DEVICE)


def by_definition(q, lo, hi, rows):
    """[rows, P]: sum_i max(q_i lo_i, q_i hi_i) per token and head, summed over a row's heads, max(mean, last)."""
    hq, hkv = q.shape[0], lo.shape[0]
    lo_q = lo.float().repeat_interleave(hq // hkv, dim=0)[:, None]  # [Hq, 1, P, D]
    hi_q = hi.float().repeat_interleave(hq // hkv, dim=0)[:, None]
    qf = q.float()[:, :, None, :]  # [Hq, Lq, 1, D]
    bound = torch.maximum(qf * lo_q, qf * hi_q).sum(dim=-1).reshape(rows, hq // rows, q.shape[1], -1).sum(dim=1)
    return torch.maximum(bound.mean(dim=1), bound[:, -1])


def test_page_bounds_cover_every_key():
    keys = torch.randn(2, 45, 8)
    lo, hi = page_bounds(keys, 16)
    assert lo.shape == hi.shape == (2, 3, 8)
    for p, (a, b) in enumerate([(0, 16), (16, 32), (32, 45)]):  # the last page is short
        page = keys[:, a:b]
        torch.testing.assert_close(lo[:, p], page.amin(dim=1), rtol=0, atol=0)
        torch.testing.assert_close(hi[:, p], page.amax(dim=1), rtol=0, atol=0)


@pytest.mark.parametrize("hq,hkv,rows", GROUPS)
@pytest.mark.parametrize("lq", [1, 5])
def test_reference_is_the_bound(hq, hkv, rows, lq):
    lo, hi = make_bounds(hkv, 37, 16)
    q = torch.randn(hq, lq, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch.testing.assert_close(reference_scores(q, lo, hi, rows), by_definition(q, lo, hi, rows), **TOL)


def test_bound_is_an_upper_bound():
    """No key of a page scores above the page's bound (the property Quest's selection rests on)."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 64, 16, generator=g)
    lo, hi = page_bounds(keys, 16)
    q = torch.randn(1, 1, 16, generator=g)
    bound = reference_scores(q, lo, hi, 1)[0]  # [4]
    exact = (keys[0] @ q[0, 0]).reshape(4, 16).amax(dim=1)
    assert bool((exact <= bound + 1e-5).all())


@pytest.mark.parametrize("hq,hkv,rows", GROUPS)
@pytest.mark.parametrize("lq,pages", [(1, 37), (5, 130), (33, 37)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference(hq, hkv, rows, lq, pages, dtype):
    from kernels.pages_ops import page_scores

    lo, hi = make_bounds(hkv, pages, 16, dtype=dtype)
    q = torch.randn(hq, lq, 16, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    torch.testing.assert_close(page_scores(q, lo, hi, rows), reference_scores(q, lo, hi, rows), **TOL)


@pytest.mark.parametrize("hq,hkv,rows", GROUPS)
@pytest.mark.parametrize("lq,pad", [(1, 4), (5, 11)])
@pytest.mark.parametrize("int8", [False, True])
def test_padded_tokens_count_in_no_score(hq, hkv, rows, lq, pad, int8):
    """With `valid`, a question padded after its real tokens scores the pages as its real tokens alone do (the
    reference and the kernel, bounds of the keys' dtype and one-byte codes); the padding would move them."""
    from kernels.pages_ops import page_scores
    from kernels.reference.pages import quantize_bounds

    lo, hi = make_bounds(hkv, 37, 16)
    codes = {}
    if int8:
        packed = quantize_bounds(lo, hi)
        lo, hi = packed["page_min"].to(DEVICE), packed["page_max"].to(DEVICE)
        codes = {"offset": packed["bound_offset"].to(DEVICE), "step": packed["bound_step"].to(DEVICE)}
    g = torch.Generator().manual_seed(7)
    q = torch.randn(hq, lq, 16, generator=g).to(DEVICE)
    q_pad = torch.cat([q, 3 * torch.randn(hq, pad, 16, generator=g).to(DEVICE)], dim=1)
    valid = torch.tensor([lq], dtype=torch.int64, device=DEVICE)
    want = reference_scores(q, lo, hi, rows, **codes)
    assert not torch.allclose(reference_scores(q_pad, lo, hi, rows, **codes), want)
    torch.testing.assert_close(reference_scores(q_pad, lo, hi, rows, **codes, valid=valid), want, **TOL)
    torch.testing.assert_close(page_scores(q_pad, lo, hi, rows, **codes, valid=valid), want, **TOL)


def test_int8_bounds_round_outwards():
    """One-byte bounds still bound every key: a code's value is at or below the minimum, at or above the maximum,
    and within about one step (1/255 of the dim's range over the context) of it."""
    from kernels.reference.pages import dequantize_bounds, quantize_bounds

    lo, hi = make_bounds(2, 130, 16)
    codes = quantize_bounds(lo, hi)
    assert codes["page_min"].dtype == codes["page_max"].dtype == torch.uint8
    off, step = codes["bound_offset"], codes["bound_step"]
    qlo, qhi = dequantize_bounds(codes["page_min"], off, step), dequantize_bounds(codes["page_max"], off, step)
    assert bool((qlo <= lo).all()) and bool((qhi >= hi).all())
    assert bool(((lo - qlo) <= 2 * step[:, None]).all()) and bool(((qhi - hi) <= 2 * step[:, None]).all())


@pytest.mark.parametrize("hq,hkv,rows", GROUPS)
@pytest.mark.parametrize("lq", [1, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference_int8(hq, hkv, rows, lq, dtype):
    """The kernel on one-byte codes (step folded into the queries, offset into a constant) = the reference on the
    dequantized bounds, and each page's score still bounds its keys' exact q . k."""
    from kernels.pages_ops import page_scores
    from kernels.reference.pages import quantize_bounds

    g = torch.Generator().manual_seed(4)
    keys = torch.randn(hkv, 37 * 16, 16, generator=g) + torch.randn(hkv, 37, 16, generator=g).repeat_interleave(16, 1)
    lo, hi = page_bounds(keys, 16)
    codes = {k: v.to(DEVICE) for k, v in quantize_bounds(lo, hi).items()}
    args = (codes["page_min"], codes["page_max"], rows, codes["bound_offset"], codes["bound_step"])
    q = torch.randn(hq, lq, 16, generator=g).to(dtype).to(DEVICE)
    got = page_scores(q, *args)
    torch.testing.assert_close(got, reference_scores(q, *args), **TOL)
    if lq == 1 and rows == hq:  # one query per row: its score bounds every key of the page
        exact = torch.einsum("hd,hld->hl", q[:, 0].float().cpu(), keys.repeat_interleave(hq // hkv, 0))
        assert bool((exact.reshape(hq, 37, 16).amax(dim=2) <= got.cpu() + 1e-4).all())


def test_kernel_rejects_codes_without_scale():
    from kernels.pages_ops import page_scores
    from kernels.reference.pages import quantize_bounds

    codes = quantize_bounds(*make_bounds(2, 8, 16))
    with pytest.raises(ValueError, match="offset and step"):
        page_scores(torch.randn(4, 1, 16, device=DEVICE), codes["page_min"].to(DEVICE), codes["page_max"].to(DEVICE), 2)


def test_kernel_reads_strided_queries():
    """The model's queries arrive as a transposed view ([Hq, Lq, D] of a [Lq, Hq, D] buffer)."""
    from kernels.pages_ops import page_scores

    lo, hi = make_bounds(2, 37, 16)
    q = torch.randn(5, 4, 16, device=DEVICE).transpose(0, 1)  # [4, 5, 16], stride(1) != D
    torch.testing.assert_close(page_scores(q, lo, hi, 2), reference_scores(q, lo, hi, 2), **TOL)


def test_kernel_rejects_bad_rows():
    from kernels.pages_ops import page_scores

    lo, hi = make_bounds(2, 8, 16)
    with pytest.raises(ValueError, match="rows"):
        page_scores(torch.randn(4, 1, 16, device=DEVICE), lo, hi, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [8, 32])
@pytest.mark.parametrize("lq", [1, 64])
@pytest.mark.parametrize("int8", [False, True])
def test_kernel_at_128k_bf16(rows, lq, int8):
    """Llama-3-8B shape at 128K: 32/8 heads, D 128, 8192 pages of 16, bfloat16 bounds (or their one-byte codes),
    against the reference in float32 from the same inputs."""
    from kernels.pages_ops import page_scores
    from kernels.reference.pages import quantize_bounds

    g = torch.Generator(device="cuda").manual_seed(0)
    lo = torch.randn(8, 8192, 128, device="cuda", generator=g).bfloat16()
    hi = lo + torch.rand(8, 8192, 128, device="cuda", generator=g).bfloat16()
    q = torch.randn(32, lq, 128, device="cuda", generator=g).bfloat16()
    args = (lo, hi, rows)
    if int8:
        codes = quantize_bounds(lo, hi)
        args = (codes["page_min"], codes["page_max"], rows, codes["bound_offset"], codes["bound_step"])
    torch.testing.assert_close(page_scores(q, *args), reference_scores(q, *args), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("rows,pages,k,page,rest", [(2, 37, 4, 16, 21), (3, 130, 13, 8, 5), (1, 9, 9, 4, 0),
                                                    (2, 300, 30, 16, 100)])
def test_select_pages_matches_reference(rows, pages, k, page, rest):
    """The kept pages and the Selection (their keys in order, then every key past the pages), as the reference."""
    from kernels.pages_ops import select_pages
    from kernels.reference.pages import select_pages as reference_select

    scores = torch.randn(rows, pages, generator=torch.Generator().manual_seed(pages)).to(DEVICE)
    num_keys = pages * page + rest
    keep, sel = select_pages(scores, k, page, num_keys)
    want_keep, want = reference_select(scores, k, page, num_keys)
    assert torch.equal(keep, want_keep)
    assert torch.equal(sel.indptr, want.indptr) and sel.num_keys == want.num_keys
    assert torch.equal(sel.indices[: int(sel.indptr[-1])].long(), want.indices.long())
    assert sel.counts().tolist() == [k * page + rest] * rows


def _hard_rows() -> dict[str, torch.Tensor]:
    """Rows that stress the bracket search: ties, few distinct values, one outlier far above the rest, a narrow
    spread around a large value, negative scores."""
    g = torch.Generator().manual_seed(3)
    n = 700
    return {
        "equal": torch.full((n,), 2.5),
        "few values": torch.randint(0, 4, (n,), generator=g).float(),
        "outlier": torch.cat([torch.tensor([1e30]), torch.randn(n - 1, generator=g)]),
        "narrow": 1e4 + torch.rand(n, generator=g) * 1e-2,
        "negative": -torch.rand(n, generator=g) * 100,
    }


@pytest.mark.parametrize("search", ["registers", "chunked"])
@pytest.mark.parametrize("name", list(_hard_rows()))
@pytest.mark.parametrize("k", [1, 70, 699, 700])
def test_select_pages_keeps_exactly_k_on_hard_rows(name, k, search, monkeypatch):
    """Whatever the scores, every row keeps exactly k pages (the offsets are fixed by the shapes), and no page left
    out scores more than a kept one beyond the search's resolution, (max - min) / 3^TOP_ITERS (a near-tie is
    broken by page order, like a tie: with an outlier far above the rest, every other page is a near-tie)."""
    from kernels import pages_ops

    if search == "chunked":  # the search re-reads the row in chunks, as past 512K keys
        monkeypatch.setattr(pages_ops, "MAX_SINGLE", 64)
        monkeypatch.setattr(pages_ops, "TOP_CHUNK", 128)
    scores = _hard_rows()[name][None].repeat(2, 1).to(DEVICE)
    keep, sel = pages_ops.select_pages(scores, k, 2, 2 * 700 + 3)
    assert keep.sum(dim=1).tolist() == [k, k]
    resolution = float(scores.max() - scores.min()) / 3 ** pages_ops.TOP_ITERS * 1.01
    for r in range(2):
        kept, left = scores[r][keep[r]], scores[r][~keep[r]]
        assert left.numel() == 0 or float(left.max() - kept.min()) <= resolution
    rows = sel.indices[: int(sel.indptr[-1])].view(2, -1).long()
    want = (torch.nonzero(keep[0]).flatten()[:, None] * 2 + torch.arange(2, device=DEVICE)).flatten()
    assert torch.equal(rows[0, : 2 * k], want) and torch.equal(rows[0, 2 * k :], torch.arange(1400, 1403, device=DEVICE))


def test_select_pages_breaks_ties_by_page_order():
    """Exactly k pages, so that every row reads as many keys: among pages tied with the k-th, the first ones."""
    from kernels.pages_ops import select_pages

    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]], device=DEVICE)
    keep, sel = select_pages(scores, 2, 4, 20)
    assert keep.tolist() == [[False, True, True, False, False]]
    assert sel.indices[: int(sel.indptr[-1])].tolist() == list(range(4, 12))


def test_select_pages_chunked_search(monkeypatch):
    """Rows longer than a register block are searched chunk by chunk (contexts past 512K): the same result."""
    from kernels import pages_ops
    from kernels.reference.pages import select_pages as reference_select

    monkeypatch.setattr(pages_ops, "MAX_SINGLE", 64)
    monkeypatch.setattr(pages_ops, "TOP_CHUNK", 64)
    scores = torch.randn(2, 300, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    keep, sel = pages_ops.select_pages(scores, 30, 4, 1300)
    want_keep, want = reference_select(scores.cpu(), 30, 4, 1300)
    assert torch.equal(keep.cpu(), want_keep)
    assert torch.equal(sel.indices[: int(sel.indptr[-1])].long().cpu(), want.indices.long())


def test_select_pages_counts_past_16_bits():
    """A row of more pages than a 16-bit count holds (the search's packed counts are per chunk there): as topk."""
    from kernels.pages_ops import select_pages
    from kernels.reference.pages import select_pages as reference_select

    scores = torch.randn(1, 70_000, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    keep, sel = select_pages(scores, 7_000, 1, 70_000)
    want_keep, want = reference_select(scores, 7_000, 1, 70_000)
    assert torch.equal(keep, want_keep)
    assert torch.equal(sel.indices[: int(sel.indptr[-1])].long(), want.indices.long())


def test_select_pages_long_rows_as_topk():
    """8 rows of 5000 pages (a row of 80K keys in registers, 8 warps): the same pages as torch.topk."""
    from kernels.pages_ops import select_pages
    from kernels.reference.pages import select_pages as reference_select

    scores = torch.randn(8, 5000, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    keep, sel = select_pages(scores, 500, 16, 5000 * 16 + 100)
    want_keep, want = reference_select(scores, 500, 16, 5000 * 16 + 100)
    assert torch.equal(keep, want_keep)
    assert torch.equal(sel.indices[: int(sel.indptr[-1])].long(), want.indices.long())
