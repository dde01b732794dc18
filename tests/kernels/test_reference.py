"""kernels.reference and kernels.selection against independent dense float64 computations.

Every reference here is written the slow, obvious way (a loop over query heads, an explicit repeat of the KV heads,
softmax in float64) so that a mistake in the grouped/vectorised code under test cannot be shared by its check.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.layout import ClusterLayout
from kernels.reference.centroid import centroid_log_scores, reduce_scores, row_scores, select_clusters
from kernels.reference.compact import expand_groups
from kernels.reference.merge import merge_attention
from kernels.reference.sparse import _explicit, _fused_cpu, attention_with_lse, sparse_attention
from kernels.selection import Selection

# The code under test computes in float32 from the (exactly upcast) inputs; the references compute in float64 from the
# same values. The only difference is float32 rounding of D-term dot products, an Lk-term softmax sum and an Lk-term
# weighted sum of values of magnitude ~1: a few float32 ulps (~1e-7) times sqrt(Lk) or so, well under 1e-5. A real
# bug (wrong head, wrong mask, wrong scale) moves results by 1e-2 or more.
ATOL, RTOL = 1e-5, 1e-5
# Two float32 computations over the same keys that differ only in summation order / padding (sparse vs masked dense,
# merged halves vs one pass): the same order of magnitude of rounding, so the same tolerance.
F32_ATOL, F32_RTOL = 1e-5, 1e-5

GQA = [(4, 4), (4, 2), (8, 2), (8, 4), (4, 1)]  # (Hq, Hkv): ratios 1, 2, 4, 2, 4
DTYPES = [torch.float32, torch.float16]
D = 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_qkv(hq: int, hkv: int, lq: int, lk: int, dtype: torch.dtype, seed: int = 0):
    """Random q [Hq, Lq, D], k/v [Hkv, Lk, D] in `dtype` (fp16 values are exactly representable in float64)."""
    g = _gen(seed)
    q = torch.randn(hq, lq, D, generator=g).to(dtype)
    k = torch.randn(hkv, lk, D, generator=g).to(dtype)
    v = torch.randn(hkv, lk, D, generator=g).to(dtype)
    return q, k, v


def naive_attention(q, k, v, scale, mask=None):
    """Loop over query heads; KV heads repeated explicitly; float64. mask: [Hq, Lq, Lk] bool or None.

    Returns out [Hq, Lq, D] float64 (0 where nothing is attended), lse [Hq, Lq] float64 (-inf there).
    """
    hq, lq, d = q.shape
    hkv, lk, _ = k.shape
    group = hq // hkv
    k_rep = k.double().repeat_interleave(group, dim=0)  # [Hq, Lk, D]: query head h reads KV head h // group
    v_rep = v.double().repeat_interleave(group, dim=0)
    out = torch.zeros(hq, lq, d, dtype=torch.float64)
    lse = torch.full((hq, lq), -math.inf, dtype=torch.float64)
    for h in range(hq):
        scores = q[h].double() @ k_rep[h].T * scale  # [Lq, Lk]
        if mask is not None:
            scores = scores.masked_fill(~mask[h], -math.inf)
        for i in range(lq):
            if torch.isinf(scores[i]).all():
                continue  # attends to nothing: out 0, lse -inf
            lse[h, i] = torch.logsumexp(scores[i], dim=0)
            out[h, i] = torch.softmax(scores[i], dim=0) @ v_rep[h]
    return out, lse


def assert_attention_close(got, want, atol=ATOL, rtol=RTOL):
    """got/want: (out, lse). -inf lse must match exactly (assert_close treats equal infinities as equal)."""
    out, lse = got
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want[0].double(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), want[1].double(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- attention_with_lse
# attention_with_lse runs `_fused_cpu` on the CPU (torch's fused flash attention) and `_explicit` elsewhere: both
# are held to the naive float64 attention here.
IMPLS = [pytest.param(attention_with_lse, id="dispatch"), pytest.param(_explicit, id="explicit"),
         pytest.param(_fused_cpu, id="fused-cpu")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", GQA)
def test_attention_with_lse_matches_naive(hq, hkv, dtype, impl):
    q, k, v = make_qkv(hq, hkv, lq=5, lk=37, dtype=dtype)
    scale = D**-0.5
    assert_attention_close(impl(q, k, v, scale), naive_attention(q, k, v, scale))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", GQA)
def test_attention_with_lse_per_head_mask_with_fully_masked_rows(hq, hkv, dtype, impl):
    q, k, v = make_qkv(hq, hkv, lq=6, lk=29, dtype=dtype, seed=1)
    scale = 0.3
    mask = torch.rand(hq, 6, 29, generator=_gen(2)) < 0.5  # [Hq, Lq, Lk]
    mask[0, 2] = False  # one query attends to nothing
    mask[hq - 1] = False  # a whole query head attends to nothing
    mask[1, 0] = False
    mask[1, 0, 28] = True  # a query that attends to exactly one key
    out, lse = impl(q, k, v, scale, mask)
    assert_attention_close((out, lse), naive_attention(q, k, v, scale, mask))
    # The fully masked rows are exactly out 0 and lse -inf (not NaN, not a tiny number).
    assert torch.equal(out[0, 2], torch.zeros(D)) and lse[0, 2].item() == -math.inf
    assert torch.equal(out[hq - 1], torch.zeros(6, D)) and torch.isneginf(lse[hq - 1]).all()
    torch.testing.assert_close(out[1, 0], v[(1 * hkv) // hq, 28].float(), atol=0, rtol=0)  # softmax of one key is 1
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_attention_with_lse_shared_causal_mask(hq, hkv, impl):
    """A [Lq, Lk] mask is shared by every head (here: causal over the last Lq keys, first query sees nothing)."""
    lq, lk = 4, 10
    q, k, v = make_qkv(hq, hkv, lq, lk, torch.float32, seed=3)
    pos_q = torch.arange(lk - lq, lk)
    mask = torch.arange(lk)[None, :] < pos_q[:, None]  # [Lq, Lk], strictly causal
    mask[0] = False
    scale = D**-0.5
    got = impl(q, k, v, scale, mask)
    assert_attention_close(got, naive_attention(q, k, v, scale, mask.expand(hq, lq, lk)))
    assert torch.isneginf(got[1][:, 0]).all() and torch.equal(got[0][:, 0], torch.zeros(hq, D))


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_with_lse_mask_broadcast_over_tokens(impl):
    """A [Hq, 1, Lk] mask: each head's keys for all of its tokens (as the follow rows' union in
    tests/kernels/test_follow_kernels.py), one head seeing none."""
    q, k, v = make_qkv(8, 2, 5, 23, torch.float32, seed=4)
    mask = torch.rand(8, 1, 23, generator=_gen(5)) < 0.6
    mask[3] = False
    assert_attention_close(impl(q, k, v, 0.3, mask), naive_attention(q, k, v, 0.3, mask.expand(8, 5, 23)))


def test_attention_with_lse_no_keys():
    q, k, v = make_qkv(4, 2, 3, 0, torch.float32)
    out, lse = attention_with_lse(q, k, v, 1.0)
    assert torch.equal(out, torch.zeros(4, 3, D)) and torch.isneginf(lse).all() and lse.shape == (4, 3)


# ---------------------------------------------------------------- merge_attention


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_merge_of_disjoint_halves_equals_full_attention(hq, hkv):
    lq, lk = 5, 40
    q, k, v = make_qkv(hq, hkv, lq, lk, torch.float32, seed=4)
    scale = D**-0.5
    # Two disjoint, interleaved (not contiguous) key sets, as a fixed context and a dynamic tail would be.
    first = torch.rand(lk, generator=_gen(5)) < 0.4
    part_a = attention_with_lse(q, k[:, first], v[:, first], scale)
    part_b = attention_with_lse(q, k[:, ~first], v[:, ~first], scale)
    merged = merge_attention([part_a, part_b])
    assert_attention_close(merged, attention_with_lse(q, k, v, scale), atol=F32_ATOL, rtol=F32_RTOL)
    assert_attention_close(merged, naive_attention(q, k, v, scale))


def test_merge_with_an_empty_part_is_the_other_part():
    q, k, v = make_qkv(8, 2, 3, 20, torch.float32, seed=6)
    full = attention_with_lse(q, k, v, 0.25)
    empty = attention_with_lse(q, k[:, :0], v[:, :0], 0.25)  # out 0, lse -inf
    for parts in ([full, empty], [empty, full], [empty, full, empty]):
        out, lse = merge_attention(parts)
        # exp(-inf - lse) == 0 and exp(lse - lse) == 1 exactly: the merge is bit-exact here.
        torch.testing.assert_close(out, full[0], atol=0, rtol=0)
        torch.testing.assert_close(lse, full[1], atol=0, rtol=0)


def test_merge_where_rows_are_empty_in_some_or_all_parts():
    """Per-row emptiness: a query that sees nothing in one part takes the other; nothing anywhere gives 0 / -inf."""
    hq, hkv, lq, lk = 4, 2, 3, 16
    q, k, v = make_qkv(hq, hkv, lq, lk, torch.float32, seed=7)
    scale = 0.5
    mask_a = torch.rand(hq, lq, lk, generator=_gen(8)) < 0.5
    mask_a[:, :, 8:] = False  # part A: keys 0..7
    mask_b = torch.rand(hq, lq, lk, generator=_gen(9)) < 0.5
    mask_b[:, :, :8] = False  # part B: keys 8..15
    mask_a[0, 0] = False  # query (0, 0) only in part B
    mask_b[1, 1] = False  # query (1, 1) only in part A
    mask_a[2, 2] = False
    mask_b[2, 2] = False  # query (2, 2) nowhere
    merged = merge_attention([attention_with_lse(q, k, v, scale, mask_a), attention_with_lse(q, k, v, scale, mask_b)])
    assert_attention_close(merged, naive_attention(q, k, v, scale, mask_a | mask_b))
    assert torch.equal(merged[0][2, 2], torch.zeros(D)) and merged[1][2, 2].item() == -math.inf


# ---------------------------------------------------------------- Selection


def test_selection_mask_round_trip_and_counts():
    mask = torch.rand(6, 23, generator=_gen(10)) < 0.3
    mask[2] = False  # empty row
    mask[4] = True  # full row
    sel = Selection.from_mask(mask)
    assert sel.rows == 6 and sel.num_keys == 23
    assert sel.indptr[0].item() == 0 and sel.indptr.dtype == torch.int64 and sel.indices.dtype == torch.int64
    assert torch.equal(sel.counts(), mask.sum(dim=1))
    assert torch.equal(sel.to_mask(), mask)
    for r in range(6):  # sorted indices of exactly the True keys, row by row
        row = sel.indices[sel.indptr[r] : sel.indptr[r + 1]]
        assert torch.equal(row, mask[r].nonzero().flatten())
    # And the other way round: a hand-written CSR survives to_mask -> from_mask.
    hand = Selection(torch.tensor([0, 2, 2, 5]), torch.tensor([1, 7, 0, 3, 9]), num_keys=10)
    again = Selection.from_mask(hand.to_mask())
    assert torch.equal(again.indptr, hand.indptr) and torch.equal(again.indices, hand.indices)
    # Spare capacity past indptr[-1] (as the GPU expansion leaves it, garbage there) is ignored.
    spare = Selection(hand.indptr, torch.cat([hand.indices, torch.tensor([4, 4, 8])]), num_keys=10)
    assert torch.equal(spare.to_mask(), hand.to_mask())


def test_selection_padded():
    hand = Selection(torch.tensor([0, 2, 2, 5, 6]), torch.tensor([1, 7, 0, 3, 9, 4]), num_keys=10)
    idx, valid = hand.padded()
    assert idx.shape == (4, 3) and valid.shape == (4, 3)
    want_valid = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    want_idx = torch.tensor([[1, 7, 0], [0, 0, 0], [0, 3, 9], [4, 0, 0]])  # padding points at key 0
    assert torch.equal(valid, want_valid) and torch.equal(idx, want_idx)


def test_selection_padded_all_empty():
    sel = Selection.from_mask(torch.zeros(3, 8, dtype=torch.bool))
    idx, valid = sel.padded()
    assert idx.shape == (3, 0) and valid.shape == (3, 0)
    assert torch.equal(sel.counts(), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(sel.to_mask(), torch.zeros(3, 8, dtype=torch.bool))


# ---------------------------------------------------------------- sparse_attention


def dense_mask_for(selection: Selection, hq: int, lq: int) -> torch.Tensor:
    """Selection [rows, Lk] -> [Hq, Lq, Lk]: each query head takes its row (rows == Hq) or its KV head's row."""
    mask = selection.to_mask()
    per_head = mask.repeat_interleave(hq // selection.rows, dim=0)  # [Hq, Lk]
    return per_head[:, None, :].expand(hq, lq, mask.shape[1])


def uneven_mask(rows: int, lk: int, seed: int) -> torch.Tensor:
    """[rows, Lk] with a different density per row; with 2+ rows the last is empty, with 3+ the first is full."""
    g = _gen(seed)
    density = torch.linspace(0.2, 0.8, rows)[torch.randperm(rows, generator=g)]
    mask = torch.rand(rows, lk, generator=g) < density[:, None]
    if rows >= 2:
        mask[-1] = False
    if rows >= 3:
        mask[0] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per", ["query", "kv"])
@pytest.mark.parametrize("hq,hkv", GQA)
def test_sparse_attention_matches_masked_dense(hq, hkv, per, dtype):
    lq, lk = 4, 33
    q, k, v = make_qkv(hq, hkv, lq, lk, dtype, seed=11)
    rows = hq if per == "query" else hkv
    sel = Selection.from_mask(uneven_mask(rows, lk, seed=12))
    assert rows == 1 or len(set(sel.counts().tolist())) > 1  # uneven per-row counts
    scale = D**-0.5
    mask = dense_mask_for(sel, hq, lq)
    got = sparse_attention(q, k, v, sel, scale)
    assert_attention_close(got, attention_with_lse(q, k, v, scale, mask), atol=F32_ATOL, rtol=F32_RTOL)
    assert_attention_close(got, naive_attention(q, k, v, scale, mask))
    # The empty row's query heads: out 0, lse -inf.
    empty_heads = (mask.sum(dim=(1, 2)) == 0).nonzero().flatten()
    assert empty_heads.numel() == (hq // rows if rows >= 2 else 0)
    assert torch.isneginf(got[1][empty_heads]).all() and not got[0][empty_heads].any()


@pytest.mark.parametrize("per", ["query", "kv"])
def test_sparse_attention_entirely_empty_selection(per):
    hq, hkv = 8, 2
    q, k, v = make_qkv(hq, hkv, 3, 12, torch.float32, seed=13)
    sel = Selection.from_mask(torch.zeros(hq if per == "query" else hkv, 12, dtype=torch.bool))
    out, lse = sparse_attention(q, k, v, sel, 0.5)
    assert out.shape == (hq, 3, D) and lse.shape == (hq, 3)
    assert torch.equal(out, torch.zeros(hq, 3, D)) and torch.isneginf(lse).all()


def test_sparse_attention_rejects_other_row_counts():
    q, k, v = make_qkv(8, 2, 1, 12, torch.float32)
    with pytest.raises(ValueError):
        sparse_attention(q, k, v, Selection.from_mask(torch.ones(4, 12, dtype=torch.bool)), 1.0)


# ---------------------------------------------------------------- centroid_log_scores


def direct_scores(q, centroids, counts, scale, allowed=None):
    """Eq. 1 directly in float64: S_i = exp(s_i) / sum_{j allowed} N_j exp(s_j), s = scale * q . C.

    allowed: [Hq, Lq, C] bool or None. Returns S [Hq, Lq, C] float64, 0 where not allowed.
    """
    hq, lq, _ = q.shape
    hkv, c, _ = centroids.shape
    out = torch.zeros(hq, lq, c, dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hkv)
        for i in range(lq):
            s = scale * (centroids[kv].double() @ q[h, i].double())  # [C]
            ok = torch.ones(c, dtype=torch.bool) if allowed is None else allowed[h, i]
            denom = sum(counts[kv, j].item() * math.exp(s[j].item()) for j in range(c) if ok[j])
            for j in range(c):
                if ok[j]:
                    out[h, i, j] = math.exp(s[j].item()) / denom
    return out


def make_centroids(hq, hkv, lq, c, seed):
    g = _gen(seed)
    q = torch.randn(hq, lq, D, generator=g)
    centroids = torch.randn(hkv, c, D, generator=g)
    counts = torch.randint(1, 30, (hkv, c), generator=g)
    counts[0, 1] = 0  # empty clusters
    counts[hkv - 1, c - 1] = 0
    return q, centroids, counts


# log S values are O(1..10) in magnitude; float32 log-space arithmetic loses a few ulps of that (~1e-6). Compared as
# S = exp(log S) with rtol 1e-5 (relative error of exp(x) is the absolute error of x) and a tiny atol for S near 0.
S_ATOL, S_RTOL = 1e-9, 1e-5


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2)])
def test_centroid_log_scores_matches_eq1(hq, hkv):
    q, centroids, counts = make_centroids(hq, hkv, lq=3, c=7, seed=14)
    scale = D**-0.5
    log_s = centroid_log_scores(q, centroids, counts, scale)
    assert log_s.shape == (hq, 3, 7) and log_s.dtype == torch.float32
    want = direct_scores(q, centroids, counts, scale)
    torch.testing.assert_close(torch.exp(log_s.double()), want, atol=S_ATOL, rtol=S_RTOL)
    # Empty clusters still have a finite score (the policies drop them by their count, not by S).
    assert torch.isfinite(log_s).all()
    # Normalisation: sum_i N_i S_i == 1 for every query head and token.
    total = (torch.exp(log_s.double()) * counts.double().repeat_interleave(hq // hkv, 0)[:, None, :]).sum(-1)
    torch.testing.assert_close(total, torch.ones(hq, 3, dtype=torch.float64), atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", ["per_head", "per_token"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_centroid_log_scores_allowed_denominator(hq, hkv, shape):
    lq, c = 3, 9
    q, centroids, counts = make_centroids(hq, hkv, lq, c, seed=15)
    g = _gen(16)
    if shape == "per_head":
        allowed = torch.rand(hq, c, generator=g) < 0.6  # [Hq, C], read as [Hq, 1, C]
        allowed[:, 0] = True
        full = allowed[:, None, :].expand(hq, lq, c)
    else:
        allowed = torch.rand(hq, lq, c, generator=g) < 0.6  # [Hq, Lq, C]
        allowed[:, :, 0] = True
        allowed[1, 2] = False
        allowed[1, 2, 4] = True  # a token with a single allowed cluster
        full = allowed
    scale = 0.4
    log_s = centroid_log_scores(q, centroids, counts, scale, allowed=allowed)
    assert log_s.shape == (hq, lq, c)
    want = direct_scores(q, centroids, counts, scale, full)
    torch.testing.assert_close(torch.exp(log_s.double()), want, atol=S_ATOL, rtol=S_RTOL)
    assert torch.isneginf(log_s[~full]).all() and torch.isfinite(log_s[full]).all()
    # Allowing everything is the same as no mask.
    every = torch.ones(hq, lq, c, dtype=torch.bool)
    torch.testing.assert_close(
        centroid_log_scores(q, centroids, counts, scale, allowed=every),
        centroid_log_scores(q, centroids, counts, scale),
        atol=0,
        rtol=0,
    )


# ---------------------------------------------------------------- row_scores / reduce_scores


@pytest.mark.parametrize("hq,hkv,rows", [(4, 4, 4), (8, 2, 2), (8, 2, 8), (4, 1, 1)])
def test_reduce_scores_single_token_is_head_mean_of_S(hq, hkv, rows):
    q, centroids, counts = make_centroids(hq, hkv, lq=1, c=6, seed=17)
    log_s = centroid_log_scores(q, centroids, counts, 0.3)
    s = torch.exp(log_s.double())[:, 0]  # [Hq, C]
    group = hq // rows
    want = torch.stack([s[r * group : (r + 1) * group].mean(dim=0) for r in range(rows)])  # [rows, C]
    got = reduce_scores(log_s, rows)
    assert got.shape == (rows, 6)
    # float32 exp and a mean of <= 4 values: a few ulps.
    torch.testing.assert_close(got.double(), want, atol=1e-9, rtol=1e-6)


def test_reduce_scores_several_tokens_is_max_of_token_mean_and_last_token():
    hq, hkv, rows, lq, c = 8, 2, 2, 5, 6
    q, centroids, counts = make_centroids(hq, hkv, lq, c, seed=18)
    log_s = centroid_log_scores(q, centroids, counts, 0.3)
    s = torch.exp(log_s.double())  # [Hq, Lq, C]
    per_token = s.reshape(rows, hq // rows, lq, c).mean(dim=1)  # [rows, Lq, C]
    want = torch.maximum(per_token.mean(dim=1), per_token[:, -1])
    torch.testing.assert_close(row_scores(log_s, rows).double(), per_token, atol=1e-9, rtol=1e-6)
    torch.testing.assert_close(reduce_scores(log_s, rows).double(), want, atol=1e-9, rtol=1e-6)


# ---------------------------------------------------------------- select_clusters / kept clusters to keys


def test_select_clusters_is_strictly_greater_than_positive_threshold():
    scores = torch.tensor([[0.0, 0.1, 0.2, 0.3], [0.2, 0.2, 0.05, 1.0]])
    assert torch.equal(select_clusters(scores, 0.2), scores > 0.2)
    assert select_clusters(scores, 0.0).all() and select_clusters(scores, -1.0).all()


def loop_key_mask(cluster_mask, labels, dense_tail):
    rows, hkv = cluster_mask.shape[0], labels.shape[0]
    lc = labels.shape[1]
    mask = torch.zeros(rows, lc + dense_tail, dtype=torch.bool)
    for r in range(rows):
        kv = r * hkv // rows
        for j in range(lc):
            mask[r, j] = bool(cluster_mask[r, labels[kv, j]])
        for j in range(lc, lc + dense_tail):
            mask[r, j] = True
    return mask


def kept_keys(cluster_mask: torch.Tensor, labels: torch.Tensor, dense_tail: int):
    """Kept clusters [rows, C] -> Selection of positions in the cluster-permuted K/V (as the policies do)."""
    layout = ClusterLayout.from_labels(labels, cluster_mask.shape[1], dense_tail)
    return expand_groups(cluster_mask, layout.starts, labels.shape[1], dense_tail)


def original_order(mask: torch.Tensor, labels: torch.Tensor, dense_tail: int) -> torch.Tensor:
    """[rows, L] mask over permuted positions -> the same keys in their original positions."""
    rows, hkv = mask.shape[0], labels.shape[0]
    order = ClusterLayout.from_labels(labels, int(labels.max()) + 1, dense_tail).order
    out = torch.zeros_like(mask)
    out.scatter_(1, order.repeat_interleave(rows // hkv, dim=0), mask)
    return out


@pytest.mark.parametrize("dense_tail", [0, 5])
@pytest.mark.parametrize("hkv,rows", [(2, 2), (2, 8), (1, 4), (4, 4)])
def test_kept_clusters_to_keys_matches_loop(hkv, rows, dense_tail):
    """The engine's path: the keys permuted by cluster (ClusterLayout), kept clusters expanded into positions;
    mapped back to the original order, the selection is exactly the kept clusters' keys plus the tail."""
    lc, c = 40, 7
    g = _gen(19)
    labels = torch.randint(0, c, (hkv, lc), generator=g)
    cluster_mask = torch.rand(rows, c, generator=g) < 0.5
    cluster_mask[0] = False  # a row that keeps no cluster (still keeps the dense tail)
    sel = kept_keys(cluster_mask, labels, dense_tail)
    assert sel.rows == rows and sel.num_keys == lc + dense_tail
    want = loop_key_mask(cluster_mask, labels, dense_tail)
    assert torch.equal(original_order(sel.to_mask(), labels, dense_tail), want)
    assert torch.equal(sel.counts(), want.sum(dim=1))
    assert sel.counts()[0].item() == dense_tail


# ---------------------------------------------------------------- the zero-threshold property


@pytest.mark.parametrize("per", ["query", "kv"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_zero_threshold_keeps_every_key_and_equals_dense_attention(hq, hkv, per):
    lc, dense_tail, c, lq = 50, 6, 8, 3
    q, k, v = make_qkv(hq, hkv, lq, lc + dense_tail, torch.float32, seed=20)
    g = _gen(21)
    labels = torch.randint(0, c - 1, (hkv, lc), generator=g)  # cluster c-1 is empty
    counts = torch.stack([torch.bincount(labels[h], minlength=c) for h in range(hkv)])
    centroids = torch.randn(hkv, c, D, generator=g)
    rows = hq if per == "query" else hkv
    scale = D**-0.5
    mean_s = reduce_scores(centroid_log_scores(q, centroids, counts, scale), rows)
    kept = select_clusters(mean_s, 0.0)
    assert kept.all()
    layout = ClusterLayout.from_labels(labels, c, dense_tail)
    sel = expand_groups(kept, layout.starts, lc, dense_tail)
    assert torch.equal(sel.counts(), torch.full((rows,), lc + dense_tail))
    got = sparse_attention(q, layout.permute(k), layout.permute(v), sel, scale)
    assert_attention_close(got, attention_with_lse(q, k, v, scale), atol=F32_ATOL, rtol=F32_RTOL)
