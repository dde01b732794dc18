"""A decode step's one-pass attention (kernels/jit/union.py: the selection's keys, the follow rows and the new tokens
as items of one split-KV launch, one merge into the layer's output) against its reference, and the reference
against dense attention over the union of the three key sets. Without CUDA the kernels run in the Triton
interpreter (tests/conftest.py): float32 and float16 there; bfloat16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import union_ops
from kernels.reference import union as reference
from kernels.reference.follow import follow_rows
from kernels.reference.sparse import attention_with_lse
from kernels.selection import FollowRows, Selection, StepTally

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16]
SCALE = 0.125


def case(seed: int, hq: int, hkv: int, rows: int | None, lq: int, n: int, slots: int, seen: int, m: int,
         layout: bool, d: int = 64, index_dtype=torch.int64):
    """A fixed context of n keys (its first `first` and last 5 dense, the rest indexed) with a selection of `rows`
    rows (None: every key), a new-token buffer of `slots` slots of which the last query sees `seen` (the others
    hold NaN: never read), lq queries at the last positions and m follow rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, lq, d, generator=g)
    k, v = (torch.randn(hkv, n, d, generator=g) for _ in range(2))
    k_new, v_new = (torch.randn(hkv, slots, d, generator=g) for _ in range(2))
    k_new[:, seen:], v_new[:, seen:] = float("nan"), float("nan")
    k_start = n + 3
    q_pos = k_start + seen - lq + torch.arange(lq)
    mask = sel = None
    if rows is not None:
        mask = torch.rand(rows, n, generator=g) < 0.3
        mask[0] = False  # a row that selects nothing still sees its follow rows and new tokens
        sel = Selection.from_mask(mask)
        spare = torch.randint(0, n, (7,), generator=g)  # spare capacity, as the GPU leaves it
        sel = Selection(sel.indptr, torch.cat([sel.indices, spare]).to(index_dtype), n)
    first, indexed = 2, n - 7
    pos = torch.randperm(n + 4, generator=g)[:m] - 2  # some none (-1), some in the dense rows
    pos = torch.where(pos < 0, -1, pos)
    order = torch.stack([torch.randperm(indexed, generator=g) for _ in range(hkv)]).to(torch.int32) if layout else None
    follow = FollowRows(pos, first, indexed, order) if m else None
    return q, k, v, sel, mask, k_new, v_new, q_pos, k_start, follow


SHAPES = [  # hq, hkv, rows, lq, n, slots, seen, m, layout
    (8, 2, 2, 1, 700, 300, 150, 8, True),  # a decode step: three items of new tokens, follow rows through a layout
    (8, 2, 8, 1, 500, 40, 40, 8, False),  # a selection per query head
    (8, 2, None, 1, 600, 64, 10, 0, False),  # full attention: every key of the fixed context
    (4, 1, 1, 4, 300, 32, 20, 12, True),  # four tokens at once (still one query tile)
    (8, 2, 2, 1, 400, 16, 1, 72, True),  # the step's first token: the question's 64 follow rows carried
    (4, 2, 2, 20, 300, 64, 50, 16, False),  # a question's prefill: the three kernels in turn
]


def dense_union(q, k, v, mask, k_new, v_new, q_pos, k_start, follow, seen):
    """Dense attention over [fixed keys; new tokens] with each query head's mask: its row's selection (every key
    without one) and follow rows, and the new tokens its position sees."""
    hq, lq, _ = q.shape
    hkv, n = k.shape[:2]
    if mask is None:
        fixed = torch.ones(hkv, n, dtype=torch.bool)
    else:
        fixed = mask.clone()
        if follow is not None:
            rows, valid = follow_rows(follow.positions, follow.first, follow.indexed, follow.order, hkv)
            head = torch.arange(mask.shape[0]) * hkv // mask.shape[0]
            for r in range(mask.shape[0]):
                fixed[r, rows[head[r]][valid[head[r]]]] = True
    per_head = fixed.repeat_interleave(hq // fixed.shape[0], dim=0)[:, None, :].expand(hq, lq, n)
    causal = (k_start + torch.arange(seen))[None, :] <= q_pos[:, None]  # [Lq, seen]
    full_mask = torch.cat([per_head, causal[None].expand(hq, lq, seen)], dim=-1)
    keys = torch.cat([k, k_new[:, :seen]], dim=1)
    values = torch.cat([v, v_new[:, :seen]], dim=1)
    return attention_with_lse(q, keys, values, SCALE, full_mask)


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_attention_over_the_union(shape):
    q, k, v, sel, mask, k_new, v_new, q_pos, k_start, follow = case(0, *shape)
    seen = shape[6]
    want_out, want_lse = dense_union(q, k, v, mask, k_new, v_new, q_pos, k_start, follow, seen)
    out, lse, fresh = reference.union_attention(q, k, v, sel, SCALE, k_new[:, :seen], v_new[:, :seen], q_pos,
                                                k_start, follow)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert (fresh is None) == (sel is None or follow is None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape, dtype):
    """The kernels never read a new-token slot past the newest query's position (NaN there), write the model's
    layout ([Lq, Hq, D] transposed) in its dtype, and tell the same fresh follow rows as the reference."""
    q, k, v, sel, _, k_new, v_new, q_pos, k_start, follow = case(1, *shape, index_dtype=torch.int32)
    seen = shape[6]
    want = reference.union_attention(q, k, v, sel, SCALE, k_new[:, :seen], v_new[:, :seen], q_pos, k_start, follow)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    q, k, v, k_new, v_new = (x.to(DEVICE, dtype) for x in (q, k, v, k_new, v_new))
    if sel is not None:
        sel = Selection(on(sel.indptr), on(sel.indices), sel.num_keys)
    if follow is not None:
        follow = FollowRows(on(follow.positions), follow.first, follow.indexed,
                            None if follow.order is None else on(follow.order))
    hq, lq, d = q.shape
    out = torch.empty(lq, hq, d, device=DEVICE, dtype=dtype).transpose(0, 1)  # the model's layout
    got = union_ops.union_attention(q, k, v, sel, SCALE, k_new, v_new, on(q_pos), k_start, follow, out=out)
    assert got[0].data_ptr() == out.data_ptr()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[0].float().cpu(), want[0], **tol)
    torch.testing.assert_close(got[1].cpu(), want[1], **tol)
    if want[2] is None:
        assert got[2] is None
    else:
        assert torch.equal(got[2].cpu(), want[2])


def _decode_matches_reference(seed: int, n: int, slots: int, seen: int, **options) -> None:
    """A float32 decode step of case(seed, 8, 2, 2, 1, n, slots, seen, 8, True) through the kernels (options:
    union_attention's keywords): its output, lse and fresh follow rows against the reference's."""
    q, k, v, sel, _, k_new, v_new, q_pos, k_start, follow = case(seed, 8, 2, 2, 1, n, slots, seen, 8, True)
    want = reference.union_attention(q, k, v, sel, SCALE, k_new[:, :seen], v_new[:, :seen], q_pos, k_start, follow)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    sel = Selection(on(sel.indptr), on(sel.indices), sel.num_keys)
    follow = FollowRows(on(follow.positions), follow.first, follow.indexed, on(follow.order))
    got = union_ops.union_attention(*(on(x) for x in (q, k, v)), sel, SCALE, on(k_new), on(v_new), on(q_pos),
                                    k_start, follow, **options)
    torch.testing.assert_close(got[0].cpu(), want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1].cpu(), want[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(got[2].cpu(), want[2])


@pytest.mark.parametrize("tiles", [dict(block_n=32, num_warps=8, num_stages=2, workers_per_sm=2),
                                   dict(block_n=128, num_warps=4, num_stages=4, workers_per_sm=4)])
def test_other_tiles_attend_the_same(tiles):
    """A decode step under another split-KV tiling (what `engine.bench.union --sweep` times): the same output, lse
    and fresh follow rows as the reference, and a bad tiling refused."""
    from kernels.sparse_ops import DecodeTiles

    _decode_matches_reference(4, 700, 300, 150, tiles=DecodeTiles(**tiles))
    with pytest.raises(ValueError):
        DecodeTiles(block_n=48)


@pytest.mark.parametrize("share", [2, 4])
def test_a_call_planned_for_its_share_of_the_gpu_attends_the_same(share):
    """A batch's sequences attending at once on streams plan each union call for 1 / share of the workers (fewer
    workers over longer items): the same output, lse and fresh follow rows as the reference; share < 1 refused."""
    from kernels.sparse_ops import DecodeTiles

    _decode_matches_reference(4, 700, 300, 150, share=share)
    q, k, v, sel, _, k_new, v_new, q_pos, k_start, follow = case(4, 8, 2, 2, 1, 700, 300, 150, 8, True)
    whole, shared = (union_ops._prepare(q, k, v, sel, SCALE, k_new, v_new, q_pos, k_start, follow, None, None,
                                        DecodeTiles(), n) for n in (1, share))
    assert shared.workers < whole.workers and shared.cfg.chunk >= whole.cfg.chunk
    with pytest.raises(ValueError):
        union_ops.union_attention(q, k, v, sel, SCALE, k_new, v_new, q_pos, k_start, follow, share=0)


@pytest.mark.parametrize("fit", [True, False])
def test_a_heavier_selection_than_planned_attends_the_same_in_longer_items(monkeypatch, fit):
    """A selection of 30% of 3,000 keys where the plan expects a tenth (more items than the interpreter's workers): cut
    on the device into longer items (union_ops.FIT_ITEMS, the default; the split and the merge launch must agree on
    them) or into the plan's (several waves), the same output, lse and fresh follow rows as the reference."""
    monkeypatch.setattr(union_ops, "FIT_ITEMS", fit)
    _decode_matches_reference(6, 3000, 64, 30)


def test_a_query_that_sees_no_new_token_has_only_the_fixed_part():
    """Positions before the new tokens' first slot (a step replayed over an empty buffer): no new-token item, the
    fixed part alone."""
    q, k, v, sel, _, k_new, v_new, q_pos, k_start, follow = case(2, 8, 2, 2, 1, 300, 32, 0, 8, False)
    q_pos = q_pos * 0 + k_start - 1
    want = reference.union_attention(q, k, v, sel, SCALE, k_new[:, :0], v_new[:, :0], q_pos, k_start, follow)
    sel = Selection(sel.indptr.to(DEVICE), sel.indices.to(DEVICE), sel.num_keys)
    follow = FollowRows(follow.positions.to(DEVICE), follow.first, follow.indexed)
    got = union_ops.union_attention(*(x.to(DEVICE) for x in (q, k, v)), sel, SCALE, k_new.to(DEVICE),
                                    v_new.to(DEVICE), q_pos.to(DEVICE), k_start, follow)
    torch.testing.assert_close(got[0].cpu(), want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1].cpu(), want[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] is not None])
@pytest.mark.parametrize("with_scores", [True, False])
def test_the_steps_statistics_are_added_as_the_tally_adds_them(shape, with_scores):
    """A tally handed to the union (the merge kernel adds it; the prefill's ops in turn, the tally kernel) leaves
    the sums the reference's tally_step leaves: each row's keys and fresh follow rows added to its kept count, the
    index elements to read, the unit scores maxed into best (more units than one program's block)."""
    q, k, v, sel, _, k_new, v_new, q_pos, k_start, follow = case(3, *shape)
    seen, rows = shape[6], sel.rows
    g = torch.Generator().manual_seed(4)
    elements = torch.rand(5, generator=g) * 100
    scores = torch.rand(rows, 1300, generator=g) if with_scores else None

    def sums():
        best = torch.rand(rows, 1300, generator=torch.Generator().manual_seed(5)) if with_scores else None
        return torch.full((rows,), 3.0), torch.full((1,), 7.0), best

    kept, read, best = sums()
    tally = StepTally(elements, kept, read, scores, best)
    reference.union_attention(q, k, v, sel, SCALE, k_new[:, :seen], v_new[:, :seen], q_pos, k_start, follow,
                              tally=tally)
    on = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    got = StepTally(*(on(t) for t in (elements, *sums()[:2], scores, sums()[2])))
    sel = Selection(on(sel.indptr), on(sel.indices), sel.num_keys)
    if follow is not None:
        follow = FollowRows(on(follow.positions), follow.first, follow.indexed, on(follow.order))
    union_ops.union_attention(*(on(x) for x in (q, k, v)), sel, SCALE, on(k_new), on(v_new), on(q_pos), k_start,
                              follow, tally=got)
    torch.testing.assert_close(got.kept.cpu(), kept)
    torch.testing.assert_close(got.read.cpu(), read)
    if with_scores:
        torch.testing.assert_close(got.best.cpu(), best)
    assert kept.sum() > 3.0 * rows



def test_a_row_without_items_has_no_keys_and_its_statistics():
    """Row 0 selects nothing, no query sees a new token and there are no follow rows: row 0 has no item at all (out
    0, lse -inf, its statistics added all the same: row 0 adds the elements); the other row as the reference."""
    q, k, v, sel, _, k_new, v_new, q_pos, k_start, _ = case(6, 8, 2, 2, 1, 300, 32, 0, 0, False)
    q_pos = q_pos * 0 + k_start - 1
    elements = torch.tensor([2.0, 5.0])

    def tally(on):
        return StepTally(on(elements), on(torch.full((2,), 3.0)), on(torch.full((1,), 7.0)))

    want_tally = tally(lambda t: t)
    want = reference.union_attention(q, k, v, sel, SCALE, k_new[:, :0], v_new[:, :0], q_pos, k_start, None,
                                     tally=want_tally)
    assert torch.isinf(want[1][:4]).all() and not torch.isinf(want[1][4:]).any()
    on = lambda t: t.to(DEVICE)  # noqa: E731
    got_tally = tally(on)
    got = union_ops.union_attention(*(on(x) for x in (q, k, v)), Selection(on(sel.indptr), on(sel.indices),
                                                                          sel.num_keys),
                                    SCALE, on(k_new), on(v_new), on(q_pos), k_start, None, tally=got_tally)
    torch.testing.assert_close(got[0].cpu(), want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1].cpu(), want[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_tally.kept.cpu(), want_tally.kept)
    torch.testing.assert_close(got_tally.read.cpu(), want_tally.read)


def _on_device(q, k, v, sel, k_new, v_new, q_pos, follow):
    on = lambda t: t.to(DEVICE)  # noqa: E731
    if sel is not None:
        sel = Selection(on(sel.indptr), on(sel.indices), sel.num_keys)
    if follow is not None:
        follow = FollowRows(on(follow.positions), follow.first, follow.indexed,
                            None if follow.order is None else on(follow.order))
    return (*(on(x) for x in (q, k, v)), sel, on(k_new), on(v_new), on(q_pos), follow)


# per sequence of one batch: seed, rows (None: every key), fixed keys, new-token slots, seen, follow rows, layout
BATCH = [(10, 2, 700, 300, 150, 8, True), (11, 2, 420, 40, 7, 12, True), (12, None, 600, 64, 10, 0, False),
         (13, 2, 900, 16, 1, 72, True), (14, 8, 500, 40, 40, 8, False)]


def test_a_batch_of_sequences_over_contexts_of_their_own_attends_as_each_alone():
    """Five decode steps over five contexts of different lengths, selections, new tokens, positions and follow rows
    (through a layout or not), one reading every key, each adding its step's statistics: one call of
    union_attention_batch (the calls of one kind in one split and one merge launch, each sequence's tensors read
    from a table) gives each sequence the reference's output, lse, fresh follow rows and statistics."""
    calls, wants, tallies, want_tallies = [], [], [], []
    for seed, rows, n, slots, seen, m, layout in BATCH:
        q, k, v, sel, _, k_new, v_new, q_pos, k_start, follow = case(seed, 8, 2, rows, 1, n, slots, seen, m, layout,
                                                                     index_dtype=torch.int32)
        tally = want_tally = None
        if sel is not None:
            g = torch.Generator().manual_seed(seed)
            elements, scores = torch.rand(3, generator=g) * 50, torch.rand(sel.rows, 700, generator=g)

            def sums(rows=sel.rows):
                best = torch.rand(rows, 700, generator=torch.Generator().manual_seed(1))
                return torch.full((rows,), 3.0), torch.full((1,), 7.0), best

            want_tally = StepTally(elements, *sums()[:2], scores, sums()[2])
            tally = StepTally(*(t.to(DEVICE) for t in (elements, *sums()[:2], scores, sums()[2])))
        wants.append(reference.union_attention(q, k, v, sel, SCALE, k_new[:, :seen], v_new[:, :seen], q_pos,
                                               k_start, follow, tally=want_tally))
        q, k, v, sel, k_new, v_new, q_pos, follow = _on_device(q, k, v, sel, k_new, v_new, q_pos, follow)
        out = torch.empty(1, 8, 64, device=DEVICE).transpose(0, 1)  # the model's layout
        calls.append(union_ops.UnionCall(q, k, v, sel, SCALE, k_new, v_new, q_pos, k_start, follow, out, tally))
        tallies.append(tally)
        want_tallies.append(want_tally)
    keep: list = []
    fresh = union_ops.union_attention_batch(calls, keep=keep)
    for call, got_fresh, want, tally, want_tally in zip(calls, fresh, wants, tallies, want_tallies):
        torch.testing.assert_close(call.out.cpu(), want[0], atol=1e-4, rtol=1e-4)
        if want[2] is None:
            assert got_fresh is None
        else:
            assert torch.equal(got_fresh.cpu(), want[2])
        if tally is not None:
            torch.testing.assert_close(tally.kept.cpu(), want_tally.kept)
            torch.testing.assert_close(tally.read.cpu(), want_tally.read)
            torch.testing.assert_close(tally.best.cpu(), want_tally.best)
    assert len(keep) == (4 if DEVICE == "cuda" else 0)  # one batched group (the dense call and the one of 8 rows
    # are kinds of their own): its two launches' two tables each, kept for a graph that captured their upload


def test_a_batch_takes_a_prefill_and_a_lone_call_as_union_attention_does():
    """A call the kernels do not take (four query tokens of 8 heads over 2 rows: a question's prefill) and a lone
    call of its kind run as union_attention runs them: the reference's output."""
    calls, wants = [], []
    for seed, lq in ((20, 4), (21, 1)):
        q, k, v, sel, _, k_new, v_new, q_pos, k_start, follow = case(seed, 8, 2, 2, lq, 300, 32, 20, 8, True)
        wants.append(reference.union_attention(q, k, v, sel, SCALE, k_new[:, :20], v_new[:, :20], q_pos, k_start,
                                               follow))
        q, k, v, sel, k_new, v_new, q_pos, follow = _on_device(q, k, v, sel, k_new, v_new, q_pos, follow)
        out = torch.empty(8, lq, 64, device=DEVICE)
        calls.append(union_ops.UnionCall(q, k, v, sel, SCALE, k_new, v_new, q_pos, k_start, follow, out))
    fresh = union_ops.union_attention_batch(calls)
    for call, got_fresh, want in zip(calls, fresh, wants):
        torch.testing.assert_close(call.out.cpu(), want[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(got_fresh.cpu(), want[2])
