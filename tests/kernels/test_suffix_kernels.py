"""kernels.suffix_ops.follow_step (a decode step's follow rows in two launches) against
kernels.reference.suffix.follow_step: the same rows in the same order and the same recent tokens after it.

The contexts draw their tokens from a small vocabulary, so suffixes of every length occur many times (the best
scores are the longest, then the latest matches) and some tokens never; contexts of several kernel blocks and not a
multiple of one. Without CUDA the kernels run in the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import suffix_ops
from kernels.reference import suffix as reference

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(n: int, vocab: int, ngram: int, questions: int, seed: int, fresh_turn: bool):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    indexed_next = torch.rand(n, generator=g) < 0.9
    indexed_next[-1] = False  # the last token's next is no indexed row
    recent = torch.randint(0, vocab, (ngram,), generator=g)
    if fresh_turn:
        recent[: ngram - 1] = -1  # the turn's first decode step: one token before this one
    token = torch.randint(0, vocab, (1,), generator=g)
    question = torch.randint(-1, n, (questions,), generator=g)
    question[1] = question[0]  # a repeat
    return [t.to(DEVICE) for t in (ids, indexed_next, recent, token, question)]


@pytest.mark.parametrize("n,vocab,ngram,top,questions", [(3000, 7, 3, 8, 64), (1024, 3, 3, 8, 5), (2500, 50, 2, 4, 16),
                                                          (5000, 400, 4, 8, 64), (700, 5, 1, 8, 3)])
@pytest.mark.parametrize("fresh_turn", [False, True])
def test_follow_step_matches_reference(n, vocab, ngram, top, questions, fresh_turn):
    ids, indexed_next, recent, token, question = case(n, vocab, ngram, questions, n + vocab, fresh_turn)
    ours, theirs = torch.empty(top + questions, dtype=torch.int64, device=DEVICE), None
    recent_ours, recent_theirs = recent.clone(), recent.clone()
    theirs = torch.empty_like(ours)
    suffix_ops.follow_step(ids, indexed_next, recent_ours, token, question, ours)
    reference.follow_step(ids, indexed_next, recent_theirs, token, question, theirs)
    assert ours.tolist() == theirs.tolist()
    assert recent_ours.tolist() == recent_theirs.tolist() == [*recent.tolist()[1:], token.item()]
    assert (theirs >= 0).sum() > 0


def test_two_steps_carry_the_recent_tokens():
    ids, indexed_next, recent, token, question = case(4096, 5, 3, 8, 1, False)
    outs = []
    for fn in (suffix_ops.follow_step, reference.follow_step):
        r, out = recent.clone(), torch.empty(16, dtype=torch.int64, device=DEVICE)
        steps = [fn(ids, indexed_next, r, t, question[:8], out).clone() for t in (token, token + 1, token)]
        outs.append([s.tolist() for s in steps])
    assert outs[0] == outs[1]
