"""Follow rows: the fixed-context tokens a sparse step reads because its own recent tokens occur in the document.

A question about a document mostly asks the model to copy: a number, a name, a phrase. The heads that copy
(induction and retrieval heads) attend from the current token to the token right after an earlier occurrence of
it, or of its last few tokens: a key that the token ids alone locate. A lookup that ranks keys by what they have in
common (a cluster's centroid, a page's bounds, a bucket) ranks that one key poorly, since its cluster also holds
keys that follow other tokens. On the embedded model at a 10% budget this is where squeeze loses needles: with
teacher-forced answers, the question's prefill misses the key's first digit and the first decode step its second
(engine/bench/README.md, "Follow rows"). So every sparse step of every method also reads, in every global layer and KV
head, the rows of
- a decode step: the tokens that follow the document's occurrences of its last tokens, the longest suffix first (up
  to `ngram` tokens), then shorter ones, the latest occurrences first; at most `decode` rows (an occurrence counts
  where the token after it is an indexed one: the dense rows are read anyway);
- a question's prefill: the `window` tokens after each occurrence of one of the question's bigrams (and, with a
  `lead`, the tokens up to it), the bigrams rarest in the document first; at most `prefill` rows;
- and, with `carry`, every decode step of the turn the question's rows again: an answer's first token is often a
  space or a quote whose own occurrences say nothing (the key's first digit then comes from a step whose recent
  tokens are "Answer: "), while the place the question points at does (engine/bench/README.md, "Follow rows").
Their bytes are reserved in the plan of every turn (engine.attention.method.Method.plan's `reserve`), found or not,
so a budget still means the share of the fixed K/V bytes a step reads. Everything here runs on the device with
static shapes and no host synchronisation: a captured decode step finds its rows from its own input token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.rows import FixedRows
from kernels.dispatch import backend_for
from kernels.reference.follow import follow_rows
from kernels.reference.suffix import shifted, suffix_scores, unique_rows

if TYPE_CHECKING:
    from engine.attention.method import LayerIndex, Method


@dataclass(frozen=True)
class FollowSettings:
    """decode: most rows a decode step adds (0: none); prefill: most rows a question's prefill adds (0: none);
    window: rows after each occurrence of a question bigram; lead: rows up to it (its own two tokens and those
    before them; off by default: on the embedded model at a 10% budget 8 won saap the two 16K needles it lost and
    cost it three of the 30-cell grid, squeeze one, and 2 cost every method 4K depth 0.7: engine/bench/README.md,
    "A lead before the question's word pairs: off"); leads: how many of the occurrences (the best first) take the
    lead (0: every one; the rows in all stay `prefill`); ngram: the longest suffix of the recent tokens a decode
    step matches; carry: whether each decode step also reads the question's rows (the prefill's)."""

    decode: int = 8
    prefill: int = 64
    window: int = 8
    lead: int = 0
    leads: int = 0
    ngram: int = 3
    carry: bool = True

    def __post_init__(self) -> None:
        for name in ("decode", "prefill"):
            if getattr(self, name) < 0:
                raise ValueError(f"follow {name} must be at least 0, got {getattr(self, name)}")
        if self.window < 1:
            raise ValueError(f"follow window must be at least 1, got {self.window}")
        if self.lead < 0:
            raise ValueError(f"follow lead must be at least 0, got {self.lead}")
        if self.leads < 0:
            raise ValueError(f"follow leads must be at least 0, got {self.leads}")
        if self.ngram < 1:
            raise ValueError(f"follow ngram must be at least 1, got {self.ngram}")

    @property
    def on(self) -> bool:
        return self.decode > 0 or self.prefill > 0

    @property
    def windows(self) -> int:
        """Occurrences of question bigrams a prefill reads around (at least one)."""
        if self.leads == 0:
            return max(1, self.prefill // (self.lead + self.window))
        return max(1, (self.prefill - self.leads * self.lead) // self.window)

    @property
    def led(self) -> int:
        """Of the windows, those that take the lead (the first: the best occurrences)."""
        return self.windows if self.leads == 0 else min(self.leads, self.windows)

    @property
    def question_rows(self) -> int:
        """Rows a question's prefill adds (a static size: whole windows, and the lead of those that take it)."""
        return self.windows * self.window + self.led * self.lead if self.prefill > 0 else 0

    @property
    def carried_rows(self) -> int:
        """Rows of the question's that each decode step reads again."""
        return self.question_rows if self.carry else 0

    def reserve(self, num_keys: int) -> tuple[float, float]:
        """(decode, prefill): the share of a global layer's `num_keys` fixed K/V rows each phase's rows may read."""
        return (self.decode + self.carried_rows) / num_keys, self.question_rows / num_keys


OFF = FollowSettings(decode=0, prefill=0)


class Follow:
    """The follow rows of one context, step after step (one instance per session, on the model's device).

    ids: [L] int64 the context's tokens, in token order; rows: which fixed K/V row holds each token.
    `begin(ids)` before each forward call over new tokens sets `positions` ([M] int64 token positions, -1 where
    none, each position once) from the call's tokens and the ones before them in the turn (`recent`, a device
    buffer: a captured decode step updates it itself) and, in a decode step, the question's rows (`question`, a
    device buffer the prefill fills in place).
    """

    def __init__(self, ids: torch.Tensor, rows: FixedRows, settings: FollowSettings):
        if ids.dim() != 1 or ids.numel() != rows.tokens:
            raise ValueError(f"ids must be [{rows.tokens}], got {tuple(ids.shape)}")
        self.settings = settings
        self.fixed_rows = rows
        self.ids = ids.to(torch.int64)
        n = self.ids.numel()
        self.bigrams = _bigram_codes(shifted(self.ids, 1), self.ids)  # [L]: -1 at position 0
        _, inverse, counts = torch.unique(self.bigrams, return_inverse=True, return_counts=True)
        self.rarity = counts[inverse]  # [L]: how often each position's bigram occurs in the document
        self.recent = torch.full((settings.ngram,), -1, dtype=torch.int64, device=self.ids.device)
        self.question = torch.full((settings.carried_rows,), -1, dtype=torch.int64, device=self.ids.device)
        self.positions = torch.full((0,), -1, dtype=torch.int64, device=self.ids.device)
        # a decode step's rows, written in place (a captured step reads this buffer)
        self.step_rows = torch.full((settings.decode + settings.carried_rows,), -1, dtype=torch.int64,
                                    device=self.ids.device)
        self.backend = backend_for(self.ids.device)
        self.position = torch.arange(n, device=self.ids.device)
        # an occurrence counts where the token after it is indexed: the dense rows (the sink and the last tokens)
        # are read by every step anyway, and a document's end that repeats the question would take every row
        self.indexed_next = self.stored_rows(self.position + 1)[1]

    def fork(self) -> "Follow":
        """Another sequence's follow rows over the same context: the context's tables shared (not copies), the
        turn's state (its recent tokens, the question's rows, the step's rows) its own."""
        other = copy.copy(self)
        other.recent, other.question, other.step_rows = (t.clone() for t in (self.recent, self.question,
                                                                             self.step_rows))
        other.positions = self.positions[:0]
        return other

    def begin(self, ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """ids: [n] int64 on the device, the tokens of the next forward call (n > 1: a question's prefill, which
        also starts the turn's recent tokens); valid: [1] int64, how many of them are real (the first ones: a
        question padded to a captured length), None: all."""
        ids = ids.reshape(-1).to(torch.int64)
        s = self.settings
        if ids.numel() > 1:
            self.positions = self._prefill(ids, valid) if s.prefill > 0 else self.positions[:0]
            # in place: a captured decode step reads these buffers
            _last_tokens(ids, self.recent, valid)
            self.question.copy_(self.positions[: self.question.numel()])
            return
        if s.decode > 0 and self.question.numel():  # one or two launches (kernels/suffix_ops.py)
            self.positions = self.backend.kernel("suffix").follow_step(self.ids, self.indexed_next, self.recent, ids,
                                                                      self.question, self.step_rows)
            return
        self.recent.copy_(torch.cat([self.recent[1:], ids]))
        self.positions = self._step(self.recent, self.question)

    def step_positions(self, prompt: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        """What `begin` sets for the call of a turn whose question's prompt is `prompt` [Lq] int64 and whose answer
        so far is `answer` [n] int64 (n = 0: the question's prefill; else the decode step whose input is the last
        answer token), without the state (the recall measurement's view of a turn)."""
        prompt = prompt.reshape(-1).to(device=self.ids.device, dtype=torch.int64)
        answer = answer.reshape(-1).to(device=self.ids.device, dtype=torch.int64)
        s = self.settings
        question = self._prefill(prompt) if s.prefill > 0 else self.positions[:0]
        if answer.numel() == 0:
            return question
        recent = _last_tokens(torch.cat([prompt, answer]), torch.empty(s.ngram, dtype=torch.int64,
                                                                       device=self.ids.device))
        return self._step(recent, question[: s.carried_rows])

    def turn_positions(self, prompt: torch.Tensor, inputs: torch.Tensor) -> list[int]:
        """The indexed token positions a turn read as follow rows, sorted: its prefill's over `prompt` [Lq] int64
        and those of the decode steps whose inputs were `inputs` [n] int64 (the answer's tokens that were fed back).
        What the turn's views show among the passages read; after the turn: the question's rows once (the rows a
        decode step carries are among them), then each decode step's own."""
        prompt = prompt.reshape(-1).to(device=self.ids.device, dtype=torch.int64)
        tokens = torch.cat([prompt, inputs.reshape(-1).to(device=self.ids.device, dtype=torch.int64)])
        s = self.settings
        read = [self._prefill(prompt)] if s.prefill > 0 else []
        if s.decode > 0:
            recent = torch.empty(s.ngram, dtype=torch.int64, device=self.ids.device)
            read += [self._decode(_last_tokens(tokens[:end], recent))
                     for end in range(prompt.numel() + 1, tokens.numel() + 1)]
        if not read:
            return []
        positions = torch.cat(read)
        _, indexed = self.stored_rows(positions)  # the dense rows: read anyway
        return sorted(set(positions[indexed].tolist()))

    def _step(self, recent: torch.Tensor, question: torch.Tensor) -> torch.Tensor:
        """A decode step's positions: [decode + carried rows], each once (-1 for a repeat)."""
        mine = self._decode(recent) if self.settings.decode > 0 else self.positions[:0]
        if not question.numel():
            return mine
        return unique_rows(torch.cat([mine, question]))

    def _decode(self, recent: torch.Tensor) -> torch.Tensor:
        """[decode] the tokens after the latest occurrences of the longest suffixes of `recent` [ngram]."""
        return _after(suffix_scores(self.ids, self.indexed_next, recent), self.settings.decode, 1, self.ids.numel())

    def _prefill(self, ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """[question_rows] the `window` tokens after each of the `windows` occurrences of a bigram of `ids`, the
        rarest bigrams first, then the latest, and the `lead` tokens up to each of the first `led` (valid: the real
        tokens of ids, the first ones; a bigram with a padding token in it is none)."""
        n = self.ids.numel()
        s = self.settings
        first = ids[:-1]
        if valid is not None:
            first = torch.where(torch.arange(1, ids.numel(), device=ids.device) < valid, first, -1)
        asked, _ = _bigram_codes(first, ids[1:]).sort()  # (torch.isin would synchronise with the host)
        at = torch.searchsorted(asked, self.bigrams).clamp(max=asked.numel() - 1)
        found = (asked[at] == self.bigrams) & (self.bigrams >= 0) & self.indexed_next
        score = torch.where(found, (n + 1 - self.rarity) * (n + 1) + self.position, -1)  # rarest, then latest
        return _after(score, s.windows, s.window, n, s.lead, s.led)

    def stored_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [M] (token positions, -1: none) -> ([M] int64 their indexed rows as stored, [M] bool valid:
        an indexed token's; the dense rows' are read by every step anyway)."""
        stored, valid = follow_rows(positions, self.fixed_rows.sink, self.fixed_rows.indexed, None, 1)
        return stored[0], valid[0]


def layout_order(method: Method, index: LayerIndex) -> torch.Tensor | None:
    """[Hkv, indexed] int32: the row of each stored indexed row in `method`'s layout of a layer (its
    engine.methods.LayerIndex), made once per index; None for a method that reads rows as stored."""
    def make():
        layout = method.layout(index)
        return None if layout is None else inverse_order(layout.order, index.indexed)
    return index.memo("follow.order", make)


def inverse_order(order: torch.Tensor, indexed: int) -> torch.Tensor:
    """order [Hkv, N] (the row as stored of each row of a layout) -> [Hkv, indexed] int32: the layout's row of each
    indexed row as stored."""
    hkv = order.shape[0]
    inv = torch.empty(hkv, order.shape[1], dtype=torch.int32, device=order.device)
    rows = torch.arange(order.shape[1], dtype=torch.int32, device=order.device).expand(hkv, -1).contiguous()
    inv.scatter_(1, order, rows)
    return inv[:, :indexed].contiguous()


def _last_tokens(tokens: torch.Tensor, out: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """out [ngram] (written in place and returned): the last ngram of `tokens` (of its first valid[0] when valid, a
    [1] int64 tensor, is given), -1 in front where there are fewer."""
    if valid is not None:  # on the device: the real tokens' end is not known on the host
        at = valid - out.numel() + torch.arange(out.numel(), device=tokens.device)
        out.copy_(torch.where(at >= 0, tokens[at.clamp(min=0)], -1))
        return out
    tail = tokens[-out.numel():]
    out.fill_(-1)
    out[out.numel() - tail.numel():] = tail
    return out


def _bigram_codes(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """One int64 per (first, second) token pair (token ids < 2**31); -1 where `first` is -1."""
    return torch.where(first >= 0, first * (1 << 31) + second, -1)


def _after(score: torch.Tensor, starts: int, window: int, n: int, lead: int = 0, led: int | None = None
           ) -> torch.Tensor:
    """The `window` positions after each of the `starts` best-scored positions (score >= 0) and, for the first
    `led` of them (None: every one), the `lead` up to it (itself included), -1 where none or outside the context:
    [starts * window + led * lead] int64."""
    led = starts if led is None else min(led, starts)
    k = min(starts, n)
    best, at = score.topk(k) if k > 0 else (score[:0], score[:0])
    if k < starts:  # a context shorter than `starts`: pad to the static size
        best = torch.cat([best, torch.full((starts - k,), -1, dtype=best.dtype, device=score.device)])
        at = torch.cat([at, torch.zeros(starts - k, dtype=at.dtype, device=score.device)])
    parts = []
    for rows, first, size in ((slice(0, led), 1 - lead, lead + window), (slice(led, starts), 1, window)):
        if rows.stop > rows.start:
            pos = at[rows, None] + first + torch.arange(size, device=score.device)[None, :]  # [occurrences, size]
            ok = (best[rows, None] >= 0) & (pos >= 0) & (pos < n)
            parts.append(torch.where(ok, pos, -1).reshape(-1))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return unique_rows(out) if lead + window > 1 else out  # windows may overlap
