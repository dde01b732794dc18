"""storage.documents: files in, Documents out, every failure a named DocumentError."""

from __future__ import annotations

import hashlib
import os

import pytest

from storage import (
    CorruptDocumentError,
    Document,
    DocumentError,
    EmptyDocumentError,
    EncryptedPDFError,
    NotAFileError,
    NoTextError,
    UnsupportedTypeError,
    load_document,
    load_document_bytes,
)
from storage.documents import PAGE_SEPARATOR
from tests.support.pdfs import make_blank_pdf, make_encrypted_pdf, make_text_pdf

PAGES = [
    "Chapter one (the start) talks about C:\\paths and apples.",
    "Chapter two is about bananas.\nIt has a second line.",
    "Chapter three ends with cherries.",
]


# --------------------------------------------------------------------------- text files


def test_txt_round_trip_normalises_whitespace(tmp_path):
    raw = b"first line   \r\nsecond\t\r\n\r\n\r\n\r\n\r\nthird\r\n\r\n"
    path = tmp_path / "Notes.TXT"
    path.write_bytes(raw)
    doc = load_document(path)
    assert doc == load_document_bytes(raw, "Notes.TXT")
    assert (doc.name, doc.kind, doc.pages, doc.page_starts) == ("Notes.TXT", "txt", 1, (0,))
    assert doc.text == "first line\nsecond\n\nthird"
    assert doc.sha256 == hashlib.sha256(raw).hexdigest()
    assert doc.doc_id == doc.sha256[:16]
    assert doc.page_of(0) == doc.page_of(len(doc.text) - 1) == 1


@pytest.mark.parametrize("name", ["readme.md", "README.MD", "guide.markdown"])
def test_markdown_kind(name):
    doc = load_document_bytes(b"# Title\n\nSome *text*.\n", name)
    assert doc.kind == "md"
    assert doc.text == "# Title\n\nSome *text*."


@pytest.mark.parametrize(
    "raw, text",
    [
        ("caf\u00e9 \u201cquoted\u201d".encode("utf-8"), "caf\u00e9 \u201cquoted\u201d"),
        (b"\xef\xbb\xbfwith a BOM", "with a BOM"),
        ("caf\u00e9 \u201cquoted\u201d".encode("cp1252"), "caf\u00e9 \u201cquoted\u201d"),
        ("UTF-16 caf\u00e9".encode("utf-16"), "UTF-16 caf\u00e9"),
    ],
    ids=["utf8", "utf8-bom", "cp1252-fallback", "utf16-bom"],
)
def test_text_encodings(raw, text):
    assert load_document_bytes(raw, "a.txt").text == text


# --------------------------------------------------------------------------- PDFs


def test_pdf_round_trip_with_pages(tmp_path):
    raw = make_text_pdf(PAGES)
    path = tmp_path / "book.PDF"
    path.write_bytes(raw)
    doc = load_document(path)
    assert (doc.kind, doc.pages, doc.name) == ("pdf", 3, "book.PDF")
    assert doc.text == PAGE_SEPARATOR.join(PAGES)
    assert doc.sha256 == hashlib.sha256(raw).hexdigest()
    for number, (start, page) in enumerate(zip(doc.page_starts, PAGES), start=1):
        assert doc.text[start : start + len(page)] == page
        assert doc.page_of(start) == number  # first char of the page
        assert doc.page_of(start + len(page) - 1) == number  # last char of the page
    # the separator between pages counts towards the page before it
    assert doc.page_of(doc.page_starts[1] - 1) == 1
    assert doc.page_of(doc.text.index("bananas")) == 2
    assert doc.page_of(doc.text.index("cherries")) == 3
    with pytest.raises(IndexError):
        doc.page_of(len(doc.text))
    with pytest.raises(IndexError):
        doc.page_of(-1)


def test_pdf_empty_page_shares_start_with_next_page():
    doc = load_document_bytes(make_text_pdf(["", "alpha", "", "beta", ""]), "gaps.pdf")
    assert doc.text == "alpha\n\nbeta"
    assert doc.page_starts == (0, 0, 7, 7, 11)
    assert [doc.page_of(i) for i in (0, 4, 5, 6, 7, 10)] == [2, 2, 2, 2, 4, 4]


def test_pdf_long_lines_wrap_and_keep_every_word():
    words = [f"w{i}" for i in range(200)]
    doc = load_document_bytes(make_text_pdf([" ".join(words)]), "long.pdf")
    assert doc.text.split() == words
    assert max(len(line) for line in doc.text.splitlines()) <= 90


def test_an_aes_encrypted_pdf_with_an_owner_password_only_is_read():
    """AES needs pypdf's crypto extra (the `cryptography` package), a dependency of the project."""
    doc = load_document_bytes(make_encrypted_pdf("owner password only", user_password="", algorithm="AES-256"),
                              "aes.pdf")
    assert "owner password only" in doc.text


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_or_a_folder_is_refused_without_reading(tmp_path):
    """A pipe would block the read until a writer came: refused at once, as a folder is."""
    pipe = tmp_path / "fifo.txt"
    os.mkfifo(pipe)
    folder = tmp_path / "folder.pdf"
    folder.mkdir()
    for path in (pipe, folder):
        with pytest.raises(NotAFileError, match="not a regular file"):
            load_document(path)


def test_encrypted_pdf_with_empty_user_password_is_accepted():
    doc = load_document_bytes(make_encrypted_pdf("owner password only", user_password=""), "o.pdf")
    assert doc.text == "owner password only"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "data, name, error",
    [
        (b"hello", "report.docx", UnsupportedTypeError),
        (b"hello", "Makefile", UnsupportedTypeError),
        (b"", "empty.txt", EmptyDocumentError),
        (b"", "empty.pdf", EmptyDocumentError),
        (b" \n\t\r\n ", "blank.md", EmptyDocumentError),
        (b"%PDF-1.7\nthis is not really a pdf", "broken.pdf", CorruptDocumentError),
        (b"plain text renamed to pdf", "renamed.pdf", CorruptDocumentError),
        (b"abc\x00\x01\x02def" * 10, "binary.txt", CorruptDocumentError),
        (bytes(range(0x80, 0x100)), "undecodable.txt", CorruptDocumentError),
        (b"\x01\x02\x03\x04\x05 mostly control", "controls.txt", CorruptDocumentError),
        ("make_encrypted_pdf", "locked.pdf", EncryptedPDFError),
        ("make_blank_pdf", "scan.pdf", NoTextError),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_document_errors(data, name, error):
    if data == "make_encrypted_pdf":
        data = make_encrypted_pdf("top secret", user_password="secret")
    elif data == "make_blank_pdf":
        data = make_blank_pdf(pages=2)
    with pytest.raises(error) as info:
        load_document_bytes(data, name)
    message = str(info.value)
    assert isinstance(info.value, DocumentError) and isinstance(info.value, ValueError)
    assert message.startswith(f"{name}: ") and "\n" not in message
    assert info.value.filename == name


def test_error_messages_say_what_to_do():
    with pytest.raises(UnsupportedTypeError, match=r"\.docx.*supported types: \.pdf, \.txt, \.md"):
        load_document_bytes(b"x", "a.docx")
    with pytest.raises(NoTextError, match="OCR"):
        load_document_bytes(make_blank_pdf(), "scan.pdf")
    with pytest.raises(EncryptedPDFError, match="password"):
        load_document_bytes(make_encrypted_pdf("x"), "locked.pdf")


def test_unsupported_path_is_refused_before_reading(tmp_path):
    with pytest.raises(UnsupportedTypeError):
        load_document(tmp_path / "does-not-exist.docx")
    with pytest.raises(FileNotFoundError):
        load_document(tmp_path / "does-not-exist.txt")


def test_document_validates_its_fields():
    sha = "0" * 64
    with pytest.raises(ValueError, match="kind"):
        Document(name="a", kind="doc", text="x", page_starts=(0,), sha256=sha)
    with pytest.raises(ValueError, match="page_starts"):
        Document(name="a", kind="pdf", text="xy", page_starts=(0, 5), sha256=sha)
    with pytest.raises(ValueError, match="page_starts"):
        Document(name="a", kind="pdf", text="xy", page_starts=(1,), sha256=sha)
    with pytest.raises(ValueError, match="sha256"):
        Document(name="a", kind="txt", text="x", page_starts=(0,), sha256="abc")
    doc = Document(name="a", kind="pdf", text="xy", page_starts=[0, 1], sha256=sha)
    assert doc.page_starts == (0, 1)
