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
from storage.documents import PAGE_SEPARATOR, page_texts, strip_page_furniture, without_furniture
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


# --------------------------------------------------------------------------- page furniture

BODIES = [  # a specification's body text, one page each; its own numbers do not count the pages
    "1 Scope\nThis document specifies the frame format of the widget bus.\nA frame holds 64 bytes of payload.",
    "2 Frames\nEach frame opens with a sync word of 16 bits.\nTable 3 lists the 12 frame kinds.\n42",
    "3 Timing\nA node answers within 250 microseconds.",
    "4 Errors\nA node that misses 3 frames resets its link.\nSee clause 2 for the sync word.",
    "5 Power\nThe bus draws at most 40 mA per node.",
]
HEADER = "Widget Bus Specification, revision 2.1"


def furnished(bodies: list[str]) -> list[str]:
    """Each body with the running header above it and a footer below: the page's number, then 'Page N of M'."""
    return [f"{HEADER}\n{body}\n{n}\nPage {n} of {len(bodies)}" for n, body in enumerate(bodies, start=1)]


def test_a_pdfs_pages_are_told_as_they_are_read():
    """load_document_bytes tells its progress (pages read, pages) after each page of a PDF; what the progress raises
    stops the reading (a cancelled preparation)."""
    pdf = make_text_pdf(["First page.", "Second page.", "Third page."])
    told: list[tuple[int, int]] = []
    doc = load_document_bytes(pdf, "three.pdf", progress=lambda done, total: told.append((done, total)))
    assert told == [(1, 3), (2, 3), (3, 3)] and doc.pages == 3

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt  # stands for the worker's cancel

    with pytest.raises(KeyboardInterrupt):
        load_document_bytes(pdf, "three.pdf", progress=stop)
    told.clear()
    load_document_bytes(b"A text file is one step.", "a.txt", progress=lambda done, total: told.append((done, total)))
    assert told == []


def test_pdf_page_furniture_is_left_out_and_the_page_map_follows():
    """The running header and both footers go, the body stays whole (its own numbers included, the '42' at a
    page's foot too), and every page's start points at its body."""
    doc = load_document_bytes(make_text_pdf(furnished(BODIES)), "spec.pdf")
    assert doc.text == PAGE_SEPARATOR.join(BODIES)
    assert HEADER not in doc.text and "Page 1 of" not in doc.text
    assert doc.pages == len(BODIES)
    for number, (start, body) in enumerate(zip(doc.page_starts, BODIES), start=1):
        assert doc.text[start:start + len(body)] == body
        assert doc.page_of(start) == number and doc.page_of(start + len(body) - 1) == number
    assert doc.page_of(doc.text.index("42")) == 2


def test_a_text_file_with_form_feeds_has_pages_and_no_furniture():
    """A text export of a paged document (pages apart by form feeds, as pdftotext writes them) gets a page map and
    loses its furniture as a PDF does; a text file without form feeds stays one page, as it was."""
    data = "\f".join(furnished(BODIES)).encode()
    doc = load_document_bytes(data, "spec.txt")
    assert doc.text == PAGE_SEPARATOR.join(BODIES) and doc.pages == len(BODIES)
    for number, (start, body) in enumerate(zip(doc.page_starts, BODIES), start=1):
        assert doc.text[start:start + len(body)] == body and doc.page_of(start) == number
    plain = load_document_bytes("\n\n".join(furnished(BODIES)).encode(), "spec.md")
    assert plain.pages == 1 and HEADER in plain.text  # no pages: nothing repeats at a page's edge


def test_page_numbers_that_do_not_count_the_pages_and_short_documents_stay():
    """A bare number at the same place on every page goes only when it counts the pages; words recurring on fewer
    than half of the pages, and documents of fewer than three pages, keep everything."""
    same_number = [f"{body}\n7" for body in BODIES]  # a '7' under every page: not a page number
    assert load_document_bytes(make_text_pdf(same_number), "a.pdf").text == PAGE_SEPARATOR.join(same_number)
    rare = [f"Draft\n{body}" if i < 2 else body for i, body in enumerate(BODIES)]  # 2 of 5 pages
    assert load_document_bytes(make_text_pdf(rare), "b.pdf").text == PAGE_SEPARATOR.join(rare)
    two = furnished(BODIES[:2])
    assert load_document_bytes(make_text_pdf(two), "c.pdf").text == PAGE_SEPARATOR.join(two)
    counted = [f"{body}\n- {n + 10} -" for n, body in enumerate(BODIES)]  # numbered from 10: still counts them
    assert load_document_bytes(make_text_pdf(counted), "d.pdf").text == PAGE_SEPARATOR.join(BODIES)


def test_only_edge_lines_are_furniture_and_a_page_of_furniture_alone_is_kept():
    """A line that recurs on every page but sits deeper than the first and last three lines is body text; pages
    with nothing but furniture are kept as they are rather than emptied; an empty page counts in the numbering."""
    words = ("amber", "birch", "cedar", "dune", "elm")
    deep = [f"{body}\nRecurring note\n{w} one\n{w} two\n{w} three" for w, body in zip(words, BODIES)]
    assert strip_page_furniture(deep) == deep
    only = [f"{HEADER}\n{n}" for n in range(1, 5)]
    assert strip_page_furniture(only) == only
    numbered = [f"{HEADER}\n{body}\n{n}" for n, body in zip((1, 2, 4, 5, 6), BODIES)]
    with_gap = [*numbered[:2], "", *numbered[2:]]  # page 3 has no text
    assert strip_page_furniture(with_gap) == [*BODIES[:2], "", *BODIES[2:]]


def test_a_stored_document_is_cut_again_from_its_pages():
    """without_furniture rebuilds a PDF document from its text and page map as extraction would have made it; a
    text file has no pages and stays as it is."""
    pages = furnished(BODIES)
    old = Document(name="spec.pdf", kind="pdf", text=PAGE_SEPARATOR.join(pages),
                   page_starts=_starts(pages), sha256="0" * 64)
    assert page_texts(old.text, old.page_starts) == pages
    new = without_furniture(old)
    assert (new.text, new.page_starts) == (PAGE_SEPARATOR.join(BODIES), _starts(BODIES))
    assert new.sha256 == old.sha256 and new.name == old.name
    text = Document(name="n.txt", kind="txt", text=old.text, page_starts=(0,), sha256="0" * 64)
    assert without_furniture(text) is text


def _starts(pages: list[str]) -> tuple[int, ...]:
    out, pos = [], 0
    for page in pages:
        out.append(pos)
        pos += len(page) + len(PAGE_SEPARATOR)
    return tuple(out)


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
