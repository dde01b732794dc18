"""One question's answer over a ready context, token by token: what a turn makes of the tokens it is given, apart
from how they are generated (alone, engine.model.generate; or in a step with other turns, engine.model.batch).

A `Turn` builds the question's prompt (after the chat's history that fits) for its step context (a session's cache,
or a fork of it: another turn over the same context; with its statistics' recorder); `feed(token)` turns each token
into the piece of the answer to show (stop strings, a page-number line after a finished sentence and a character
whose bytes are not all there are held back until the next tokens tell); `finish()` gives the last piece and the
Answer with the turn's statistics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.attention.function import StepContext
from engine.attention.stats import TurnStats
from engine.methods import StepPlan
from engine.model.load import LoadedModel
from engine.model.sampling import GenerationOptions, Sampler
from engine.text.prompt import HISTORY_TOKENS, Exchange, answer_held_back, cut_answer, prompt_format, turn_ids


@dataclass
class Delta:
    """A piece of the answer's text, streamed as it is generated."""

    text: str


@dataclass
class Answer:
    """The whole answer and what attention did while producing it.

    plan: the plan the turn's lookups used; unit_scores: what they scored (engine.attention.stats.TurnRecorder.
    unit_scores: the explanations' input, tensors that are not part of the saved statistics)
    """

    text: str
    stats: TurnStats
    plan: StepPlan | None = None
    unit_scores: dict = field(default_factory=dict)
    history: int = 0  # earlier exchanges of the chat in the turn's input
    follow: list[int] = field(default_factory=list)  # document tokens read as follow rows (engine.attention.follow)
    tokens: list[int] = field(default_factory=list)  # the answer's token ids (through the one that ends a stop string)

    @property
    def empty(self) -> bool:
        """The model said nothing (it ended at once, or only with blank lines)."""
        return not self.text.strip()


def check_answer_tokens(lm: LoadedModel, fixed_len: int, max_new_tokens: int) -> None:
    """Refuse an answer length that is not at least 1 or that the model's context cannot hold beside a document of
    fixed_len tokens and a question of one token at least (ValueError, saying what fits)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    most = lm.max_context - fixed_len - 1  # the question needs a token at least
    if max_new_tokens > most:
        raise ValueError(f"an answer of {max_new_tokens} tokens does not fit: the model's context holds "
                         f"{lm.max_context} tokens and the document takes {fixed_len}; ask for at most "
                         f"{max(most, 0)} (less a long question's tokens)")


class Turn:
    """A question over a context of fixed_len tokens, answered in at most max_new_tokens tokens through `step` (its
    StepContext, with a recorder: engine.context.session.ContextSession.step_context). The other arguments:
    ContextSession.stream's."""

    def __init__(self, lm: LoadedModel, fixed_len: int, step: StepContext, question: str, max_new_tokens: int,
                 history: Sequence[Exchange] = (), options: GenerationOptions | None = None,
                 history_tokens: int = HISTORY_TOKENS, until: Callable[[str], bool] | None = None):
        check_answer_tokens(lm, fixed_len, max_new_tokens)
        if step.recorder is None or step.plan is None:
            raise ValueError("a turn's step context needs a plan and a recorder")
        self.lm, self.step, self.recorder = lm, step, step.recorder
        self.max_new_tokens, self.until = max_new_tokens, until
        self.format = prompt_format(lm.tokenizer)
        self.turn = turn_ids(lm.tokenizer, self.format, question, history, history_tokens,
                             room=lm.max_context - fixed_len - max_new_tokens)
        self.options = options or GenerationOptions()
        self.sampler = None if self.options.greedy else Sampler(self.options, lm.model.config.vocab_size, lm.device)
        self.eos = lm.eos_ids()
        self.generated: list[int] = []
        self.ended = False  # by an end-of-sequence token: the step after the last answer token ran too
        self.done = False
        self.text = ""
        self.shown = ""  # what the pieces have said (a possible stop string's start is held back)
        self.start = time.perf_counter()
        self.queued = 0.0  # seconds between the ask and this turn's making (count_from)
        self.first: float | None = None

    @property
    def prompt(self) -> torch.Tensor:
        """The question's prompt ids [Lq] int64 (after the history that fits)."""
        return self.turn.ids

    def count_from(self, asked: float) -> None:
        """Count the turn's times from `asked` (time.perf_counter() when the user asked) instead of its making: the
        first token's time then holds the wait in a queue and the context's opening, as the user lives them
        (timings' queued_s: the part before the turn was made)."""
        self.queued = max(0.0, self.start - asked)
        self.start = min(self.start, asked)

    def feed(self, token: int) -> Delta | None:
        """The next token of the answer: the piece of text it shows, if any. Afterwards `done` tells whether the
        answer has ended (an end-of-sequence token, a stop string, `until`, or max_new_tokens tokens)."""
        if self.done:
            raise RuntimeError("the turn has ended: it takes no more tokens")
        self.first = self.first if self.first is not None else time.perf_counter() - self.start
        if token in self.eos:
            self.ended = self.done = True
            return None
        self.generated.append(token)
        text, stopped = cut_answer(self.lm.tokenizer.decode(self.generated, skip_special_tokens=True),
                                   self.format.stop_strings)
        self.text = text
        visible = text if stopped else text[:len(text) - answer_held_back(text, self.format.stop_strings)]
        visible = visible.rstrip("\ufffd")  # (a character whose bytes are not all there yet decodes as U+FFFD)
        piece = None
        if visible.startswith(self.shown) and len(visible) > len(self.shown):
            piece = Delta(visible[len(self.shown):])
            self.shown = visible
        self.done = stopped or (self.until is not None and self.until(text)) or \
            len(self.generated) >= self.max_new_tokens
        return piece

    def finish(self) -> tuple[Delta | None, Answer]:
        """The end of the turn: the piece held back that no stop string followed (or None), and the Answer. The
        turn's new tokens are forgotten (the cache keeps the document)."""
        text = cut_answer(self.text, self.format.stop_strings, final=True)[0]  # (its last line is a whole one now)
        piece = Delta(text[len(self.shown):]) if text.startswith(self.shown) and len(text) > len(self.shown) else None
        self.step.cache.reset_dynamic()
        total = time.perf_counter() - self.start
        decode_s = max(total - (self.first or 0.0), 1e-9)
        n = len(self.generated)
        timings = {
            "first_token_s": round(self.first or 0.0, 6),
            "total_s": round(total, 6),
            "tokens_per_s": round((n - 1) / decode_s, 3) if n > 1 else 0.0,
            "queued_s": round(self.queued, 6),
        }
        step = self.step
        stats = self.recorder.finish(step.method.name, round(1.0 - step.plan.budget, 6), n, timings)  # the plan's
        stats.extra.update(unit=step.method.unit, plan=step.plan.describe(), history=self.turn.history,
                           generation=self.options.to_json())
        follow = []
        if step.follow is not None:  # the decode steps' inputs: every answer token but the last, unless eos came
            inputs = self.generated if self.ended else self.generated[:-1]
            follow = step.follow.turn_positions(self.turn.ids, torch.tensor(inputs, dtype=torch.int64))
        return piece, Answer(text=text.strip(), stats=stats, plan=step.plan, unit_scores=self.recorder.unit_scores(),
                             history=self.turn.history, follow=follow, tokens=self.generated)
