"""How a document and a question become tokens: the fixed context, then the turn's prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"
STOP_STRINGS = ("\n\n", "\nQuestion:", "\nAnswer:")  # a base model answers, then starts a new paragraph, question or answer
ANSWER_RESERVE = 1024  # tokens of the model's context kept free for the question and the answer


class DocumentTooLongError(ValueError):
    """The document does not fit the model's context; carries the counts for the message."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(
            f"the document is {tokens} tokens but this model takes at most {limit} tokens of fixed context "
            f"(its context minus {ANSWER_RESERVE} for the question and answer); pass --truncate to keep the first {limit}"
        )
        self.tokens, self.limit = tokens, limit


@dataclass
class FixedContext:
    """ids: [L] int64 token ids; offsets: [L, 2] int64 character span of each token in the text ((-1, -1) for specials)."""

    ids: torch.Tensor
    offsets: torch.Tensor
    truncated: bool


def tokenize_document(tokenizer, text: str, max_context: int, truncate: bool = False) -> FixedContext:
    """BOS (when the tokenizer has one) + the document's tokens, refused or truncated when over the limit."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        ids, offsets = [bos] + ids, [(-1, -1)] + offsets
    limit = max_context - ANSWER_RESERVE
    truncated = False
    if len(ids) > limit:
        if not truncate:
            raise DocumentTooLongError(len(ids), limit)
        ids, offsets, truncated = ids[:limit], offsets[:limit], True
    return FixedContext(torch.tensor(ids, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64), truncated)


def question_ids(tokenizer, question: str) -> torch.Tensor:
    """[Lq] int64: the turn's prompt that follows the fixed context."""
    question = " ".join(question.split())
    if not question:
        raise ValueError("the question is empty")
    return torch.tensor(tokenizer(QUESTION_TEMPLATE.format(question=question), add_special_tokens=False)["input_ids"])
