"""Property-based fuzzing (hypothesis) of what takes a user's input: the document loaders (any bytes, any file name)
and the prompt builder (any document, question and chat history). No input crashes them; every refusal is one of
their named errors with a one-line message.

The number of inputs per property is SQUEEZE_FUZZ_EXAMPLES (default 150 here; a nightly run sets 10000, e.g.
`SQUEEZE_FUZZ_EXAMPLES=10000 python -m pytest -q tests/storage/test_fuzz.py`: 78 s on 2 cores, 40,000 inputs)."""

from __future__ import annotations

import io
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.text.prompt import (
    BasePrompt,
    DocumentTooLongError,
    Exchange,
    cut_at_stop,
    prompt_format,
    tokenize_document,
    turn_ids,
)
from storage import DocumentError, load_document_bytes
from tests.support.tiny_models import CHAT_TEMPLATE, byte_tokenizer

EXAMPLES = int(os.environ.get("SQUEEZE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=os.environ.get("SQUEEZE_FUZZ_EXAMPLES") is None)  # CI: the same inputs every run

NAMES = st.one_of(
    st.sampled_from(["doc.txt", "notes.md", "paper.pdf", "README.MARKDOWN", "scan.PDF", "image.png", "noext",
                     "../../etc/passwd.txt", "a" * 300 + ".txt", "d\u00e9j\u00e0 vu.md", ".hidden.txt", "x.txt.pdf"]),
    st.text(min_size=1, max_size=80).map(lambda s: s + ".txt"),
)


def _pdf_like() -> st.SearchStrategy[bytes]:
    """Bytes that start like a PDF: a real one-page PDF cut or corrupted somewhere, or a header and noise."""
    from pypdf import PdfWriter

    buf = io.BytesIO()
    writer = PdfWriter()
    writer.add_blank_page(width=200, height=200)
    writer.write(buf)
    real = buf.getvalue()
    return st.one_of(
        st.integers(0, len(real)).map(lambda n: real[:n]),
        st.tuples(st.integers(0, len(real) - 1), st.binary(min_size=1, max_size=16)).map(
            lambda t: real[:t[0]] + t[1] + real[t[0] + len(t[1]):]),
        st.binary(max_size=512).map(lambda b: b"%PDF-1.7\n" + b),
    )


BYTES = st.one_of(st.binary(max_size=2048), st.text(max_size=2048).map(str.encode),
                  st.text(max_size=512).map(lambda s: s.encode("utf-16")), _pdf_like())


def _one_line(exc: BaseException) -> None:
    message = str(exc)
    assert message and "\n" not in message.strip() and "Traceback" not in message, repr(message)


@FUZZ
@given(data=BYTES, name=NAMES)
def test_any_upload_loads_or_is_refused_in_one_plain_line(data, name):
    try:
        doc = load_document_bytes(data, name)
    except DocumentError as exc:
        _one_line(exc)
        return
    assert doc.text and doc.text == doc.text.strip() and "/" not in doc.name and "\\" not in doc.name
    assert list(doc.page_starts) == sorted(doc.page_starts) and doc.page_starts[0] == 0
    assert all(0 <= s <= len(doc.text) for s in doc.page_starts)


TEXT = st.text(max_size=300)
HISTORY = st.lists(st.builds(Exchange, TEXT, TEXT), max_size=5)


@pytest.fixture(scope="module", params=["base", "chat"])
def tokenizer(request):
    tok = byte_tokenizer()
    if request.param == "chat":
        tok.chat_template = CHAT_TEMPLATE
    return tok


@FUZZ
@given(document=st.text(max_size=600), question=TEXT, history=HISTORY, limit=st.integers(0, 400))
def test_any_conversation_becomes_tokens_or_a_clear_refusal(tokenizer, document, question, history, limit):
    """The fixed context fits its limit or is refused (too long) or cut (truncate); a turn's tokens hold at most
    `limit` tokens of history beyond the question's own, the latest exchanges kept; a blank question is refused."""
    fmt = prompt_format(tokenizer)
    try:
        fixed = tokenize_document(tokenizer, document, 1024 + 300, prefix=fmt.document_prefix())
    except DocumentTooLongError as exc:
        _one_line(exc)
        fixed = tokenize_document(tokenizer, document, 1024 + 300, truncate=True, prefix=fmt.document_prefix())
        assert fixed.truncated and fixed.ids.numel() == 300
    assert fixed.ids.numel() == fixed.offsets.shape[0] <= 300
    try:
        turn = turn_ids(tokenizer, fmt, question, history, limit)
    except ValueError as exc:
        assert not question.split() and "empty" in str(exc)
        return
    alone = turn_ids(tokenizer, fmt, question).ids.numel()
    assert 0 <= turn.history <= len(history)
    assert turn.ids.numel() - alone <= limit or turn.history == 0
    if turn.history:  # the latest exchanges: one more would not have fitted
        kept = history[len(history) - turn.history:]
        assert turn.ids.tolist() == turn_ids(tokenizer, fmt, question, kept, 10**9).ids.tolist()
    assert isinstance(fmt, BasePrompt) == (tokenizer.chat_template is None)


@FUZZ
@given(text=st.text(max_size=200), stops=st.lists(st.text(min_size=1, max_size=4), max_size=3))
def test_stop_strings_cut_a_prefix_and_never_the_leading_blank_lines(text, stops):
    cut, stopped = cut_at_stop(text, stops)
    assert text.startswith(cut)
    body = len(text) - len(text.lstrip())
    assert len(cut) >= body  # the answer's leading blank lines are never cut away
    assert stopped == (cut != text)
    if stopped:  # cut where a stop string starts, past the blank lines
        assert any(text.startswith(s, len(cut)) for s in stops)
