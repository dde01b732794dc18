"""A decode step's follow rows: the @triton.jit kernels (wrapper: kernels/suffix_ops.py; reference:
kernels/reference/suffix.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.launch import release_next, wait_prior

# Arguments that follow a context's size, not specialised on (kernels/README.md)
BLOCK_SIZES = ["n"]
MERGE_SIZES = ["n", "n_cand"]


@triton.jit(do_not_specialize=BLOCK_SIZES)
def suffix_block_kernel(
    ids_ptr, next_ptr, recent_ptr, token_ptr, cand_score_ptr, cand_at_ptr, n,
    NGRAM: tl.constexpr, TOP: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """Program b: positions b * BLOCK .. of the context; each scored as kernels.reference.suffix.suffix_scores
    against the recent tokens after this step's (recent [NGRAM] before the step, token [1]: the suffix is recent[1:]
    then token); the block's TOP best (score, position) written to cand_score / cand_at [blocks, TOP]."""
    wait_prior(PDL)
    release_next(PDL)
    b = tl.program_id(0)
    p = b * BLOCK + tl.arange(0, BLOCK)
    ok = p < n
    p64 = p.to(tl.int64)
    match = (tl.load(ids_ptr + p64, mask=ok, other=-2) == tl.load(token_ptr)) & ok
    length = match.to(tl.int64)
    for j in tl.static_range(1, NGRAM):
        want = tl.load(recent_ptr + NGRAM - j)  # the token j back, once this step's token is appended
        before = tl.load(ids_ptr + p64 - j, mask=ok & (p >= j), other=-1)
        match = match & (before == want)
        length += match.to(tl.int64)
    indexed = tl.load(next_ptr + p64, mask=ok, other=0) != 0
    score = tl.where((length > 0) & indexed, length * (n + 1) + p64, -1)
    score = tl.where(ok, score, -3)  # past the context: below every real entry
    for t in tl.static_range(TOP):
        best = tl.max(score, axis=0)
        at = tl.argmax(score, axis=0)
        tl.store(cand_score_ptr + b * TOP + t, best)
        tl.store(cand_at_ptr + b * TOP + t, b * BLOCK + at)
        score = tl.where(tl.arange(0, BLOCK) == at, -3, score)


@triton.jit(do_not_specialize=MERGE_SIZES)
def suffix_merge_kernel(
    cand_score_ptr, cand_at_ptr, recent_ptr, token_ptr, question_ptr, out_ptr, n, n_cand, n_question,
    NGRAM: tl.constexpr, TOP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/launch.py
):
    """One program: the TOP best of the n_cand candidates -> the positions after them (-1 where none or past the
    context) in out[0:TOP], the question's n_question rows in out[TOP:], then out sorted with repeats set to -1;
    and recent shifted by one with this step's token appended (after the block kernel has read it)."""
    wait_prior(PDL)
    release_next(PDL)
    c = tl.arange(0, BLOCK_C)
    score = tl.load(cand_score_ptr + c, mask=c < n_cand, other=-3)
    where_at = tl.load(cand_at_ptr + c, mask=c < n_cand, other=0)
    for t in tl.static_range(TOP):
        best = tl.max(score, axis=0)
        i = tl.argmax(score, axis=0)
        at = tl.sum(tl.where(c == i, where_at, 0), axis=0)
        row = tl.where((best >= 0) & (at + 1 < n), at + 1, -1)
        tl.store(out_ptr + t, row.to(tl.int64))
        score = tl.where(c == i, -4, score)
    o = tl.arange(0, BLOCK_O)
    q_ok = (o >= TOP) & (o < TOP + n_question)
    tl.store(out_ptr + o, tl.load(question_ptr + o - TOP, mask=q_ok, other=-1), mask=q_ok)
    tl.debug_barrier()
    m = TOP + n_question
    rows = tl.load(out_ptr + o, mask=o < m, other=9223372036854775807)  # padding sorts last
    rows = tl.sort(rows)
    tl.store(out_ptr + o, rows, mask=o < m)
    tl.debug_barrier()
    prev = tl.load(out_ptr + o - 1, mask=(o >= 1) & (o < m), other=-2)
    tl.store(out_ptr + o, tl.where(rows == prev, -1, rows), mask=o < m)
    # the recent tokens after this step: shifted by one, the step's token last
    r = tl.arange(0, BLOCK_G)  # BLOCK_G >= NGRAM
    shifted_in = tl.load(recent_ptr + r + 1, mask=r < NGRAM - 1, other=0)
    token = tl.load(token_ptr)
    tl.debug_barrier()
    tl.store(recent_ptr + r, tl.where(r == NGRAM - 1, token, shifted_in), mask=r < NGRAM)
