"""Batched decode lookups (kernels/centroid_ops.py select_later / select_now): several sequences, each over a
context of its own (its centroids, counts, starts, number of centroids, keys and tail), planned one by one and
launched together, those of one kind in one launch of each lookup kernel, give each sequence what its lone
cluster_select gives, bit for bit, and the reference's lookup.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1): tiny shapes, blocks
of 16 centroids and a split target that gives the sequences different split and score-block counts. float32 and
float16 only (the interpreter's bfloat16 tl.dot is wrong).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import centroid_ops, compact_ops
from kernels.centroid_ops import LookupConfig, SelectCall, cluster_select, select_later, select_now
from kernels.reference import centroid as reference
from kernels.reference.compact import expand_groups
from kernels.selection import Fixed, KeyCount
from tests.kernels.test_centroid_kernels import (
    DEVICE,
    TOL,
    assert_matches,
    assert_same_selection,
    clustered_counts,
    make_inputs,
    selective_threshold,
)

pytestmark = pytest.mark.usefixtures("one_thread")

HQ, HKV = 4, 2
# (seed, centroids, indexed keys, tail, fixed window): under CONFIG 2, 3 and 5 splits and score blocks
SEQUENCES = [(1, 20, 60, 0, 5), (2, 45, 150, 3, 7), (3, 70, 260, 5, 4)]
CONFIG = LookupConfig(block_m=16, block_c=16, num_warps=1, num_stages=1, target_programs=16)
FOLLOW = torch.tensor([-1, 2, 7, 40, 99, 130, 100, 55, 12], dtype=torch.int64)  # follow rows (KeyCount.listed)

# (cut, step, fixed, dtype, valid): squeeze's lookup cut at the keys less its follow rows; duo-squeeze's, per
# retrieval head with its streaming heads' windows; a calibrated threshold with windows over float16 queries and a
# padded question's count; one over one-byte centroids
CASES = [("keys", False, False, torch.float32, False), ("per_head", True, True, torch.float32, False),
         ("threshold", False, True, torch.float16, True), ("threshold", True, False, torch.float32, False)]


def sequence(seed, c, total, tail, width, cut, step, fixed, dtype, valid, rows=HKV, lq=1):
    """One sequence's SelectCall on DEVICE (keys asked to about 30% of its indexed keys)."""
    q, centroids, _, scale = make_inputs(HQ, HKV, lq, dtype, seed, c=c)
    counts, starts = clustered_counts(HKV, total, c, seed + 10)
    code_step = None
    if step:
        coded = reference.quantize_centroids(centroids.float().cpu())
        centroids, code_step = coded["centroids"].to(DEVICE), coded["centroid_step"].to(DEVICE)
    window = None
    if fixed:
        g = torch.Generator().manual_seed(seed + 20)
        lists = torch.stack([torch.randperm(total + tail, generator=g)[:width].sort().values for _ in range(HKV)])
        streaming = torch.arange(HKV) % 2 == seed % 2  # each sequence's own streaming heads
        window = Fixed(lists.to(torch.int32).to(DEVICE), streaming.to(DEVICE))
    follow = FOLLOW[seed % 3:].to(DEVICE)  # each sequence's own
    keys = None
    if cut == "keys":
        keys = KeyCount(0.3 * total * HKV + 8.0, listed=follow, lo=seed, hi=total - seed, per_listed=2.0)
    elif cut == "per_head":
        keys = KeyCount(0.3 * total, listed=follow, lo=0, hi=total, per_listed=1.0, per_head=True)
    threshold = 0.5
    if keys is None:
        _, score = reference.cluster_keep(q, centroids, counts, scale, 0.0, rows, step=code_step)
        threshold = selective_threshold(score)
    count = torch.tensor([lq], dtype=torch.int64, device=DEVICE) if valid else None
    return SelectCall(q, centroids, counts, scale, threshold, rows, starts, total, tail, fixed=window,
                      step=code_step, valid=count, keys=keys)


class Logged:
    """A kernel whose launches are logged: (name, grid, BATCHED)."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.log.append((self.name, tuple(grid), kwargs.get("BATCHED", False)))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def launches(monkeypatch) -> list:
    """The lookup kernels' launches, in order."""
    log: list = []
    for module, name, short in ((centroid_ops, "centroid_denominator_kernel", "denominator"),
                                (centroid_ops, "centroid_score_kernel", "score"),
                                (centroid_ops, "centroid_score_prefill_kernel", "prefill"),
                                (centroid_ops, "centroid_cut_kernel", "cut"),
                                (compact_ops, "expand_groups_kernel", "expand")):
        monkeypatch.setattr(module, name, Logged(getattr(module, name), short, log))
    return log


def lone(call, config=CONFIG):
    return cluster_select(*call.args(), **call.kwargs(), config=config)


def batched(calls, config=CONFIG, keep=None):
    """select_later of each call, then one select_now: each call's (keep, score, Selection)."""
    pending: list = []
    outs = [select_later(call, pending, config=config) for call in calls]
    assert len(pending) == len(calls)
    select_now(pending, keep)
    assert pending == []
    return outs


def assert_same(got, want):
    """Bit for bit: keep, score, the selection's indptr and its indices up to indptr[-1]."""
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert_same_selection(got[2], want[2])


def assert_reference(call, got):
    """The reference's lookup: scores within float32 summation order, keep the same (a threshold's near-ties
    aside), the selection the expansion of the kept clusters."""
    want = reference.cluster_select(*call.args(), **call.kwargs())
    tol = TOL[call.q.dtype]
    if call.keys is None:
        assert_matches(got[:2], want[:2], call.threshold, tol)
    else:
        torch.testing.assert_close(got[1], want[1], **tol)
        assert torch.equal(got[0], want[0])
    assert_same_selection(got[2], expand_groups(got[0], call.starts, call.total, call.tail, fixed=call.fixed))


@pytest.mark.parametrize("cut,step,fixed,dtype,valid", CASES)
def test_a_batch_of_lookups_over_contexts_of_their_own_is_each_lone_lookup(monkeypatch, launches, cut, step, fixed,
                                                                           dtype, valid):
    """Three sequences of one kind (different centroids, keys, tails, windows, split and score-block counts) in
    one launch of each kernel: each one's keep, score and selection are its lone cluster_select's, bit for bit, and
    the reference's. The cut's histograms start from memory full of other counts: each sequence's denominator
    programs zero its own, and its score programs count their own tickets."""
    fresh = centroid_ops._Cut.new

    def dirty(*args, **kwargs):
        made = fresh(*args, **kwargs)
        made.hist.fill_(977)
        return made

    monkeypatch.setattr(centroid_ops._Cut, "new", staticmethod(dirty))
    calls = [sequence(*seq, cut, step, fixed, dtype, valid) for seq in SEQUENCES]
    keep: list = []
    outs = batched(calls, keep=keep)
    # one launch of each kernel: the denominator's third axis holds 3 sequences x 5 splits (the most), the others'
    # 5 score blocks (the most) of 3 sequences
    names = ["denominator", "score"] + (["cut"] if cut != "threshold" else []) + ["expand"]
    grids = {"denominator": (HKV, 1, 15), "score": (HKV, 5, 3), "cut": (HKV, 5, 3), "expand": (HKV, 5, 3)}
    assert launches == [(name, grids[name], True) for name in names]
    assert len(keep) == (2 * len(names) if DEVICE == "cuda" else 0)  # two tables a launch, for a graph's upload
    for call, got in zip(calls, outs):
        assert_same(got, lone(call))
        assert_reference(call, got)


def test_a_mixed_batch_runs_each_kind_as_its_lone_lookups(launches):
    """Lookups of three kinds interleaved (cut at keys over a row per KV head; a threshold over a row per query
    head; a question's prefill, which no batched kernel takes) and a lone lookup of the engine's default launch
    parameters: each is its lone cluster_select's."""
    calls = []
    for i, seq in enumerate(SEQUENCES[:2]):
        calls.append(sequence(*seq, "keys", False, False, torch.float32, False))
        calls.append(sequence(*seq, "threshold", False, False, torch.float32, False, rows=HQ))
        if i == 0:
            calls.append(sequence(*seq, "threshold", False, False, torch.float32, False, lq=3))
    outs = batched(calls)
    kinds = [(name, True) for name in ("denominator", "score", "cut", "expand", "denominator", "score", "expand")]
    assert [(name, on) for name, _, on in launches] == kinds + [("denominator", False), ("prefill", False),
                                                                ("expand", False)]  # in order of first lookup
    for call, got in zip(calls, outs):
        assert_same(got, lone(call))
    call = sequence(*SEQUENCES[2], "keys", True, False, torch.float32, False)
    assert_same(batched([call], config=None)[0], lone(call, config=None))


def test_each_sequence_reads_its_own_tensors():
    """Two sequences of the same shapes (centroids, keys, tail) over different data: each gets its own lookup
    (a table's entries swapped would give each the other's)."""
    calls = [sequence(seed, 45, 150, 3, 7, "keys", False, False, torch.float32, False) for seed in (4, 5)]
    outs = batched(calls)
    for call, got in zip(calls, outs):
        assert_same(got, lone(call))
    assert not torch.equal(outs[0][1], outs[1][1]) and not torch.equal(outs[0][0], outs[1][0])
    swapped = [replace(calls[0], centroids=calls[1].centroids), replace(calls[1], centroids=calls[0].centroids)]
    assert not torch.equal(batched(swapped)[0][1], outs[0][1])  # the centroids alone move the scores


def test_the_references_later_lookup_is_its_lookup_now():
    """The reference's select_later computes at once (nothing pending) and select_now has nothing to run."""
    calls = [sequence(*seq, cut, False, False, torch.float32, False) for seq, cut in zip(SEQUENCES, ("keys",
                                                                                                     "threshold"))]
    pending: list = []
    for call in calls:
        got = reference.select_later(call, pending)
        assert pending == []
        want = reference.cluster_select(*call.args(), **call.kwargs())
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert_same_selection(got[2], want[2])
    reference.select_now(pending, [])
    assert pending == []
