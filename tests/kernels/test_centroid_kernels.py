"""The centroid-lookup kernels (kernels/centroid_ops.py) against kernels.reference.centroid.cluster_keep.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the shapes are
tiny and the blocks small (16 or 32), which puts block tails everywhere: C = 37 centroids, Lq = 7 and 33 tokens,
1..8 query heads per row. No bfloat16 here: the interpreter's bf16 tl.dot is wrong. On a CUDA machine the same small
tests run compiled, and the GPU tests (marker `gpu`) add bfloat16 at the shapes of a 128K context against the
reference computed in float32.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kernels import centroid_ops
from kernels.centroid_ops import LookupConfig, cluster_keep, cluster_keep_list, cluster_select
from kernels.layout import group_starts
from kernels.reference import centroid as reference
from kernels.reference.compact import expand_groups
from kernels.selection import Fixed, KeyCount, Selection

pytestmark = pytest.mark.usefixtures("one_thread")

# Tolerances on score. The kernels and the reference compute from the same (exactly upcast) inputs in float32;
# they differ only in summation order (D-term dot products, blocked / split log-sum-exp, sums over heads and tokens),
# i.e. a few float32 ulps of s (|s| <~ 10) amplified by exp: ~1e-6 relative. float16 inputs are upcast exactly and
# accumulated in float32 on both sides, so the same order, with a little slack. A wrong head, mask, count or token
# moves scores by 10% or more.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.float16: dict(rtol=2e-5, atol=1e-7)}
# bfloat16 on the GPU: tensor-core accumulation order and ex2.approx (~2 ulp) in the exp.
GPU_TOL = dict(rtol=1e-4, atol=1e-9)
CODES16_TOL = dict(rtol=5e-3, atol=1e-9)  # one-byte centroids, 16-bit queries: q * step rounded to float16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the small tests run compiled on a GPU machine
D = 16
C = 37  # not a multiple of any block
KEEP_FRACTION = 0.2  # the "selective" threshold keeps about this share of the allowed clusters

# (Hq, Hkv, rows): GQA ratios 1, 2, 4, with rows = Hkv (shared selection) and rows = Hq (per query head)
GROUPS = [(2, 2, 2), (4, 2, 2), (4, 2, 4), (4, 1, 1), (4, 1, 4)]


def make_inputs(hq, hkv, lq, dtype, seed=0, c=C, d=D):
    """q [Hq, Lq, D], centroids [Hkv, C, D] in `dtype`, counts [Hkv, C] int64 with ~20% empty clusters, scale."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, lq, d, generator=g).to(dtype)
    centroids = torch.randn(hkv, c, d, generator=g).to(dtype)
    counts = torch.randint(1, 9, (hkv, c), generator=g)
    counts[torch.rand(hkv, c, generator=g) < 0.2] = 0
    scale = 2.0 / math.sqrt(d)  # a sharper softmax than 1/sqrt(D): the scores spread more
    return q.to(DEVICE), centroids.to(DEVICE), counts.to(DEVICE), scale


def random_allowed(rows, c, seed, empty_row=True):
    """[rows, C] bool with uneven row densities (10% .. 90%) and, if asked and rows > 1, a row with no candidate."""
    g = torch.Generator().manual_seed(seed)
    density = torch.linspace(0.1, 0.9, rows)[torch.randperm(rows, generator=g)]
    allowed = torch.rand(rows, c, generator=g) < density[:, None]
    if empty_row and rows > 1:
        allowed[rows // 2] = False
    return allowed.to(DEVICE)


def to_csr(allowed, index_dtype=torch.int64, garbage=5, c=C):
    """Dense candidates -> (indptr [rows + 1], idx [nnz + garbage]); the tail holds ids that must be ignored."""
    allowed = allowed.cpu()
    indptr = torch.zeros(allowed.shape[0] + 1, dtype=index_dtype)
    indptr[1:] = torch.cumsum(allowed.sum(dim=1), dim=0)
    idx = allowed.nonzero()[:, 1]
    tail = torch.tensor([0, c - 1, c + 3, -2, 1] * garbage, dtype=torch.int64)[:garbage]  # in range and out of range
    return indptr.to(DEVICE), torch.cat([idx, tail]).to(index_dtype).to(DEVICE)


def selective_threshold(score, allowed=None):
    """A threshold that keeps about KEEP_FRACTION of the (allowed, finite) clusters of the reference score."""
    valid = torch.isfinite(score) if allowed is None else allowed & torch.isfinite(score)
    return torch.quantile(score[valid].double(), 1 - KEEP_FRACTION).item()


def assert_matches(got, want, threshold, tol):
    """score within `tol`; keep exactly equal except where the reference score is a tie with the threshold
    (within the same tolerance: either side is right there)."""
    keep, score = got
    ref_keep, ref_score = want
    assert keep.dtype == torch.bool and score.dtype == torch.float32 and keep.shape == ref_keep.shape
    torch.testing.assert_close(score, ref_score, **tol)
    tie = (ref_score - threshold).abs() <= tol["atol"] + tol["rtol"] * abs(threshold)
    differ = keep != ref_keep
    assert not (differ & ~tie).any(), f"keep differs at {(differ & ~tie).nonzero().tolist()}"


def check_dense(hq, hkv, rows, lq, dtype, with_allowed, config=None, seed=0):
    q, centroids, counts, scale = make_inputs(hq, hkv, lq, dtype, seed)
    allowed = random_allowed(rows, C, seed + 1) if with_allowed else None
    _, ref_score = reference.cluster_keep(q, centroids, counts, scale, 0.0, rows, allowed=allowed)
    for threshold in (0.0, selective_threshold(ref_score, allowed)):
        want = reference.cluster_keep(q, centroids, counts, scale, threshold, rows, allowed=allowed)
        got = cluster_keep(q, centroids, counts, scale, threshold, rows, allowed=allowed, config=config)
        assert_matches(got, want, threshold, TOL[dtype])
        if threshold > 0:  # keeps ~KEEP_FRACTION of the allowed clusters, less the empty ones
            kept = want[0].sum().item() / (want[0].numel() if allowed is None else allowed.sum().item())
            assert 0.05 < kept < 0.35, f"the selective threshold keeps {kept:.0%}"


def check_list(hq, hkv, rows, lq, dtype, index_dtype=torch.int64, config=None, seed=0, reuse_out=False):
    q, centroids, counts, scale = make_inputs(hq, hkv, lq, dtype, seed)
    counts = counts.to(index_dtype)  # int32 counts with int32 lists
    allowed = random_allowed(rows, C, seed + 1)
    indptr, idx = to_csr(allowed, index_dtype)
    _, ref_score = reference.cluster_keep(q, centroids, counts, scale, 0.0, rows, allowed=allowed)
    for threshold in (0.0, selective_threshold(ref_score, allowed)):
        want = reference.cluster_keep(q, centroids, counts, scale, threshold, rows, allowed=allowed)
        out = {}
        if reuse_out:  # stale values from an earlier step must not leak through
            out = dict(out_keep=torch.ones(rows, C, dtype=torch.bool, device=DEVICE),
                       out_score=torch.full((rows, C), 7.0, device=DEVICE))
        got = cluster_keep_list(q, centroids, counts, scale, threshold, rows, indptr, idx, **out, config=config)
        assert_matches(got, want, threshold, TOL[dtype])
        if reuse_out:
            assert got[0] is out["out_keep"] and got[1] is out["out_score"]


def clustered_counts(hkv, lc, c, seed):
    """counts [Hkv, C] of a real layout (each head's clusters partition the same Lc keys, ~20% empty) and its
    starts [Hkv, C + 1]."""
    g = torch.Generator().manual_seed(seed)
    live = torch.rand(hkv, c, generator=g) >= 0.2
    live[:, 0] = True
    labels = torch.stack([torch.nonzero(row)[:, 0][torch.randint(0, int(row.sum()), (lc,), generator=g)]
                          for row in live])  # [Hkv, Lc]
    starts = group_starts(labels, c)
    return (starts[:, 1:] - starts[:, :-1]).to(DEVICE), starts.to(DEVICE)


def assert_same_selection(got, want):
    assert torch.equal(got.indptr.cpu(), want.indptr.cpu()) and got.num_keys == want.num_keys
    nnz = int(want.indptr[-1])
    assert torch.equal(got.indices[:nnz].long().cpu(), want.indices[:nnz].long().cpu())


def check_select(hq, hkv, rows, lq, config=None, seed=0, tail=3):
    q, centroids, _, scale = make_inputs(hq, hkv, lq, torch.float32, seed)
    lc = 150
    counts, starts = clustered_counts(hkv, lc, C, seed + 1)
    _, ref_score = reference.cluster_keep(q, centroids, counts, scale, 0.0, rows)
    for threshold in (0.0, selective_threshold(ref_score)):
        want = reference.cluster_select(q, centroids, counts, scale, threshold, rows, starts, lc, tail)
        keep, score, sel = cluster_select(q, centroids, counts, scale, threshold, rows, starts, lc, tail, config=config)
        assert_matches((keep, score), want[:2], threshold, TOL[torch.float32])
        assert_same_selection(sel, expand_groups(keep, starts, lc, tail))  # the expansion of its own keep
        if torch.equal(keep, want[0]):
            assert_same_selection(sel, want[2])


def padded(q, pad, seed):
    """q [Hq, Lq, D] with `pad` random tokens after its own (a question padded to a captured length), and the count of
    its real tokens ([1] int64, on q's device)."""
    g = torch.Generator().manual_seed(seed)
    extra = (3 * torch.randn(q.shape[0], pad, q.shape[2], generator=g)).to(q.dtype).to(q.device)
    return torch.cat([q, extra], dim=1), torch.tensor([q.shape[1]], dtype=torch.int64, device=q.device)


@pytest.mark.parametrize("hq,hkv,rows", GROUPS)
@pytest.mark.parametrize("lq,pad", [(1, 6), (7, 9), (33, 31), (40, 24), (64, 64),
                                    pytest.param(200, 56, marks=pytest.mark.skipif(DEVICE != "cuda", reason="GPU"))])
def test_padded_tokens_count_in_no_score(hq, hkv, rows, lq, pad):
    """With `valid`, the lookup over a padded question (real tokens first) keeps and scores what the lookup over the
    real tokens alone does: the reference, the dense kernels (both score passes), the candidate lists, and the fused
    selection; the padding's strong queries would move every score if they counted. A padded length that is a
    multiple of the score pass's row block (32 on the CPU, 128 on a GPU: 200 + 56) takes its per-head loop (whole
    blocks of real tokens, then a masked part, or none: 64 + 64), and a row block of padding alone skips the
    denominator pass (64 + 64)."""
    q, centroids, _, scale = make_inputs(hq, hkv, lq, torch.float32, seed=3)
    lc = 150
    counts, starts = clustered_counts(hkv, lc, C, seed=4)
    q_pad, valid = padded(q, pad, seed=5)
    allowed = random_allowed(rows, C, seed=6)
    indptr, idx = to_csr(allowed)
    _, ref_score = reference.cluster_keep(q, centroids, counts, scale, 0.0, rows)
    threshold = selective_threshold(ref_score)
    want = reference.cluster_keep(q, centroids, counts, scale, threshold, rows)
    assert not torch.allclose(reference.cluster_keep(q_pad, centroids, counts, scale, threshold, rows)[1], want[1])
    ref_padded = reference.cluster_keep(q_pad, centroids, counts, scale, threshold, rows, valid=valid)
    assert_matches(ref_padded, want, threshold, TOL[torch.float32])
    assert_matches(cluster_keep(q_pad, centroids, counts, scale, threshold, rows, valid=valid), want, threshold,
                   TOL[torch.float32])
    want_list = reference.cluster_keep(q, centroids, counts, scale, threshold, rows, allowed=allowed)
    got_list = cluster_keep_list(q_pad, centroids, counts, scale, threshold, rows, indptr, idx, valid=valid)
    assert_matches(got_list, want_list, threshold, TOL[torch.float32])
    keep, score, sel = cluster_select(q_pad, centroids, counts, scale, threshold, rows, starts, lc, 3, valid=valid)
    assert_matches((keep, score), want, threshold, TOL[torch.float32])
    assert_same_selection(sel, expand_groups(keep, starts, lc, 3))


@pytest.mark.parametrize("hq,hkv,rows", GROUPS)
@pytest.mark.parametrize("lq", [1, 7])
def test_cluster_select(hq, hkv, rows, lq):
    """Lookup + expansion fused (the score pass sums each block's kept keys) = cluster_keep + expand_groups."""
    check_select(hq, hkv, rows, lq)


@pytest.mark.parametrize("hq,hkv,lq", [(4, 2, 1), (8, 2, 1), (4, 1, 7), (8, 2, 33)])
def test_cluster_select_cut_at_a_number_of_keys(hq, hkv, lq):
    """keys: the best clusters holding about that many keys in all, decided after every score is known from the
    histogram of the scores the score pass adds up: the reference's binned cut (the same keep, the same selection),
    nothing at 0 keys, every non-empty cluster at all of them, the keys worked out by the kernels from a KeyCount
    (listed positions taken out, a floor) the same; and within the keys of the two bins at its edge as near the
    asked keys as the exact cut between whole clusters (reference.cut_threshold)."""
    q, centroids, _, scale = make_inputs(hq, hkv, lq, torch.float32, 11)
    lc, tail = 150, 3
    counts, starts = clustered_counts(hkv, lc, C, 12)
    everything = int(counts.sum())
    listed = torch.tensor([-1, 2, 7, 40, 99, 200, 100], dtype=torch.int64, device=DEVICE)  # 3 within [5, 100)
    for keys in (0.0, 1.0, 0.1 * everything, 0.3 * everything, 0.7 * everything, 2.0 * everything):
        first = None
        for asked in (keys, KeyCount(keys + 12.0, listed=listed, lo=5, hi=100, per_listed=4.0),
                      KeyCount(-3.0, least=keys)):
            assert float(KeyCount.of(asked).value(device=DEVICE)) == pytest.approx(keys, abs=1e-3)
            want = reference.cluster_select(q, centroids, counts, scale, 0.5, hkv, starts, lc, tail, keys=asked)
            keep, score, sel = cluster_select(q, centroids, counts, scale, 0.5, hkv, starts, lc, tail, keys=asked)
            torch.testing.assert_close(score, want[1], **TOL[torch.float32])
            assert torch.equal(keep, want[0]), (keys, asked)
            assert_same_selection(sel, want[2])
            first = keep if first is None else first
            assert torch.equal(keep, first), (keys, asked)  # the same count, however it is asked
        held = int((counts * keep).sum())
        if keys <= 0:
            assert held == 0
            continue
        if keys >= everything:
            assert torch.equal(keep, counts > 0)
            continue
        exact = int((counts * ((score > reference.cut_threshold(score, counts, keys)) & (counts > 0))).sum())
        bins = reference.score_bins(score)
        live = counts > 0
        lowest = bins[keep].min() if keep.any() else bins.max() + 1  # the lowest bin kept
        below = bins[live & ~keep].max() if (live & ~keep).any() else lowest  # the highest left
        boundary = int((counts * ((bins == lowest) | (bins == below))).sum())
        assert abs(held - keys) <= abs(exact - keys) + boundary, (keys, held, exact, boundary)


@pytest.mark.parametrize("lq", [1, 7])
def test_the_cuts_histograms_are_zeroed_whatever_their_memory_held(monkeypatch, lq):
    """The score pass adds into CUT_COPIES histograms and takes its tickets after them, all zeroed by the
    denominator pass's programs in turn (no memset of their own): a cut over memory left full of other counts keeps
    what the reference does, for one token and for a question's tokens."""
    hq, hkv = 8, 2
    q, centroids, _, scale = make_inputs(hq, hkv, lq, torch.float32, 21)
    lc, tail = 150, 3
    counts, starts = clustered_counts(hkv, lc, C, 22)
    keys = 0.3 * float(counts.sum())
    fresh = centroid_ops._Cut.new

    def dirty(*args, **kwargs):
        cut = fresh(*args, **kwargs)
        cut.hist.fill_(977)
        return cut

    monkeypatch.setattr(centroid_ops._Cut, "new", staticmethod(dirty))
    assert centroid_ops.CUT_COPIES > 1
    want = reference.cluster_select(q, centroids, counts, scale, 0.5, hkv, starts, lc, tail, keys=keys)
    keep, score, sel = cluster_select(q, centroids, counts, scale, 0.5, hkv, starts, lc, tail, keys=keys)
    torch.testing.assert_close(score, want[1], **TOL[torch.float32])
    assert torch.equal(keep, want[0])
    assert_same_selection(sel, want[2])


@pytest.mark.parametrize("lq", [1, 7])
def test_centroids_read_ahead_of_the_wait_give_the_same_lookup(lq):
    """A dense lookup's denominator pass reads its first block of centroids before its wait on the queries
    (LookupConfig.read_ahead, the default) or with the rest after it: the same scores, keep and selection, at a
    threshold and cut at a number of keys, with centroid blocks split over programs (several blocks each)."""
    hq, hkv = 8, 2
    q, centroids, _, scale = make_inputs(hq, hkv, lq, torch.float32, 31)
    lc, tail = 150, 3
    counts, starts = clustered_counts(hkv, lc, C, 32)
    for config in (None, LookupConfig(block_m=16, block_c=16, num_warps=1, num_stages=1, target_programs=4)):
        ahead = config or centroid_ops.default_config(q.device, lq, q.shape[-1], q.dtype, C, hkv)
        assert ahead.read_ahead
        for keys in (None, 0.3 * float(counts.sum())):
            got = cluster_select(q, centroids, counts, scale, 0.02, hkv, starts, lc, tail, keys=keys, config=ahead)
            after = cluster_select(q, centroids, counts, scale, 0.02, hkv, starts, lc, tail, keys=keys,
                                   config=replace(ahead, read_ahead=False))
            assert torch.equal(got[1], after[1]) and torch.equal(got[0], after[0]), (config, keys)
            assert_same_selection(got[2], after[2])


@pytest.mark.parametrize("hq,hkv,codes,mode", [(4, 2, False, "passes"), (8, 2, True, "passes"), (4, 1, False, "passes"),
                                                (4, 2, False, "cut"), (8, 2, True, "cut"), (4, 2, False, "expand"),
                                                (8, 2, True, "expand"), (4, 1, False, "expand")])
def test_a_decode_lookup_in_one_launch_is_the_two_passes_bit_for_bit(monkeypatch, hq, hkv, codes, mode):
    """Given lookup_sync's counters, a one-token lookup with a row per KV head runs its denominator and score passes
    as two queues of one launch (centroid_decode_lookup_kernel): the same scores, keep, selection and cut bit for
    bit as the two launches, at a threshold and cut at a number of keys (a KeyCount with listed positions, per head
    or in all, a fixed head), over float or one-byte centroids, with blocks split over programs, a block read ahead of
    the wait or not, (mode "cut") the cut at the keys decided in the same launch and (mode "expand") the expansion
    too (a fixed head's list included); the counters are left zeroed,
    so the next lookup (another head count, another split) reuses them. (Triton's interpreter runs one program at a
    time, to its end: the queues' worst case of programs resident at once, so these runs also show that no program
    waits on one that has not started.)"""
    q, centroids, _, scale = make_inputs(hq, hkv, 1, torch.float16 if codes else torch.float32, 41)
    step = None
    if codes:
        centroids, step, _ = coded(centroids)
    lc, tail = 150, 3
    counts, starts = clustered_counts(hkv, lc, C, 42)
    listed = torch.tensor([-1, 2, 7, 40, 99], dtype=torch.int64, device=DEVICE)
    sync = centroid_ops.lookup_sync(q.device)
    fixed = Fixed(torch.zeros(hkv, 4, dtype=torch.int32, device=DEVICE),
                  torch.arange(hkv, device=DEVICE) == hkv - 1) if hkv > 1 else None
    asks = [dict(threshold=0.02), dict(keys=0.3 * float(counts.sum())),
            dict(keys=KeyCount(20.0, listed=listed, lo=5, hi=100, per_listed=2.0, per_head=True)),
            dict(keys=0.5 * float(counts.sum()), fixed=fixed)]
    small = LookupConfig(block_m=16, block_c=16, num_warps=1, num_stages=1, target_programs=4)
    for config in (None, small, replace(small, one_launch_ahead=True)):
        for ask in asks:
            if "fixed" in ask and ask["fixed"] is None:
                continue
            ask = dict(ask)
            threshold = ask.pop("threshold", 0.5)
            two = cluster_select(q, centroids, counts, scale, threshold, hkv, starts, lc, tail, step=step,
                                 config=config, **ask)
            monkeypatch.setattr(centroid_ops, "ONE_LAUNCH", mode)
            one = cluster_select(q, centroids, counts, scale, threshold, hkv, starts, lc, tail, step=step,
                                 config=config, sync=sync, **ask)
            monkeypatch.setattr(centroid_ops, "ONE_LAUNCH", "passes")
            assert torch.equal(one[1], two[1]) and torch.equal(one[0], two[0]), (config, ask)
            assert_same_selection(one[2], two[2])
            assert not sync.any(), sync
    with pytest.raises(ValueError, match="sync"):
        cluster_select(q, centroids, counts, scale, 0.02, hkv, starts, lc, tail, step=step,
                       sync=torch.zeros(3, dtype=torch.int32, device=DEVICE))


def test_counters_are_not_touched_with_one_launch_off(monkeypatch):
    """centroid_ops.ONE_LAUNCH "off" (a benchmark's switch): a lookup given counters runs its two passes, with the
    same results, and leaves the counters as they were."""
    q, centroids, _, scale = make_inputs(4, 2, 1, torch.float32, 43)
    counts, starts = clustered_counts(2, 150, C, 44)
    keys = 0.3 * float(counts.sum())
    want = cluster_select(q, centroids, counts, scale, 0.5, 2, starts, 150, 3, keys=keys)
    monkeypatch.setattr(centroid_ops, "ONE_LAUNCH", "off")
    sync = torch.full((centroid_ops.SYNC_SLOTS,), 7, dtype=torch.int32, device=DEVICE)  # as no launch could leave them
    got = cluster_select(q, centroids, counts, scale, 0.5, 2, starts, 150, 3, keys=keys, sync=sync)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert_same_selection(got[2], want[2])
    assert (sync == 7).all()


def test_cluster_select_cut_leaves_the_fixed_heads_clusters_out():
    """duo-squeeze's cut: the streaming heads' rows read their windows, and their clusters do not count in the
    histogram (the keys asked are the retrieval heads'): the reference's, and the retrieval head holds about the
    keys asked alone."""
    hq, hkv, lq = 8, 2, 1
    q, centroids, _, scale = make_inputs(hq, hkv, lq, torch.float32, 5)
    lc, tail = 150, 3
    counts, starts = clustered_counts(hkv, lc, C, 6)
    window = torch.tensor([[0, 1, 140, 149, 150, 151, 152]] * hkv, dtype=torch.int32, device=DEVICE)
    fixed = Fixed(window, torch.tensor([False, True], device=DEVICE))
    keys = 0.4 * float(counts[0].sum())
    want = reference.cluster_select(q, centroids, counts, scale, 0.5, hkv, starts, lc, tail, fixed=fixed, keys=keys)
    keep, score, sel = cluster_select(q, centroids, counts, scale, 0.5, hkv, starts, lc, tail, fixed=fixed, keys=keys)
    assert torch.equal(keep[0], want[0][0])  # the retrieval head's clusters: the reference's cut
    assert_same_selection(sel, want[2])
    assert sel.counts().tolist()[1] == 7  # the streaming head: its window
    held = float((counts[0] * keep[0]).sum())
    alone = reference.binned_cut(score[:1], counts[:1], keys)  # the retrieval head cut by itself
    assert held == float((counts[0] * (score[0] > alone)).sum())


@pytest.mark.parametrize("hq,hkv,lq", [(4, 2, 1), (8, 2, 7)])
def test_cluster_keep_among_cut_at_a_number_of_keys(hq, hkv, lq):
    """hsqueeze's level 2 cut at a number of keys: the best of each row's candidates, from the histogram of the
    candidates' scores (the reference's binned cut over the candidates); never a cluster off the candidates, even
    where every candidate is kept; nothing at 0 keys; a KeyCount less the index elements the lookup reads (summed
    by the kernels from the elements its score pass writes) the reference's."""
    from kernels.centroid_ops import cluster_keep_among

    q, centroids, _, scale = make_inputs(hq, hkv, lq, torch.float32, 21)
    counts, _ = clustered_counts(hkv, 150, C, 22)
    allowed = random_allowed(hkv, C, 23, empty_row=False)
    indptr, idx = to_csr(allowed, torch.int64)
    candidates = Selection(indptr, idx, C)
    among = float((counts * allowed.to(DEVICE)).sum())
    for keys in (0.0, 0.2 * among, 0.6 * among, 3.0 * among):
        want = reference.cluster_keep_among(q, centroids, counts, scale, 0.5, hkv, candidates, keys=keys)
        keep, score, _ = cluster_keep_among(q, centroids, counts, scale, 0.5, hkv, candidates, keys=keys)
        torch.testing.assert_close(score, want[1], **TOL[torch.float32])
        assert torch.equal(keep, want[0]), keys
        assert not keep[~allowed.to(DEVICE)].any()
        if keys == 0:
            assert not keep.any()
        if keys > among:
            assert torch.equal(keep, allowed.to(DEVICE) & (counts > 0))
        asked = KeyCount(keys + 40.0, per_read=0.5)
        want = reference.cluster_keep_among(q, centroids, counts, scale, 0.5, hkv, candidates, read=(3.0, 2.0),
                                            keys=asked)
        keep, score, read = cluster_keep_among(q, centroids, counts, scale, 0.5, hkv, candidates, read=(3.0, 2.0),
                                               keys=asked)
        torch.testing.assert_close(read, want[2])
        assert torch.equal(keep, want[0]), (keys, float(asked.value(read)))


@pytest.mark.parametrize("c", [C, 600])
def test_cluster_select_among_expands_what_its_cut_kept(c):
    """hsqueeze's level 2 with its expansion: at a number of keys the cut also sums the kept keys per block of
    CUT_BLOCK clusters and the expansion reads them (600 clusters: three blocks); at a threshold, and with no
    candidate at all, the expansion of its own. Keep, scores and the Selection are the reference's (its
    cluster_keep_among, then expand_groups)."""
    from kernels.centroid_ops import cluster_select_among

    hq, hkv, lq, lc, tail = 4, 2, 1, 4 * c, 3
    q, centroids, _, scale = make_inputs(hq, hkv, lq, torch.float32, 31, c=c)
    counts, starts = clustered_counts(hkv, lc, c, 32)
    allowed = random_allowed(hkv, c, 33, empty_row=False)
    indptr, idx = to_csr(allowed, torch.int64, c=c)
    candidates = Selection(indptr, idx, c)
    among = float((counts * allowed.to(DEVICE)).sum())
    nothing = Selection(torch.zeros(hkv + 1, dtype=torch.int64, device=DEVICE), idx, c)
    for cands, keys in ((candidates, 0.3 * among), (candidates, 0.0), (candidates, 2.0 * among),
                        (candidates, KeyCount(0.5 * among, per_read=0.5)), (candidates, None), (nothing, 0.3 * among)):
        args = (q, centroids, counts, scale, 0.02, hkv, cands, starts, lc, tail)
        want = reference.cluster_select_among(*args, read=(3.0, 2.0), keys=keys)
        keep, score, read, sel = cluster_select_among(*args, read=(3.0, 2.0), keys=keys)
        assert torch.equal(keep, want[0]), keys
        torch.testing.assert_close(score, want[1], **TOL[torch.float32])
        torch.testing.assert_close(read, want[2])
        assert_same_selection(sel, want[3])


def test_cluster_select_with_fixed_rows():
    """The streaming heads of duo-squeeze: rows of the marked heads read a fixed list instead of their clusters and
    the tail, written by the fused expansion; the result is the reference's (its expansion, then replace_rows)."""
    hq, hkv, lq = 8, 2, 1
    q, centroids, _, scale = make_inputs(hq, hkv, lq, torch.float32, 5)
    lc, tail = 150, 3
    counts, starts = clustered_counts(hkv, lc, C, 6)
    window = torch.tensor([[0, 1, 140, 149, 150, 151, 152]] * hkv, dtype=torch.int32, device=DEVICE)
    for rows in (hkv, hq):
        fixed = Fixed(window, torch.tensor([False, True], device=DEVICE))
        want = reference.cluster_select(q, centroids, counts, scale, 0.0, rows, starts, lc, tail, fixed=fixed)
        keep, score, sel = cluster_select(q, centroids, counts, scale, 0.0, rows, starts, lc, tail, fixed=fixed)
        assert torch.equal(keep, want[0])
        assert_same_selection(sel, want[2])
        assert sel.counts().tolist()[rows // 2:] == [7] * (rows // 2)  # the second head's rows: the window


def test_cluster_select_score_tiles():
    """The score pass with its own tiles: several centroid blocks per row (block sums read across blocks and rows),
    one denominator split per block."""
    config = LookupConfig(block_m=16, block_c=16, num_warps=1, num_stages=1, target_programs=64, max_splits=3,
                          score_block_m=32, score_block_c=16, score_warps=2)
    check_select(8, 2, 8, 7, config=config, tail=0)
    check_select(4, 2, 2, 1, config=replace(config, score_block_c=32, score_block_m=16), seed=3)


# ---------------------------------------------------------------------------------------------------------------- dense


@pytest.mark.parametrize("hq,hkv,rows", GROUPS)
@pytest.mark.parametrize("lq", [1, 7, 33])
def test_cluster_keep_float32(hq, hkv, rows, lq):
    check_dense(hq, hkv, rows, lq, torch.float32, with_allowed=False)


@pytest.mark.parametrize(
    "hq,hkv,rows,lq,dtype",
    [
        (4, 2, 2, 1, torch.float32),
        (4, 2, 4, 7, torch.float32),
        (4, 1, 1, 33, torch.float32),
        (2, 2, 2, 7, torch.float16),
        (4, 1, 4, 1, torch.float16),
    ],
)
def test_cluster_keep_allowed(hq, hkv, rows, lq, dtype):
    check_dense(hq, hkv, rows, lq, dtype, with_allowed=True)


@pytest.mark.parametrize("hq,hkv,rows,lq", [(4, 2, 2, 1), (4, 1, 4, 7), (2, 2, 2, 33)])
def test_cluster_keep_float16(hq, hkv, rows, lq):
    check_dense(hq, hkv, rows, lq, torch.float16, with_allowed=False)


@pytest.mark.parametrize("lq", [1, 7])
def test_cluster_keep_split_and_block_shapes(lq):
    """The denominator split over several programs (partials merged in the score pass), larger row blocks, and a
    head_dim that is not a power of two (masked up to the next one)."""
    check_dense(8, 2, 2, lq, torch.float32, with_allowed=True, config=LookupConfig(block_m=16, block_c=16,
                num_warps=1, num_stages=1, target_programs=64, max_splits=3))
    q, centroids, counts, scale = make_inputs(4, 2, lq, torch.float32, d=24)
    want = reference.cluster_keep(q, centroids, counts, scale, 0.03, 2)
    assert_matches(cluster_keep(q, centroids, counts, scale, 0.03, 2), want, 0.03, TOL[torch.float32])


def test_cluster_keep_empty_denominators():
    """A KV head whose clusters are all empty has no denominator: S = +inf, nothing kept (as the reference). A row
    whose allowed clusters are all empty gets +inf on them; a row with nothing allowed gets 0 everywhere."""
    q, centroids, counts, scale = make_inputs(4, 2, 3, torch.float32)
    counts[1] = 0
    want = reference.cluster_keep(q, centroids, counts, scale, 0.05, 2)
    got = cluster_keep(q, centroids, counts, scale, 0.05, 2)
    assert torch.isinf(want[1][1]).all()
    assert_matches(got, want, 0.05, TOL[torch.float32])
    allowed = torch.ones(2, C, dtype=torch.bool, device=DEVICE)
    allowed[0] = counts[0] == 0
    allowed[1] = False
    want = reference.cluster_keep(q, centroids, counts, scale, 0.0, 2, allowed=allowed)
    got = cluster_keep(q, centroids, counts, scale, 0.0, 2, allowed=allowed)
    assert_matches(got, want, 0.0, TOL[torch.float32])
    assert not got[0].any() and (got[1][1] == 0).all()


# ----------------------------------------------------------------------------------------------------------------- list


@pytest.mark.parametrize("hq,hkv,rows", GROUPS)
@pytest.mark.parametrize("lq", [1, 7, 33])
def test_cluster_keep_list_float32(hq, hkv, rows, lq):
    check_list(hq, hkv, rows, lq, torch.float32)


@pytest.mark.parametrize("hq,hkv,rows,lq", [(4, 2, 2, 1), (4, 1, 4, 7), (2, 2, 2, 33)])
def test_cluster_keep_list_float16_int32_indices(hq, hkv, rows, lq):
    check_list(hq, hkv, rows, lq, torch.float16, index_dtype=torch.int32)


@pytest.mark.parametrize("lq", [1, 7])
def test_cluster_keep_list_split_and_reused_outputs(lq):
    check_list(8, 2, 8, lq, torch.float32, reuse_out=True, config=LookupConfig(block_m=16, block_c=16, num_warps=1,
               num_stages=1, target_programs=64, max_splits=2))


def test_cluster_keep_list_of_every_cluster_is_the_dense_lookup():
    q, centroids, counts, scale = make_inputs(4, 2, 7, torch.float32)
    indptr, idx = to_csr(torch.ones(2, C, dtype=torch.bool), garbage=0)
    got = cluster_keep_list(q, centroids, counts, scale, 0.04, 2, indptr, idx)
    assert_matches(got, cluster_keep(q, centroids, counts, scale, 0.04, 2), 0.04, TOL[torch.float32])


def test_cluster_keep_list_without_candidates():
    q, centroids, counts, scale = make_inputs(4, 2, 1, torch.float32)
    indptr = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    for idx in (torch.zeros(0, dtype=torch.int64), torch.tensor([3, 4, 5])):  # no capacity / only garbage
        read = torch.full((2,), -1.0, device=DEVICE)
        keep, score = cluster_keep_list(q, centroids, counts, scale, 0.0, 2, indptr, idx.to(DEVICE),
                                        out_keep=torch.ones(2, C, dtype=torch.bool, device=DEVICE),
                                        out_score=torch.full((2, C), 7.0, device=DEVICE), out_read=(read, 3.5, 2.0))
        assert not keep.any() and not score.any() and read.tolist() == [3.5, 3.5]


@pytest.mark.parametrize("hq,hkv,rows", [(4, 2, 2), (8, 2, 8)])
def test_cluster_keep_among_counts_the_index_it_read(hq, hkv, rows):
    """With `read` = (base, per), the level-2 lookup also says what it read of each KV head's index: base + per x the
    candidates of the head's rows (the score pass writes it where rows are the KV heads; otherwise torch adds it
    up), as the reference says; keep and score as without it, and zero off the candidates in fresh outputs."""
    from kernels.centroid_ops import cluster_keep_among

    q, centroids, counts, scale = make_inputs(hq, hkv, 1, torch.float32)
    allowed = random_allowed(rows, C, 3)
    indptr, idx = to_csr(allowed, torch.int64)
    candidates = Selection(indptr, idx, C)
    keep, score, read = cluster_keep_among(q, centroids, counts, scale, 0.02, rows, candidates, read=(130.5, 65.0))
    want = reference.cluster_keep_among(q, centroids, counts, scale, 0.02, rows, candidates, read=(130.5, 65.0))
    assert_matches((keep, score), want[:2], 0.02, TOL[torch.float32])
    assert not keep[~allowed.to(DEVICE)].any() and not score[~allowed.to(DEVICE)].any()
    per_head = allowed.reshape(hkv, -1).sum(dim=1).double().cpu()
    torch.testing.assert_close(read.cpu(), (130.5 + 65.0 * per_head).float())
    torch.testing.assert_close(want[2].cpu(), (130.5 + 65.0 * per_head).float())
    assert cluster_keep_among(q, centroids, counts, scale, 0.02, rows, candidates)[2] is None


def coded(centroids):
    """One-byte centroids (reference.quantize_centroids): (codes, their step, the float32 centroids they encode)."""
    codes = reference.quantize_centroids(centroids.float())
    dequantized = reference.dequantize_centroids(codes["centroids"], codes["centroid_offset"], codes["centroid_step"])
    return codes["centroids"], codes["centroid_step"], dequantized


@pytest.mark.parametrize("hq,hkv,rows,lq", [(4, 2, 2, 1), (4, 1, 4, 7), (2, 2, 2, 33)])
def test_one_byte_centroids(hq, hkv, rows, lq):
    """uint8 codes with their step (kernels.reference.centroid.quantize_centroids): the kernels scale q by the step
    as they load it and read the codes as values; the dense lookup, the candidate lists and the fused select give
    eq. 1's S over the dequantized centroids (the q . offset term is the same for every centroid of a head and
    token, and cancels in S), within float32 rounding; and they match the reference on the codes exactly as on
    float centroids."""
    q, centroids, counts, scale = make_inputs(hq, hkv, lq, torch.float32, seed=5)
    codes, step, dequantized = coded(centroids)
    assert codes.dtype == torch.uint8 and step.shape == (hkv, D)
    _, ref_score = reference.cluster_keep(q, dequantized, counts, scale, 0.0, rows)
    _, code_score = reference.cluster_keep(q, codes, counts, scale, 0.0, rows, step=step)
    torch.testing.assert_close(code_score, ref_score, rtol=1e-4, atol=1e-7)
    threshold = selective_threshold(ref_score)
    want = reference.cluster_keep(q, codes, counts, scale, threshold, rows, step=step)
    assert_matches(cluster_keep(q, codes, counts, scale, threshold, rows, step=step), want, threshold,
                   TOL[torch.float32])
    allowed = random_allowed(rows, C, seed=6)
    indptr, idx = to_csr(allowed)
    want = reference.cluster_keep(q, codes, counts, scale, threshold, rows, allowed=allowed, step=step)
    got = cluster_keep_list(q, codes, counts, scale, threshold, rows, indptr, idx, step=step)
    assert_matches(got, want, threshold, TOL[torch.float32])
    counts, starts = clustered_counts(hkv, 150, C, seed=7)
    want = reference.cluster_select(q, codes, counts, scale, threshold, rows, starts, 150, 3, step=step)
    keep, score, sel = cluster_select(q, codes, counts, scale, threshold, rows, starts, 150, 3, step=step)
    assert_matches((keep, score), want[:2], threshold, TOL[torch.float32])
    assert_same_selection(sel, expand_groups(keep, starts, 150, 3))


@pytest.mark.parametrize("hq,hkv,rows,lq", [(4, 2, 2, 1), (4, 1, 4, 7)])
def test_one_byte_centroids_with_16_bit_queries(hq, hkv, rows, lq):
    """float16 queries over codes: the kernels' dots run in float16 over 1024 + code (the codes' bits, no
    conversion; the 1024 cancels in S) with q * step rounded to float16: S within that rounding of the float32
    reference's (rtol 5e-3)."""
    q, centroids, counts, scale = make_inputs(hq, hkv, lq, torch.float16, seed=11)
    codes, step, _ = coded(centroids)
    counts, starts = clustered_counts(hkv, 150, C, seed=12)
    _, ref_score = reference.cluster_keep(q, codes, counts, scale, 0.0, rows, step=step)
    threshold = selective_threshold(ref_score)
    keep, score, sel = cluster_select(q, codes, counts, scale, threshold, rows, starts, 150, 3, step=step)
    torch.testing.assert_close(score, ref_score, rtol=5e-3, atol=1e-7)
    assert_same_selection(sel, expand_groups(keep, starts, 150, 3))
    want_keep = reference.cluster_keep(q, codes, counts, scale, threshold, rows, step=step)[0]
    assert (keep != want_keep).float().mean() < 0.05  # only near-ties with the threshold may differ


@pytest.mark.parametrize("lq,pad", [(9, 0), (16, 5)])
def test_codes_widened_before_a_long_prefill_give_the_same_lookup(monkeypatch, lq, pad):
    """A dense lookup over WIDE_CODES_TOKENS tokens or more takes the one-byte codes widened to float16 1024 + code
    before its passes (centroid_ops.wide_codes), where a shorter one turns them in its tiles: the same operands, so
    the same keep, score and selection, bit for bit, padded tokens or not."""
    q, centroids, _, scale = make_inputs(4, 2, lq, torch.float16, seed=21)
    codes, step, _ = coded(centroids)
    counts, starts = clustered_counts(2, 150, C, seed=22)
    valid = torch.tensor([lq - pad], device=DEVICE) if pad else None
    assert torch.equal(centroid_ops.wide_codes(codes).view(torch.int16), codes.to(torch.int16) + 0x6400)
    got = {}
    for widen in (False, True):
        monkeypatch.setattr(centroid_ops, "WIDE_CODES_TOKENS", 1 if widen else 10**9)
        got[widen] = cluster_select(q, codes, counts, scale, 0.02, 2, starts, 150, 3, step=step, valid=valid)
    for a, b in zip(got[False][:2], got[True][:2]):
        assert torch.equal(a, b)
    assert_same_selection(got[True][2], got[False][2])


def test_quantized_centroids_are_within_half_a_step():
    """Each element of a dequantized centroid is within step / 2 of the centroid (round to nearest), per KV head
    and dim; a dim whose centroids all agree is kept exactly."""
    g = torch.Generator().manual_seed(8)
    centroids = torch.randn(3, 50, D, generator=g)
    centroids[1, :, 4] = 0.25
    codes = reference.quantize_centroids(centroids)
    back = reference.dequantize_centroids(codes["centroids"], codes["centroid_offset"], codes["centroid_step"])
    step = codes["centroid_step"][:, None, :]
    assert ((back - centroids).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert torch.equal(back[1, :, 4], centroids[1, :, 4])


def test_argument_checks():
    q, centroids, counts, scale = make_inputs(4, 2, 1, torch.float32)
    with pytest.raises(ValueError):
        cluster_keep(q, centroids, counts, scale, 0.1, 3)
    with pytest.raises(TypeError):
        cluster_keep(q, centroids.half(), counts, scale, 0.1, 2)
    with pytest.raises(TypeError):
        cluster_keep(q, centroids.to(torch.int8), counts, scale, 0.1, 2)  # codes are uint8
    codes, step, _ = coded(centroids)
    with pytest.raises(ValueError):
        cluster_keep(q, centroids, counts, scale, 0.1, 2, step=step)  # a step goes with codes
    with pytest.raises(ValueError):
        cluster_keep(q, codes, counts, scale, 0.1, 2, step=step[:, :-1])
    with pytest.raises(ValueError):
        cluster_keep(q, centroids, counts, scale, 0.1, 2, allowed=torch.ones(4, C, dtype=torch.bool, device=DEVICE))
    index = dict(dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError):
        cluster_keep_list(q, centroids, counts, scale, 0.1, 2, torch.zeros(2, **index), torch.zeros(1, **index))
    with pytest.raises(TypeError):
        cluster_keep_list(q, centroids, counts, scale, 0.1, 2, torch.zeros(3, device=DEVICE), torch.zeros(1, **index))
    with pytest.raises(TypeError):
        cluster_keep(q, centroids, counts, scale, torch.tensor(0.1), 2)
    with pytest.raises(ValueError):
        LookupConfig(block_m=8)


# ------------------------------------------------------------------------------------------------------------------ GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def exact_float32_matmul():
    """The float32 reference must not round its matmul through TF32."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def no_host_sync(fn, *args, **kwargs):
    """Run fn with CUDA's sync debug mode set to error: any synchronising call (.item(), nonzero, ...) raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(*args, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def gpu_inputs(lq, seed=0, hq=32, hkv=8, d=128, c=6554):
    """bfloat16 q / centroids at a 128K context (C = 5%), counts summing to ~128K per KV head."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(hq, lq, d, device="cuda", generator=g).bfloat16()
    centroids = torch.randn(hkv, c, d, device="cuda", generator=g).bfloat16()
    counts = torch.randint(0, 41, (hkv, c), device="cuda", generator=g)
    return q, centroids, counts, 1.0 / math.sqrt(d)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lq", [1, 1024])
@pytest.mark.parametrize("group", ["kv", "query"])
def test_gpu_cluster_keep_bfloat16(lq, group, exact_float32_matmul):
    q, centroids, counts, scale = gpu_inputs(lq)
    rows = 8 if group == "kv" else 32
    _, ref_score = reference.cluster_keep(q.float(), centroids.float(), counts, scale, 0.0, rows)
    threshold = selective_threshold(ref_score)
    want = reference.cluster_keep(q.float(), centroids.float(), counts, scale, threshold, rows)
    got = no_host_sync(cluster_keep, q, centroids, counts, scale, threshold, rows)
    assert_matches(got, want, threshold, GPU_TOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lq", [1, 1024])
@pytest.mark.parametrize("group", ["kv", "query"])
def test_gpu_cluster_keep_list_bfloat16(lq, group, exact_float32_matmul):
    q, centroids, counts, scale = gpu_inputs(lq, seed=1)
    rows, c = (8 if group == "kv" else 32), centroids.shape[1]
    allowed = random_allowed(rows, c, seed=2)
    indptr, idx = to_csr(allowed, torch.int32, garbage=100, c=c)
    _, ref_score = reference.cluster_keep(q.float(), centroids.float(), counts, scale, 0.0, rows, allowed=allowed)
    threshold = selective_threshold(ref_score, allowed)
    want = reference.cluster_keep(q.float(), centroids.float(), counts, scale, threshold, rows, allowed=allowed)
    got = no_host_sync(cluster_keep_list, q, centroids, counts, scale, threshold, rows, indptr, idx)
    assert_matches(got, want, threshold, GPU_TOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lq", [1, 1024])
def test_gpu_one_byte_centroids(lq, exact_float32_matmul):
    """bf16 queries over uint8 codes with their step at 128K, 5% centroids: the reference over the codes is S over
    the dequantized centroids (float32); the select matches it within the float16 rounding of q * step."""
    q, centroids, _, scale = gpu_inputs(lq, seed=9)
    codes, step, dequantized = coded(centroids)
    hkv, c = codes.shape[:2]
    lc = 131072 - 32
    labels = torch.randint(0, c, (hkv, lc), device="cuda", generator=torch.Generator(device="cuda").manual_seed(10))
    starts = group_starts(labels, c)
    counts = starts[:, 1:] - starts[:, :-1]
    _, ref_score = reference.cluster_keep(q, codes, counts, scale, 0.0, hkv, step=step)
    _, float_score = reference.cluster_keep(q.float(), dequantized, counts, scale, 0.0, hkv)
    torch.testing.assert_close(ref_score, float_score, rtol=1e-4, atol=1e-9)
    threshold = selective_threshold(ref_score)
    want = reference.cluster_keep(q, codes, counts, scale, threshold, hkv, step=step)
    keep, score, sel = no_host_sync(cluster_select, q, codes, counts, scale, threshold, hkv, starts, lc, 32, step=step)
    assert_matches((keep, score), want, threshold, CODES16_TOL)
    assert_same_selection(sel, expand_groups(keep, starts, lc, 32))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lq,length", [(1, 131072), (1, 524288), (1024, 131072)])
def test_gpu_cluster_select_bfloat16(lq, length, exact_float32_matmul):
    """At 128K (6.5K centroids) and 512K (26K: the long-context decode tiles) against the float32 reference."""
    q, centroids, _, scale = gpu_inputs(lq, seed=3, c=length // 20)
    hkv, c = centroids.shape[:2]
    lc = length - 100
    labels = torch.randint(0, c, (hkv, lc), device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    starts = group_starts(labels, c)
    counts = starts[:, 1:] - starts[:, :-1]
    _, ref_score = reference.cluster_keep(q.float(), centroids.float(), counts, scale, 0.0, hkv)
    threshold = selective_threshold(ref_score)
    want = reference.cluster_keep(q.float(), centroids.float(), counts, scale, threshold, hkv)
    keep, score, sel = no_host_sync(cluster_select, q, centroids, counts, scale, threshold, hkv, starts, lc, 100)
    assert_matches((keep, score), want, threshold, GPU_TOL)
    assert_same_selection(sel, expand_groups(keep, starts, lc, 100))
    # duo-squeeze's form: every other head reads a window (320 places and the 100 dense rows) instead
    window = torch.cat([torch.randperm(lc, device="cuda")[:320].sort().values,
                        torch.arange(lc, lc + 100, device="cuda")]).to(torch.int32).expand(hkv, -1).contiguous()
    fixed = Fixed(window, torch.arange(hkv, device="cuda") % 2 == 1)
    keep, score, sel = no_host_sync(cluster_select, q, centroids, counts, scale, threshold, hkv, starts, lc, 100,
                                    fixed=fixed)
    want_sel = expand_groups(keep, starts, lc, 100, fixed=fixed)
    assert torch.equal(sel.indptr, want_sel.indptr)
    n = int(want_sel.indptr[-1])
    assert torch.equal(sel.indices[:n].long(), want_sel.indices[:n].long())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lq", [1, 1024])
def test_gpu_cut_at_a_number_of_keys_at_128k(lq, exact_float32_matmul):
    """The cut inside the kernels at a 128K context (6.5K centroids a KV head, bfloat16), with no host
    synchronisation: its keep is the reference's binned cut of the same scores at the keys asked (10% and 30% of
    them, the follow rows' count taken out on the device), but for clusters whose score sits on a bin edge, so it
    keeps the keys that cut keeps within 0.1% of all keys. (How near that is to the keys asked depends on how many
    keys the bin at the cut holds: random queries and centroids crowd their scores into a few bins.)"""
    q, centroids, _, scale = gpu_inputs(lq, seed=13)
    hkv, c = centroids.shape[:2]
    lc = 131072 - 100
    labels = torch.randint(0, c, (hkv, lc), device="cuda", generator=torch.Generator(device="cuda").manual_seed(14))
    starts = group_starts(labels, c)
    counts = starts[:, 1:] - starts[:, :-1]
    everything = float(counts.sum())
    for share in (0.1, 0.3):
        listed = torch.arange(-1, 1000, 7, device="cuda")  # the follow rows of a step: 142 within [0, 1000)
        keys = KeyCount(share * everything + 2.0 * 142, listed=listed, lo=0, hi=1000, per_listed=2.0)
        keep, score, sel = no_host_sync(cluster_select, q, centroids, counts, scale, 0.5, hkv, starts, lc, 100,
                                        keys=keys)
        want = (score > reference.binned_cut(score, counts, share * everything)) & (counts > 0)
        held, want_held = float((counts * keep).sum()), float((counts * want).sum())
        assert abs(held - want_held) <= 1e-3 * everything, (share, held, want_held)
        assert (keep != want).float().mean() <= 1e-3
        assert_same_selection(sel, expand_groups(keep, starts, lc, 100))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("length", [131072, 524288])
@pytest.mark.parametrize("mode", ["passes", "cut", "expand"])
def test_gpu_decode_lookup_in_one_launch_at_long_contexts(monkeypatch, length, mode, exact_float32_matmul):
    """The one-launch decode lookup at 128K and 512K (bfloat16 queries over one-byte centroids, the default tiles),
    repeated on the same counters: bit for bit the two passes' scores, keep and selection, cut at 10% of the keys
    asked with listed follow rows, with no host synchronisation; the counters left zeroed."""
    q, centroids, _, scale = gpu_inputs(1, seed=17, c=length // 20)
    codes, step, _ = coded(centroids)
    hkv, c = codes.shape[:2]
    lc = length - 100
    labels = torch.randint(0, c, (hkv, lc), device="cuda", generator=torch.Generator(device="cuda").manual_seed(18))
    starts = group_starts(labels, c)
    counts = starts[:, 1:] - starts[:, :-1]
    listed = torch.arange(-1, 1000, 7, device="cuda")
    keys = KeyCount(0.1 * float(counts.sum()), listed=listed, lo=0, hi=1000, per_listed=2.0)
    sync = centroid_ops.lookup_sync(q.device)
    two = cluster_select(q, codes, counts, scale, 0.5, hkv, starts, lc, 100, step=step, keys=keys)
    monkeypatch.setattr(centroid_ops, "ONE_LAUNCH", mode)
    for _ in range(3):
        one = no_host_sync(cluster_select, q, codes, counts, scale, 0.5, hkv, starts, lc, 100, step=step, keys=keys,
                           sync=sync)
        assert torch.equal(one[1], two[1]) and torch.equal(one[0], two[0])
        assert_same_selection(one[2], two[2])
        assert not sync.any()
