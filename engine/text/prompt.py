"""How a document and a conversation become tokens: the fixed context (the document, inside the chat template's
first user message when the tokenizer has a template), then each turn's dynamic tokens (the earlier exchanges of
the chat, oldest dropped first past a token limit, and the question).

Two formats (`prompt_format`): the base-model one ("Question: ... Answer:" after the document; the answer ends at
a blank line or a new question), and the tokenizer's chat template, split at the document so that the document's
K/V are the same for every turn: the fixed context is the template's text up to the end of the document, a turn is
the rest of the template's rendering of the whole conversation (checked to begin with that same text). In both, an
answer also ends at a line that is only a page number after a finished sentence (`cut_answer`): the model carrying
on with the document's page footers rather than answering.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"
EXCHANGE_TEMPLATE = "\n\nQuestion: {question}\nAnswer: {answer}"  # an earlier turn of the chat (base format)
STOP_STRINGS = ("\n\n", "\nQuestion:", "\nAnswer:")  # a base model answers, then starts a new paragraph, question or answer
ANSWER_RESERVE = 1024  # tokens of the model's context kept free for the question and the answer
HISTORY_TOKENS = 1024  # at most this many tokens of a chat's earlier turns go into a turn's input
# A line that is only a page's number ("18", "- 18 -", "Page 18", "18 of 40", "p. 18") after an answer's finished
# sentence is no answer: the model goes on writing the document, whose pages end with such lines.
_PAGE_LINE = re.compile(r"[ \t]*[-\u2013\u2014]?[ \t]*(?:(?:page|p\.)[ \t]*)?\d{1,4}"
                        r"(?:[ \t]*(?:/|of)[ \t]*\d{1,4})?[ \t]*[-\u2013\u2014]?[ \t]*", re.IGNORECASE)
_PAGE_LINE_START = re.compile(r"[ \t\d/.\-\u2013\u2014pageofPAGEOF]{0,24}")  # what may still become one
_SENTENCE_END = re.compile(r"[.!?\u2026)\]\"'\u201d\u2019*`]$")  # an answer's text that has ended its sentence
_DOCUMENT = "\x00DOCUMENT\x00"  # stands for the document where a chat template is rendered
_QUESTION = "\x00QUESTION\x00"


@dataclass(frozen=True)
class Exchange:
    """An earlier turn of a chat: what was asked and what was answered."""

    question: str
    answer: str


class BasePrompt:
    """The base-model format: the document, then "Question: ... Answer:" per turn."""

    stop_strings: tuple[str, ...] = STOP_STRINGS

    def document_prefix(self) -> str | None:
        """Text before the document in the fixed context; None: the tokenizer's BOS alone."""
        return None

    def turn_text(self, history: Sequence[Exchange], question: str) -> str:
        """The text after the document for a turn with these earlier exchanges."""
        earlier = "".join(EXCHANGE_TEMPLATE.format(question=_clean(e.question), answer=_clean(e.answer))
                          for e in history)
        return earlier + QUESTION_TEMPLATE.format(question=_clean(question))


class ChatPrompt:
    """A tokenizer's chat template: the document and the chat's first question in the first user message."""

    stop_strings: tuple[str, ...] = ()  # the template's end-of-turn token ends the answer

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        first = self._render([{"role": "user", "content": f"{_DOCUMENT}\n\n{_QUESTION}"}])
        at = first.find(_DOCUMENT)
        if at < 0 or first.find(_QUESTION) < at:
            raise ValueError("the chat template does not keep the user's message in order")
        self.prefix = first[:at]

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def document_prefix(self) -> str | None:
        return self.prefix

    def turn_text(self, history: Sequence[Exchange], question: str) -> str:
        asked = [_clean(e.question) for e in history] + [_clean(question)]
        messages = []
        for i, q in enumerate(asked):
            messages.append({"role": "user", "content": f"{_DOCUMENT}\n\n{q}" if i == 0 else q})
            if i < len(history):
                messages.append({"role": "assistant", "content": _clean(history[i].answer)})
        text = self._render(messages)
        head = self.prefix + _DOCUMENT
        if not text.startswith(head):
            raise ValueError("the chat template renders the conversation's start differently from the document's")
        return text[len(head):]


def prompt_format(tokenizer) -> BasePrompt | ChatPrompt:
    """The format of a tokenizer: its chat template when it has one, else the base format. (A context's cache key
    holds the model and PROMPT_VERSION, not the template: a model whose template is edited keeps its contexts.)"""
    return ChatPrompt(tokenizer) if getattr(tokenizer, "chat_template", None) else BasePrompt()


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The answer so far up to its first stop string, and whether one was found. Stop strings count from the
    answer's first non-blank character: an answer that opens with blank lines is not cut to nothing."""
    body = len(text) - len(text.lstrip())
    found = [at for at in (text.find(s, body) for s in stops) if at >= 0]
    return (text[:min(found)], True) if found else (text, False)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of an answer so far could be the start of a stop string (a stream shows them
    once the next tokens tell), counted from its first non-blank character."""
    room = len(text.lstrip())  # (the leading blank characters never start one)
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, room), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def page_line_at(text: str, final: bool = False) -> int | None:
    """Where an answer so far ends when one of its lines is only a page number after a finished sentence (the end
    of that sentence: the blank lines and the number go), or None. A line counts once a newline ends it, the last
    one too when `final` (the answer is over)."""
    lines = text.split("\n")
    at = len(lines[0]) + 1  # where lines[i] starts
    for i in range(1, len(lines)):
        line = lines[i]
        if (i < len(lines) - 1 or final) and _PAGE_LINE.fullmatch(line):
            before = text[:at].rstrip()
            if _SENTENCE_END.search(before):
                return len(before)
        at += len(line) + 1
    return None


def page_line_held(text: str) -> int:
    """How many trailing characters of an answer so far could still become a page-number line after its finished
    sentence (page_line_at): a stream shows them once the next tokens tell."""
    at = text.rfind("\n")
    if at < 0 or not _PAGE_LINE_START.fullmatch(text[at + 1:]):
        return 0
    before = text[:at].rstrip()
    return len(text) - len(before) if _SENTENCE_END.search(before) else 0


def cut_answer(text: str, stops: Sequence[str], final: bool = False) -> tuple[str, bool]:
    """The answer so far up to its first stop string (cut_at_stop) or page-number line (page_line_at), and whether
    it ends there. final: the answer is over (its last line counts as ended)."""
    text, stopped = cut_at_stop(text, stops)
    at = page_line_at(text, final or stopped)
    return (text[:at], True) if at is not None else (text, stopped)


def answer_held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of an answer so far a stream holds back: those that could start a stop string
    (held_back) or become a page-number line (page_line_held)."""
    return max(held_back(text, stops), page_line_held(text))


def _clean(text: str) -> str:
    return " ".join(text.split())


class DocumentTooLongError(ValueError):
    """The document does not fit the model's context; carries the counts for the message (at_least: `tokens` counts
    only the document's start, which already overflows)."""

    def __init__(self, tokens: int, limit: int, at_least: bool = False):
        super().__init__(
            f"the document is {'more than ' if at_least else ''}{tokens} tokens but this model takes at most {limit} "
            f"tokens of fixed context (its context minus {ANSWER_RESERVE} for the question and answer); pass "
            f"--truncate to keep the first {limit}"
        )
        self.tokens, self.limit = tokens, limit


# No token of a tokenizer spans more characters than this: a document longer than this many characters per token
# of the limit is tokenized from its start only (a 50 MB one-line text took minutes and GBs to be refused whole).
MAX_CHARS_PER_TOKEN = 64


@dataclass
class FixedContext:
    """ids: [L] int64 token ids; offsets: [L, 2] int64 character span of each token in the text ((-1, -1) for specials)."""

    ids: torch.Tensor
    offsets: torch.Tensor
    truncated: bool


def tokenize_document(tokenizer, text: str, max_context: int, truncate: bool = False,
                      prefix: str | None = None) -> FixedContext:
    """BOS (when the tokenizer has one) + the document's tokens, refused or truncated when over the limit.
    prefix: text before the document instead of BOS (a chat template's, which holds its own BOS). A text of more
    than MAX_CHARS_PER_TOKEN characters per token of the limit is tokenized from its start only where that start
    already overflows the limit (its first tokens are the whole text's: a token never reaches that far)."""
    limit = max_context - ANSWER_RESERVE
    head_chars = (limit + 1) * MAX_CHARS_PER_TOKEN
    if len(text) > head_chars:
        head = tokenize_document(tokenizer, text[:head_chars], max_context, True, prefix)
        if head.truncated and not truncate:
            raise DocumentTooLongError(limit, limit, at_least=True)
        if head.truncated:
            return head
        # (a start that fits the limit: the whole text decides)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    if prefix is not None:
        head = list(tokenizer(prefix, add_special_tokens=False)["input_ids"])
        ids, offsets = head + ids, [(-1, -1)] * len(head) + offsets
    elif getattr(tokenizer, "bos_token_id", None) is not None:
        ids, offsets = [tokenizer.bos_token_id] + ids, [(-1, -1)] + offsets
    truncated = False
    if len(ids) > limit:
        if not truncate:
            raise DocumentTooLongError(len(ids), limit)
        ids, offsets, truncated = ids[:limit], offsets[:limit], True
    return FixedContext(torch.tensor(ids, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64), truncated)


def question_ids(tokenizer, question: str) -> torch.Tensor:
    """[Lq] int64: a lone question's prompt in the base format (what follows the fixed context)."""
    return turn_ids(tokenizer, BasePrompt(), question).ids


@dataclass
class TurnPrompt:
    """ids: [Lq] int64, a turn's dynamic tokens; history: how many earlier exchanges they hold (the latest ones)."""

    ids: torch.Tensor
    history: int


def turn_ids(tokenizer, fmt: BasePrompt | ChatPrompt, question: str, history: Sequence[Exchange] = (),
             limit: int = HISTORY_TOKENS, room: int | None = None) -> TurnPrompt:
    """The tokens after the fixed context for `question` after the chat's `history` (oldest first): the latest
    exchanges whose tokens, beyond those of the question alone, fit `limit` and `room` (the tokens the model's
    context has left for the turn's input; a question that does not fit it alone is refused)."""
    if not _clean(question):
        raise ValueError("the question is empty")

    def encode(kept: Sequence[Exchange]) -> list[int]:
        return list(tokenizer(fmt.turn_text(kept, question), add_special_tokens=False)["input_ids"])

    alone = encode(())
    if room is not None:
        if len(alone) > room:
            raise ValueError(f"the question is {len(alone)} tokens; with this document and the answer's tokens the "
                             f"model has room for {room}")
        limit = min(limit, room - len(alone))
    for first in range(len(history)):  # the most history that fits
        ids = encode(history[first:])
        if len(ids) - len(alone) <= limit:
            return TurnPrompt(torch.tensor(ids, dtype=torch.int64), len(history) - first)
    return TurnPrompt(torch.tensor(alone, dtype=torch.int64), 0)
