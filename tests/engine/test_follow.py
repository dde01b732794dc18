"""Follow rows (engine.attention.follow): the positions a step adds, against a brute-force reference; the selection membership
test the follow part uses (kernels.selection.contains) against a dense mask; the plan's reserve; and in a session,
the rows a turn reads, in every method's layout (the follow part's kernel: tests/kernels/test_follow_kernels.py)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.follow import OFF, Follow, FollowSettings, inverse_order, layout_order
from engine.attention.rows import FixedRows
from kernels.reference.follow import follow_attention, follow_rows
from kernels.selection import Selection, contains


def reference_decode(doc: list[int], recent: list[int], settings: FollowSettings, rows: FixedRows) -> set[int]:
    """The tokens after the `decode` best positions, best = the longest suffix of `recent` that ends there
    (at most ngram), then the latest; only positions followed by an indexed token."""
    scored = []
    for p in range(len(doc)):
        if not rows.sink <= p + 1 < rows.sink + rows.indexed:
            continue
        n = 0
        while n < settings.ngram and p - n >= 0 and n < len(recent) and recent[-1 - n] >= 0 and doc[p - n] == recent[-1 - n]:
            n += 1
        if n:
            scored.append((n, p))
    best = sorted(scored, reverse=True)[: settings.decode]
    return {p + 1 for _, p in best if p + 1 < len(doc)}


def reference_prefill(doc: list[int], prompt: list[int], settings: FollowSettings, rows: FixedRows) -> set[int]:
    """The `window` tokens after each of the best occurrences of a prompt bigram and the `lead` up to it (itself
    included; for the best `leads` only, unless 0), best = the rarest bigram in the document, then the latest; only
    occurrences followed by an indexed token; the rows in all at most `prefill`."""
    asked = {(a, b) for a, b in zip(prompt, prompt[1:])}
    counts: dict[tuple[int, int], int] = {}
    for a, b in zip(doc, doc[1:]):
        counts[(a, b)] = counts.get((a, b), 0) + 1
    found = [(-counts[(doc[p - 1], doc[p])], p) for p in range(1, len(doc))
             if (doc[p - 1], doc[p]) in asked and rows.sink <= p + 1 < rows.sink + rows.indexed]
    if settings.leads == 0:
        windows = led = max(1, settings.prefill // (settings.lead + settings.window))
    else:
        windows = max(1, (settings.prefill - settings.leads * settings.lead) // settings.window)
        led = min(settings.leads, windows)
    best = sorted(found, reverse=True)[:windows]
    return {p + 1 + w for i, (_, p) in enumerate(best) for w in range(-settings.lead if i < led else 0, settings.window)
            if 0 <= p + 1 + w < len(doc)}


def positions(t: torch.Tensor) -> set[int]:
    return {int(x) for x in t.tolist() if x >= 0}


@pytest.mark.parametrize("seed", range(40))
def test_decode_positions_match_the_reference(seed):
    """A decode step's rows: its own (the suffix matches) and, with `carry`, the question's, each position once."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 20])
    doc = [rng.randrange(vocab) for _ in range(rng.randrange(2, 60))]
    settings = FollowSettings(decode=rng.choice([0, 1, 4, 8]), ngram=rng.choice([1, 2, 3]),
                              prefill=rng.choice([0, 4, 16]), window=rng.choice([1, 2, 4]), lead=rng.choice([0, 1, 3]),
                              carry=rng.random() < 0.7)
    rows = FixedRows.of(rng.choice([0, 1, 2]), rng.choice([1, 3]), len(doc))
    follow = Follow(torch.tensor(doc), rows, settings)
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(2, 6))]
    follow.begin(torch.tensor(prompt))  # a prefill starts the recent tokens and sets the question's rows
    question = reference_prefill(doc, prompt, settings, rows) if settings.carry and settings.prefill else set()
    read = reference_prefill(doc, prompt, settings, rows) if settings.prefill else set()  # the prefill's
    answer = []
    for token in [rng.randrange(vocab) for _ in range(4)]:
        answer.append(token)
        follow.begin(torch.tensor([token]))
        got = [int(x) for x in follow.positions.tolist() if x >= 0]
        read |= set(got)
        assert follow.positions.shape == (settings.decode + settings.carried_rows,)
        assert len(got) == len(set(got))
        mine = reference_decode(doc, (prompt + answer)[-settings.ngram:], settings, rows) if settings.decode else set()
        assert set(got) == mine | question
        assert positions(follow.step_positions(torch.tensor(prompt), torch.tensor(answer))) == set(got)
    # the turn's views: every call's rows, the indexed ones (the dense rows are read anyway)
    indexed = {p for p in read if rows.sink <= p < rows.sink + rows.indexed}
    assert follow.turn_positions(torch.tensor(prompt), torch.tensor(answer)) == sorted(indexed)


@pytest.mark.parametrize("seed", range(40))
def test_prefill_positions_match_the_reference(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 6, 30])
    doc = [rng.randrange(vocab) for _ in range(rng.randrange(2, 80))]
    settings = FollowSettings(prefill=rng.choice([4, 16, 64]), window=rng.choice([1, 2, 4]),
                              lead=rng.choice([0, 1, 3, 8]), leads=rng.choice([0, 0, 1, 2]))
    rows = FixedRows.of(rng.choice([0, 1, 2]), rng.choice([1, 3]), len(doc))
    follow = Follow(torch.tensor(doc), rows, settings)
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(2, 12))]
    follow.begin(torch.tensor(prompt))
    windows = max(1, settings.prefill // (settings.lead + settings.window)) if settings.leads == 0 else \
        max(1, (settings.prefill - settings.leads * settings.lead) // settings.window)
    led = windows if settings.leads == 0 else min(settings.leads, windows)
    assert follow.positions.numel() == settings.question_rows == windows * settings.window + led * settings.lead
    assert positions(follow.positions) == reference_prefill(doc, prompt, settings, rows)
    assert torch.equal(follow.recent[-min(len(prompt), settings.ngram):], torch.tensor(prompt[-settings.ngram:]))
    assert torch.equal(follow.step_positions(torch.tensor(prompt), torch.tensor([], dtype=torch.int64)),
                       follow.positions)


def test_a_question_bigram_finds_the_text_after_it():
    doc = [7, 1, 2, 3, 4, 5, 6, 1, 9, 9, 9, 1, 2, 8, 8]
    for carry in (False, True):
        follow = Follow(torch.tensor(doc), FixedRows.of(0, 1, len(doc)), FollowSettings(prefill=4, window=2,
                                                                                        lead=0, carry=carry))
        follow.begin(torch.tensor([5, 1, 2]))  # (1, 2) twice in the document, (5, 1) never
        assert positions(follow.positions) == {3, 4, 13, 14}
        follow.begin(torch.tensor([3]))  # decode: recent (1, 2, 3) ends at position 3, and the question's again
        assert positions(follow.positions) == ({3, 4, 13, 14} if carry else {4})
        assert follow.positions.tolist().count(4) == 1


def test_the_lead_takes_the_tokens_up_to_an_occurrence():
    """lead 3: the bigram's own two tokens and the one before them, then the window after; none before the
    document's start."""
    doc = [4, 1, 2, 3, 5, 6, 7, 8, 9, 9, 9, 9]
    follow = Follow(torch.tensor(doc), FixedRows.of(0, 1, len(doc)), FollowSettings(prefill=5, window=2, lead=3))
    follow.begin(torch.tensor([1, 2]))  # (1, 2) at position 2: rows 0..2 up to it, 3..4 after
    assert positions(follow.positions) == {0, 1, 2, 3, 4} and follow.positions.numel() == 5
    follow = Follow(torch.tensor(doc), FixedRows.of(0, 1, len(doc)), FollowSettings(prefill=6, window=2, lead=4))
    follow.begin(torch.tensor([1, 2]))  # the lead would start before position 0
    assert positions(follow.positions) == {0, 1, 2, 3, 4} and follow.positions.numel() == 6


def test_leads_gives_the_lead_to_the_best_occurrences_only():
    """leads 1: the rarest bigram's occurrence takes the lead and the window, the others the window alone; the rows
    in all stay `prefill` (one lead of 2 and 3 windows of 2 in 8)."""
    doc = [7, 7, 1, 2, 3, 4, 7, 5, 6, 8, 8, 7, 5, 6, 9, 9, 7, 5, 6, 9, 9]
    settings = FollowSettings(prefill=8, window=2, lead=2, leads=1)
    assert (settings.windows, settings.led, settings.question_rows) == (3, 1, 8)
    follow = Follow(torch.tensor(doc), FixedRows.of(0, 1, len(doc)), settings)
    follow.begin(torch.tensor([1, 2, 9, 5, 6]))  # (1, 2) once at 3; (5, 6) three times, at 8, 13 and 18
    assert positions(follow.positions) == {2, 3, 4, 5} | {19, 20} | {14, 15}


def test_occurrences_before_the_dense_rows_are_passed_over():
    """A document whose end repeats the question: the latest occurrences are followed by dense rows (read by every
    step anyway), so the earlier ones are taken."""
    doc = [9, 1, 2, 3, 4, 9, 9, 9, 1, 2, 5, 6]
    rows = FixedRows.of(0, 3, len(doc))  # tokens 9..11 are the dense tail
    follow = Follow(torch.tensor(doc), rows, FollowSettings(prefill=2, window=2, lead=0, decode=1))
    follow.begin(torch.tensor([1, 2]))  # (1, 2) at positions 2 and 9: the second is followed by the tail
    assert positions(follow.positions) == {3, 4}
    follow.begin(torch.tensor([2]))  # decode: recent (1, 2) -> the same occurrence
    assert positions(follow.positions) == {3, 4}


def test_dense_rows_are_not_added_and_layouts_map_rows():
    doc = list(range(10))
    rows = FixedRows.of(2, 3, 10)  # sink 2, tail 3: tokens 2..6 indexed as rows 0..4
    follow = Follow(torch.tensor(doc), rows, FollowSettings(decode=1))
    follow.positions = torch.tensor([1, 3, 6, 8, -1])
    stored, valid = follow.stored_rows(follow.positions)
    assert valid.tolist() == [False, True, True, False, False]
    assert stored[valid].tolist() == [1, 4]
    order = torch.tensor([[4, 3, 2, 1, 0, 5, 6, 7, 8, 9]])  # a layout: row r holds stored row order[r]
    inv = inverse_order(order, rows.indexed)
    at, ok = follow_rows(follow.positions, rows.sink, rows.indexed, inv, 1)
    assert at[ok].tolist() == [3, 0]  # stored rows 1 and 4 sit at layout rows 3 and 0


def test_settings_are_checked():
    with pytest.raises(ValueError):
        FollowSettings(decode=-1)
    with pytest.raises(ValueError):
        FollowSettings(window=0)
    with pytest.raises(ValueError, match="lead"):
        FollowSettings(lead=-1)
    with pytest.raises(ValueError, match="leads"):
        FollowSettings(leads=-1)
    with pytest.raises(ValueError):
        FollowSettings(ngram=0)
    assert not OFF.on and FollowSettings().on


@pytest.mark.parametrize("seed", range(30))
def test_contains_matches_the_dense_mask(seed):
    g = torch.Generator().manual_seed(seed)
    rows, n, m = (int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g)),
                  int(torch.randint(0, 6, (1,), generator=g)))
    mask = torch.rand(rows, n, generator=g) < torch.rand(1, generator=g)
    sel = Selection.from_mask(mask)
    spare = torch.randint(0, n, (int(torch.randint(0, 10, (1,), generator=g)),), generator=g)
    sel = Selection(sel.indptr, torch.cat([sel.indices, spare]), n)  # spare capacity, as the GPU leaves it
    keys = torch.randint(0, n, (rows, m), generator=g)
    assert torch.equal(contains(sel, keys), mask.gather(1, keys))


def test_the_plan_leaves_the_reserve():
    """Method.plan maps budget - reserve (per phase) to key fractions through the calibrated reads."""
    from engine.attention.budget import KEYS_GRID
    from engine.methods.quest import QuestPolicy

    class Seen(QuestPolicy):
        def plan_keys(self, calibration, budget, decode_keys, prefill_keys):
            self.seen = (decode_keys, prefill_keys)
            return super().plan_keys(calibration, budget, decode_keys, prefill_keys)

    method = Seen()
    reads = torch.tensor([0.05 + 0.9 * k for k in KEYS_GRID], dtype=torch.float64)  # reads 0.05 + 0.9 x keys
    calibration = {"budget_decode": reads, "budget_prefill": reads}
    assert method.plan(calibration, 0.32).budget == 0.32
    assert method.seen == pytest.approx((0.3, 0.3))
    assert method.plan(calibration, 0.32, (0.09, 0.18)).budget == 0.32
    assert method.seen == pytest.approx((0.2, 0.1))
    method.plan(calibration, 1.0, (0.09, 0.18))
    assert method.seen == (1.0, 1.0)  # every key: nothing to leave


# --- in a session (tiny random-weight models, reference backend) -------------------------------------------------

@pytest.fixture(scope="module")
def session(tiny_model_path):
    from engine.context.ingest import ingest_tokens
    from engine.context.session import ContextSession
    from engine.model.load import load_model
    from engine.text.prompt import tokenize_document
    from kernels.backend import REFERENCE
    from tests.engine.test_engine_tiny import DOCUMENT, SETTINGS, all_methods, gates_for

    lm = load_model(str(tiny_model_path), device="cpu")
    fc = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context)
    methods = all_methods()
    out = ingest_tokens(lm, fc.ids, SETTINGS, REFERENCE, methods, prepared=gates_for(lm, methods))
    return ContextSession(lm, out.artifacts, SETTINGS, REFERENCE, methods={m.name: m for m in methods})


@pytest.mark.parametrize("method", ["squeeze", "hsqueeze", "quest", "duo", "duo-squeeze", "saap"])
def test_a_step_reads_its_follow_rows_in_the_methods_layout(session, method):
    """A decode step whose token occurs in the document reads the rows after it besides its own selection, in
    every global layer, mapped through the method's layout (checked in stored order)."""
    from engine.bench.recall import in_original_order
    from kernels.backend import REFERENCE

    lm, follow = session.lm, session.follow
    m = session.method(method)
    session.arrange(m)
    plan = session.plan(method, 0.95)
    token = session.tokens[session.rows.sink + 3]  # a token of the document (byte tokenizer: it recurs)
    follow.begin(session.tokens[-4:])
    follow.begin(token.view(1))
    stored, valid = follow.stored_rows(follow.positions)
    assert valid.any()
    for i in lm.global_layers:
        layer = session.cache.layers[i]
        index = layer.indexes[method]
        q = torch.randn(lm.num_heads, 1, lm.head_dim)
        lookup = m.lookup(q, index, plan, 1.0, REFERENCE, torch.tensor([session.fixed_len]))
        order = layout_order(m, index)
        _, _, fresh = follow_attention(q, layer.fixed_keys, layer.fixed_values, lookup.selection, follow.positions,
                                       session.rows.sink, session.rows.indexed, order, 1.0)
        hkv = layer.fixed_keys.shape[0]
        rows, _ = follow_rows(follow.positions, session.rows.sink, session.rows.indexed, order, hkv)
        head = torch.arange(lookup.selection.rows) * hkv // lookup.selection.rows
        read = lookup.selection.to_mask()
        for r in range(read.shape[0]):
            read[r, rows[head[r]][fresh[r]]] = True
        mine = in_original_order(lookup.selection.to_mask()[:, None], m.layout(index), hkv)[:, 0]
        after = in_original_order(read[:, None], m.layout(index), hkv)[:, 0]
        expected = mine.clone()
        expected[:, stored[valid]] = True
        assert torch.equal(after, expected)
        assert not (fresh & lookup.selection.to_mask().gather(1, rows[head])).any()  # a key is read once


def test_follow_rows_change_nothing_at_budget_one(session):
    full = session.logits("Who kept the lighthouse logbook?", "full")
    for method in ("squeeze", "quest", "saap"):
        torch.testing.assert_close(session.logits("Who kept the lighthouse logbook?", method, 0.0), full,
                                   atol=1e-4, rtol=1e-4)


def test_a_turn_reads_its_budget_with_follow_rows(session):
    """The plan leaves the follow rows' reserve: a turn reads no more than without them, within 0.03 (less where
    fewer rows are found than reserved: the tiny document's 627 rows make the 64 of a question's reserve a tenth)."""
    question = "Who kept the lighthouse logbook?"
    follow = session.follow
    with_rows = session.ask(question, "squeeze", 0.5, max_new_tokens=4).stats
    session.follow = None
    try:
        without = session.ask(question, "squeeze", 0.5, max_new_tokens=4).stats
    finally:
        session.follow = follow
    assert with_rows.kv_budget_prefill <= without.kv_budget_prefill + 0.03
    assert with_rows.kv_budget_decode <= without.kv_budget_decode + 0.03


@pytest.mark.parametrize("method", ["squeeze", "hsqueeze"])
def test_a_cluster_cut_reads_its_budget_with_follow_rows(session, method):
    """The CPU's exact cut counts each cluster's keys less the follow rows it holds (KeyCount.held): a follow row
    inside a kept cluster is read once, so a turn with follow rows reads the budget it asked as one without them
    does, within 0.005 in both phases (at 0.2: the tiny document's follow rows are a large share of it; counted
    whole, the clusters read 0.191-0.195 there)."""
    question = "Who kept the lighthouse logbook?"
    stats = session.ask(question, method, 0.8, max_new_tokens=6).stats
    assert abs(stats.kv_budget_prefill - 0.2) <= 0.005
    assert abs(stats.kv_budget_decode - 0.2) <= 0.005


def test_a_turn_reports_the_follow_rows_it_read(session):
    """Answer.follow: the indexed tokens the turn's steps read as follow rows: a one-token answer's are its
    prefill's (the question's rows), a longer one's add its decode steps'; none for full attention."""
    from engine.text.prompt import prompt_format, turn_ids

    question = "Who kept the lighthouse logbook?"
    prompt = turn_ids(session.lm.tokenizer, prompt_format(session.lm.tokenizer), question).ids
    rows = session.rows
    question_rows = positions(session.follow.step_positions(prompt, torch.tensor([], dtype=torch.int64)))
    one = session.ask(question, "squeeze", 0.5, max_new_tokens=1)
    assert one.follow == sorted(p for p in question_rows if rows.sink <= p < rows.sink + rows.indexed)
    assert one.follow  # the tiny document repeats its words: the question's bigrams occur
    longer = session.ask(question, "squeeze", 0.5, max_new_tokens=6)
    assert longer.follow == sorted(set(longer.follow)) and set(one.follow) <= set(longer.follow)
    assert all(rows.sink <= p < rows.sink + rows.indexed for p in longer.follow)
    assert session.ask(question, "full", 0.0, max_new_tokens=2).follow == []
