"""Which page each sentence of an answer comes from (pure functions: no Gradio, no engine calls, no tensors).

A sentence is cited to the retrieved passage that best supports it: the share of the sentence's content words that
the passage's text holds (its lexical support), raised by how strongly attention retrieved the passage (its score
beside the best passage's). A sentence that no passage supports gets no citation rather than a wrong one. The
citations are a view of a turn: the answer's text, as saved and as the model reads it again, is left as it is.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

SUPPORT_REACH = 80  # characters each side of a passage's span that count as its text (what the passages list shows)
MIN_SUPPORT = 0.34  # share of a sentence's content words a passage must hold to support it
MIN_SHARED = 2  # content words a supporting passage shares with the sentence (all of them in a shorter sentence)
RETRIEVAL_SHARE = 0.25  # how far a passage's retrieval weight moves the combined score (lexical support leads)
NEAR_BEST = 0.9  # another page is cited beside the best one when its passage scores within this share of the best
MAX_SOURCES = 2  # pages (or passages) cited per sentence at most
MIN_WORD = 3  # letters a word needs to count as a content word (any word with a digit counts)

# A sentence ends at . ! or ? (closing quotes and brackets included) before a space and a word that does not start in
# lower case (so "e.g. the" stays one sentence), at the end of the answer, or at a line break.
SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s+[^a-z\s]|\s*$)|\n")
WORD = re.compile(r"\w+")
STOPWORDS = frozenset("""
    a about above after again all also an and any are as at be because been before being below between both but by
    can could did do does doing down during each few for from further had has have having he her here hers him his
    how i if in into is it its itself just me more most my no nor not now of off on once only or other our ours out
    over own same she should so some such than that the their theirs them then there these they this those through
    to too under until up very was we were what when where which while who whom why will with would you your yours
""".split())


@dataclass(frozen=True)
class Citation:
    """One sentence of an answer and where it comes from.

    start, end: the sentence's character span in the answer
    sources: indices into the passages given (best first; one per page), empty when no passage supports it
    pages: the 1-based page of each source; score: the best source's combined score (0 without one)
    """

    start: int
    end: int
    sources: tuple[int, ...] = ()
    pages: tuple[int, ...] = ()
    score: float = 0.0


def sentence_spans(answer: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of `answer`, surrounding white space left out, empty pieces dropped."""
    spans, start = [], 0
    for match in SENTENCE_END.finditer(answer):
        spans.append((start, match.end()))
        start = match.end()
    spans.append((start, len(answer)))
    out = []
    for a, b in spans:
        piece = answer[a:b]
        lead = len(piece) - len(piece.lstrip())
        a, b = a + lead, a + len(piece.rstrip())
        if b > a:
            out.append((a, b))
    return out


def content_words(text: str) -> set[str]:
    """The words of `text` that carry its content: lower case, a plural's or possessive's final "s" dropped, stop
    words and words shorter than MIN_WORD left out (a word with a digit, such as a number, always counts)."""
    out = set()
    for word in WORD.findall(text.lower()):
        has_digit = any(ch.isdigit() for ch in word)
        if word in STOPWORDS or (len(word) < MIN_WORD and not has_digit):
            continue
        if not has_digit and len(word) > MIN_WORD and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        out.add(word)
    return out


def lexical_support(sentence: set[str], passage: set[str]) -> float:
    """The share of a sentence's content words that a passage holds; 0 when it shares fewer than MIN_SHARED of them
    (all of them, for a sentence with fewer) or less than MIN_SUPPORT."""
    if not sentence:
        return 0.0
    shared = len(sentence & passage)
    share = shared / len(sentence)
    if shared < min(MIN_SHARED, len(sentence)) or share < MIN_SUPPORT:
        return 0.0
    return share


def page_span(text: str, page_starts: Sequence[int], page: int) -> tuple[int, int]:
    """The character span of page `page` (1-based) in `text`."""
    end = page_starts[page] if page < len(page_starts) else len(text)
    return page_starts[page - 1], end


def passage_words(text: str, page_starts: Sequence[int], passage, reach: int = SUPPORT_REACH) -> set[str]:
    """The content words of a passage's text, `reach` characters each side of its span included (whole words) as
    far as its page goes: what a citation of its page points at."""
    lo, hi = page_span(text, page_starts, page_of(page_starts, passage.start))
    a, b = max(lo, passage.start - reach), min(hi, passage.end + reach)
    while a > lo and not text[a - 1].isspace():
        a -= 1
    while b < hi and not text[b].isspace():
        b += 1
    return content_words(text[a:b])


def page_of(page_starts: Sequence[int], offset: int) -> int:
    """The 1-based page of the character at `offset` (storage.Document.page_of)."""
    return max(1, bisect.bisect_right(page_starts, offset))


def cite(text: str, page_starts: Sequence[int], passages: Sequence, answer: str) -> list[Citation]:
    """The citation of each sentence of `answer`, in order.

    text, page_starts: the document's text and page map (page i + 1 starts at page_starts[i])
    passages: what the turn retrieved, each with .start and .end (its character span in `text`) and .score (how
        strongly attention retrieved it; engine.serve.explain.Passage)
    Each sentence cites the passages with the best combined score, lexical_support * (1 - RETRIEVAL_SHARE +
    RETRIEVAL_SHARE * score / best score), those within NEAR_BEST of the best on other pages too (MAX_SOURCES at
    most); a sentence no passage supports cites none.
    """
    words = [passage_words(text, page_starts, p) for p in passages]
    top = max((float(p.score) for p in passages), default=0.0)
    weights = [float(p.score) / top if top > 0 else 1.0 for p in passages]
    pages = [page_of(page_starts, p.start) for p in passages]
    out = []
    for start, end in sentence_spans(answer):
        sentence = content_words(answer[start:end])
        scored = sorted(((lexical_support(sentence, w) * (1 - RETRIEVAL_SHARE + RETRIEVAL_SHARE * weight), i)
                         for i, (w, weight) in enumerate(zip(words, weights))), key=lambda s: -s[0])
        best = scored[0][0] if scored else 0.0
        sources: list[int] = []
        for score, i in scored:
            if score <= 0 or score < NEAR_BEST * best or len(sources) >= MAX_SOURCES:
                break
            if all(pages[j] != pages[i] for j in sources):
                sources.append(i)
        out.append(Citation(start=start, end=end, sources=tuple(sources), pages=tuple(pages[i] for i in sources),
                            score=best))
    return out
