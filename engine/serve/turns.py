"""A turn of a chat, below the UI: the question answered (streamed), explained, compared with full attention when
asked, and recorded in the store with its statistics; the app only shows what this yields."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

from engine.context.session import Answer, Delta
from engine.methods import REGISTRY
from engine.model.sampling import GenerationOptions
from engine.serve.explain import explain_turn
from engine.serve.jobs import plain_error
from engine.serve.scheduler import Waiting
from engine.serve.service import Engine, Overrides
from engine.text.prompt import Exchange

STOPPED_MARK = " [stopped]"
EMPTY_ANSWER = ("(The model gave no answer: it ended at once. Rephrase the question, allow more tokens, or try "
                "sampling with a temperature.)")


def same_answer(a: str, b: str) -> bool:
    """Whether two answers say the same, ignoring case, spacing and trailing punctuation."""
    def norm(s: str) -> str:
        return " ".join(s.lower().split()).rstrip(" .!")
    return norm(a) == norm(b)


@dataclass
class RecordedTurn:
    """A turn as saved: the store's row (question, answer, method, sparsity, stats), and whether it was stopped."""

    row: dict
    stopped: bool


class Turns:
    """Answers, explains and records the turns of chats over one engine's contexts."""

    def __init__(self, engine: Engine):
        self.engine, self.store = engine, engine.store

    def history(self, chat_id: int) -> list[Exchange]:
        """The chat's earlier exchanges, oldest first, as the model reads them (a stopped answer as far as it went)."""
        return [Exchange(t["question"], "" if t["answer"] == EMPTY_ANSWER else t["answer"].removesuffix(STOPPED_MARK))
                for t in self.store.chats.turns(chat_id)]

    def answer(self, chat_id: int, context_id: str, question: str, method: str, sparsity: float, max_new_tokens: int,
               compare: bool = False, stop: threading.Event | None = None, options: GenerationOptions | None = None,
               overrides: Overrides | None = None) -> Iterator[Delta | Waiting | RecordedTurn]:
        """Yield Waiting(ahead) while the turn is queued behind other users' (engine.serve.scheduler), the answer's
        pieces, then the RecordedTurn. The chat's earlier turns are the model's input before
        the question (engine.text.prompt: the latest that fit). `stop` set while it streams ends the answer there:
        what was said is kept (marked as stopped, without statistics). sparsity: as the user set it (the method's
        plan says what it means: full attention reads everything); options: how tokens are chosen (None: greedy);
        overrides: this user's settings of some methods (Engine.stream). An empty answer is recorded as
        EMPTY_ANSWER; the turn records the sparsity of the plan it ran."""
        answer, text, stopped = None, "", False
        history = self.history(chat_id)
        stream = self.engine.stream(context_id, question, method, sparsity, max_new_tokens, history=history,
                                    options=options, overrides=overrides)
        try:
            for event in stream:
                if isinstance(event, Delta):
                    text += event.text
                    yield event
                elif isinstance(event, Answer):
                    answer = event
                elif isinstance(event, Waiting):
                    yield event
                if stop is not None and stop.is_set():
                    stopped = answer is None
                    break
        finally:
            stream.close()
        if stopped:
            text = text.strip()
            plan = self.engine.plan(context_id, method, sparsity, overrides)  # (from the store: no context loads)
            ran = round(1.0 - plan.budget, 6) if plan is not None else sparsity
            stats = {"stopped": True, "context_id": context_id, "method": method, "sparsity": ran}
            self.store.chats.add_turn(chat_id, question, text + STOPPED_MARK, method, ran, stats)
        else:
            stats = self.statistics(context_id, answer, method)
            if compare and REGISTRY[method].sparse:
                stats["compare"] = self.compare(context_id, question, answer, max_new_tokens, history, options)
            said = answer.text if not answer.empty else EMPTY_ANSWER
            if answer.empty:
                stats["empty"] = True
            self.store.chats.add_turn(chat_id, question, said, method, answer.stats.sparsity, stats)
        yield RecordedTurn(row=self.store.chats.turns(chat_id)[-1], stopped=stopped)

    def statistics(self, context_id: str, answer: Answer, method: str) -> dict:
        """What is saved with a turn: TurnStats (with the plan the turn used), the context, and the retrieval
        report (engine.serve.explain, from what the turn's lookups scored) the views are drawn from."""
        stats = answer.stats.to_json()
        stats["context_id"] = context_id
        try:
            stats["retrieval"] = explain_turn(answer, method)
            build = self.store.methods.get(context_id, method)
            stats["retrieval"]["built_at"] = build["built_at"] if build else None  # which index its unit ids name
        except Exception as exc:  # noqa: BLE001 - the answer stands; the views say what is missing
            stats["retrieval"] = {"layers": [], "error": plain_error(exc)}
        return stats

    def compare(self, context_id: str, question: str, answer: Answer, max_new_tokens: int,
                history: list[Exchange] | None = None, options: GenerationOptions | None = None) -> dict:
        """Full attention's answer to the same question (after the same history, chosen the same way), and whether
        it says the same."""
        full = self.engine.ask(context_id, question, "full", max_new_tokens=max_new_tokens, history=history or [],
                               options=options)
        return {"answer": full.text, "agree": same_answer(full.text, answer.text),
                "total_s": full.stats.timings.get("total_s", 0.0),
                "first_token_s": full.stats.timings.get("first_token_s", 0.0)}
