"""Turn an uploaded file (PDF, plain text, Markdown) into a :class:`Document`.

A :class:`Document` is plain text plus the character offset at which each PDF
page starts, so an answer can cite "page 3".  Loading never guesses silently:
anything that cannot become useful text raises a named :class:`DocumentError`
whose one-line message starts with the file name.

Policies:

* Kind comes from the file extension, case-insensitively: ``.pdf``, ``.txt``,
  ``.md`` / ``.markdown``.
* Text files: a UTF-8/16/32 byte-order mark is honoured; otherwise UTF-8 is
  tried, then Windows-1252 (which also covers Latin-1 text).  NUL bytes (with no
  UTF-16/32 BOM) or many control characters mean a binary file, i.e. corrupt.
* Encrypted PDFs are refused unless they open with the empty user password
  (an "owner password only" PDF, which every viewer opens without asking); those
  are read normally.
* Whitespace is normalised lightly: CRLF/CR become LF, trailing spaces on each
  line are dropped, runs of 3+ newlines collapse to one blank line, and the
  text is stripped.  PDF pages are normalised one by one and joined with
  :data:`PAGE_SEPARATOR`, so ``page_starts`` indexes the final text exactly.
* Page furniture is left out of a PDF's text (:func:`strip_page_furniture`): a line among the first or last
  :data:`FURNITURE_EDGE_LINES` non-empty lines of its page that recurs there on at least half of the pages with
  text, and on at least :data:`FURNITURE_MIN_PAGES` of them: the same words (a running header or footer), or
  the same words with a number that counts the pages ("Page 12 of 40", "- 12 -", a bare "12").  A number alone
  goes only when it counts the pages.  Each page is cut on its own, so the page map still places every
  remaining character on its page.  A model that reads the furniture between the pages writes it after its
  answers.
* A text file with form feeds (what ``pdftotext`` and ``man`` write between pages) has pages: one per form feed,
  cut and joined as a PDF's, its furniture left out the same way.
"""

from __future__ import annotations

import bisect
import codecs
import hashlib
import io
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePath

from pypdf import PasswordType, PdfReader
from pypdf.errors import DependencyError

KIND_BY_SUFFIX = {".pdf": "pdf", ".txt": "txt", ".md": "md", ".markdown": "md"}
KINDS = ("pdf", "txt", "md")
PAGE_SEPARATOR = "\n\n"
DOC_ID_CHARS = 16  # a document id is this many leading hex chars of its sha256

_PDF_MAGIC = b"%PDF-"
_PDF_MAGIC_WINDOW = 1024  # readers accept junk before the header within the first 1 KiB
_MAX_CONTROL_FRACTION = 0.01  # more control characters than this: binary, not text
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")  # C0 controls except \t \n \v \f \r
_LOOKS_BINARY = "it looks like a binary file, not text"
_MAX_DETAIL_CHARS = 200  # parser messages are cut to keep error messages one short line
_BOMS = (  # UTF-32 first: its little-endian BOM starts with the UTF-16 one
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_TRAILING_SPACE = re.compile(r"[ \t\f\v\u00a0]+$", re.MULTILINE)
_BLANK_RUN = re.compile(r"\n{3,}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

FURNITURE_EDGE_LINES = 3  # a page's first and last this many non-empty lines can be furniture, no others
FURNITURE_MIN_PAGES = 3  # a line is furniture when it recurs on at least this many pages ...
FURNITURE_MIN_SHARE = 0.5  # ... and on at least this share of the pages with text
FURNITURE_MAX_CHARS = 120  # a longer line is body text, however often it recurs
_DIGITS = re.compile(r"\d+")
_LETTER = re.compile(r"[^\W\d_]")


# --------------------------------------------------------------------------- errors


class DocumentError(ValueError):
    """A file cannot be turned into a document; the message starts with its name."""

    def __init__(self, filename: str, reason: str) -> None:
        self.filename = filename
        self.reason = reason
        super().__init__(f"{filename}: {reason}")


class NotAFileError(DocumentError):
    """The path names a folder, a named pipe, a socket or a device, not a regular file."""

    def __init__(self, filename: str) -> None:
        super().__init__(filename, "not a regular file (a folder, pipe, socket or device); give a file's path")


class UnsupportedTypeError(DocumentError):
    """The extension is not one of :data:`KIND_BY_SUFFIX`."""

    def __init__(self, filename: str) -> None:
        suffix = PurePath(filename).suffix or "(no extension)"
        supported = ", ".join(KIND_BY_SUFFIX)
        super().__init__(filename, f"unsupported file type {suffix}; supported types: {supported}")


class EmptyDocumentError(DocumentError):
    """The file has no bytes, only whitespace, or (a PDF) no pages."""

    def __init__(self, filename: str, reason: str = "the file is empty") -> None:
        super().__init__(filename, reason)


class CorruptDocumentError(DocumentError):
    """The bytes cannot be parsed as the kind the extension claims."""


class EncryptedPDFError(DocumentError):
    """The PDF needs a password to open."""

    def __init__(self, filename: str, detail: str = "") -> None:
        reason = "the PDF is encrypted with a password; remove the password and upload it again"
        super().__init__(filename, f"{reason} ({detail})" if detail else reason)


class NoTextError(DocumentError):
    """The PDF has pages but none yields extractable text (e.g. a scan)."""

    def __init__(self, filename: str, pages: int) -> None:
        super().__init__(
            filename,
            f"none of its {pages} page(s) has extractable text (scanned images?);"
            " run OCR on it first (e.g. ocrmypdf) and upload the result",
        )


# --------------------------------------------------------------------------- document


@dataclass(frozen=True)
class Document:
    """Extracted text of one file.

    ``page_starts[i]`` is the offset in ``text`` where page ``i + 1`` begins;
    it is ``(0,)`` for text files.  A page with no text shares its start with
    the next page that has some.  ``sha256`` is over the raw file bytes, so the
    same upload always gets the same :attr:`doc_id`.
    """

    name: str
    kind: str  # "pdf" | "txt" | "md"
    text: str
    page_starts: tuple[int, ...]
    sha256: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "page_starts", tuple(int(s) for s in self.page_starts))
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        starts = self.page_starts
        if not starts or starts[0] != 0:
            raise ValueError(f"page_starts must begin with 0, got {starts[:3]!r}")
        if any(b < a for a, b in zip(starts, starts[1:])) or starts[-1] > len(self.text):
            raise ValueError("page_starts must be non-decreasing offsets into text")
        if not _SHA256_HEX.fullmatch(self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex chars, got {self.sha256!r}")

    @property
    def pages(self) -> int:
        """Number of pages (1 for text files)."""
        return len(self.page_starts)

    @property
    def doc_id(self) -> str:
        """The store's id for this document: the first 16 hex chars of ``sha256``."""
        return self.sha256[:DOC_ID_CHARS]

    def page_of(self, char_offset: int) -> int:
        """1-based page number of the character at ``char_offset`` (0 <= offset < len(text)).

        Separators between pages count towards the page before them.
        """
        if not 0 <= char_offset < len(self.text):
            raise IndexError(f"char offset {char_offset} outside text of length {len(self.text)}")
        return bisect.bisect_right(self.page_starts, char_offset)


# --------------------------------------------------------------------------- loading


def document_kind(filename: str | Path) -> str:
    """``"pdf"``, ``"txt"`` or ``"md"`` from the extension, else :class:`UnsupportedTypeError`."""
    name = PurePath(filename).name
    kind = KIND_BY_SUFFIX.get(PurePath(name).suffix.lower())
    if kind is None:
        raise UnsupportedTypeError(name)
    return kind


def load_document(path: str | Path) -> Document:
    """Load a file from disk (its type is checked before reading, and that it is a regular file: a named pipe would
    block the read, a device never end it; OSErrors propagate)."""
    return read_document(path)[0]


def read_document(path: str | Path) -> tuple[Document, bytes]:
    """`load_document`, and the file's bytes it read (a PDF's are kept beside it: Documents.add's source)."""
    path = Path(path)
    document_kind(path)
    if path.exists() and not path.is_file():
        raise NotAFileError(path.name)
    data = path.read_bytes()
    return load_document_bytes(data, path.name), data


MAX_NAME = 200  # characters of a document's name kept (its extension always)


def safe_name(name: str) -> str:
    """An uploaded file's name as a label: its last component whether the sender used / or \\ as separators,
    control characters and undecodable bytes replaced, at most MAX_NAME characters (the extension kept). The name
    is only ever a label: stored files are named by content hashes."""
    name = re.split(r"[\\/]", str(name))[-1]
    name = "".join("\ufffd" if (ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF) else c for c in name)
    if len(name) > MAX_NAME:
        suffix = PurePath(name).suffix[:16]
        name = name[:MAX_NAME - len(suffix) - 1] + "\u2026" + suffix
    return name.strip() or "unnamed"


def load_document_bytes(data: bytes, name: str, progress: Callable[[int, int], None] | None = None) -> Document:
    """Build a :class:`Document` from raw file bytes; ``name`` gives the kind and the label (safe_name). progress:
    told (pages read, pages) after each page of a PDF (what it raises stops the reading), or None."""
    name = safe_name(name)
    kind = document_kind(name)
    if not data.strip():
        reason = "the file holds only whitespace" if data else "the file is empty"
        raise EmptyDocumentError(name, reason)
    if kind == "pdf":
        text, starts = _join_pages(strip_page_furniture([_normalise(p) for p in _pdf_page_texts(data, name,
                                                                                                  progress)]))
        if not text:
            raise NoTextError(name, len(starts))
    else:
        pages = _decode_text(data, name).split("\f")  # form feeds: the pages of a paged document's text export
        if len(pages) > 1:
            text, starts = _join_pages(strip_page_furniture([_normalise(p) for p in pages]))
        else:
            text, starts = _normalise(pages[0]), (0,)
        if not text:
            raise EmptyDocumentError(name, "the file holds only whitespace")
    return Document(name=name, kind=kind, text=text, page_starts=starts,
                    sha256=hashlib.sha256(data).hexdigest())


def _normalise(text: str) -> str:
    """Light whitespace clean-up; see the module docstring."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    text = _TRAILING_SPACE.sub("", text)
    return _BLANK_RUN.sub("\n\n", text).strip()


def _join_pages(pages: list[str]) -> tuple[str, tuple[int, ...]]:
    """Join normalised page texts with :data:`PAGE_SEPARATOR`, recording where each starts.

    Empty pages add no separator; they start where the next non-empty page
    starts (or at the end of the text when none follows).
    """
    parts: list[str] = []
    starts: list[int] = []
    waiting = 0  # empty pages whose start is the next non-empty page's start
    pos = 0
    for page in pages:
        if not page:
            waiting += 1
            continue
        if parts:
            parts.append(PAGE_SEPARATOR)
            pos += len(PAGE_SEPARATOR)
        starts.extend([pos] * (waiting + 1))
        waiting = 0
        parts.append(page)
        pos += len(page)
    starts.extend([pos] * waiting)
    return "".join(parts), tuple(starts)


def page_texts(text: str, page_starts: Sequence[int]) -> list[str]:
    """The normalised text of each page of a document's ``text`` (as :func:`_join_pages` joined them; an empty
    page's is ``""``), from its page map: len(page_starts) strings."""
    ends = (*page_starts[1:], len(text))
    return [text[start:end].strip() for start, end in zip(page_starts, ends)]


def without_furniture(doc: Document) -> Document:
    """``doc`` with its pages' furniture left out (:func:`strip_page_furniture`) and its page map made again for the
    text that remains; a text file's document as it is (it has no pages)."""
    if doc.kind != "pdf":
        return doc
    text, starts = _join_pages(strip_page_furniture(page_texts(doc.text, doc.page_starts)))
    return replace(doc, text=text, page_starts=starts)


def strip_page_furniture(pages: list[str]) -> list[str]:
    """Normalised page texts without their page furniture (the module docstring says which lines are), each
    normalised again: len(pages) strings. The pages come back as they are when fewer than
    :data:`FURNITURE_MIN_PAGES` have text, or when no text would be left."""
    filled = sum(1 for page in pages if page)
    if filled < FURNITURE_MIN_PAGES:
        return list(pages)
    need = max(FURNITURE_MIN_PAGES, math.ceil(FURNITURE_MIN_SHARE * filled))
    cut = _furniture(_edge_lines(pages), need)
    if not cut:
        return list(pages)
    out = []
    for p, page in enumerate(pages):
        kept = (line for i, line in enumerate(page.split("\n")) if (p, i) not in cut)
        out.append(_normalise("\n".join(kept)))
    return out if any(out) else list(pages)


@dataclass(frozen=True)
class _EdgeLine:
    """One of the first or last :data:`FURNITURE_EDGE_LINES` non-empty lines of a page."""

    page: int  # index of its page in the document
    line: int  # index of the line among its page's lines
    side: str  # "top" | "bottom"
    text: str  # the line with its whitespace collapsed


def _edge_lines(pages: list[str]) -> list[_EdgeLine]:
    """The lines of every page that may be furniture: its first and last few non-empty ones, short enough."""
    out = []
    for p, page in enumerate(pages):
        lines = page.split("\n")
        filled = [i for i, line in enumerate(lines) if line.strip()]
        for side, picked in (("top", filled[:FURNITURE_EDGE_LINES]), ("bottom", filled[-FURNITURE_EDGE_LINES:])):
            for i in picked:
                text = " ".join(lines[i].split())
                if len(text) <= FURNITURE_MAX_CHARS:
                    out.append(_EdgeLine(p, i, side, text))
    return out


def _furniture(edges: list[_EdgeLine], need: int) -> set[tuple[int, int]]:
    """(page, line) of each edge line that is furniture: one with words that recurs unchanged on the same side of
    at least ``need`` pages, or one whose shape (its numbers as ``#``) recurs there and whose number counts the
    pages (:func:`_page_numbered`)."""
    same: dict[tuple[str, str], list[_EdgeLine]] = defaultdict(list)  # (side, text) -> its lines
    shaped: dict[tuple[str, str], list[_EdgeLine]] = defaultdict(list)  # (side, shape) -> its lines
    for edge in edges:
        if _LETTER.search(edge.text):
            same[(edge.side, edge.text)].append(edge)
        if _DIGITS.search(edge.text):
            shaped[(edge.side, _DIGITS.sub("#", edge.text))].append(edge)
    found = {(e.page, e.line) for group in same.values() if len({e.page for e in group}) >= need for e in group}
    for group in shaped.values():
        if len({e.page for e in group}) >= need:
            found |= _page_numbered(group, need)
    return found


def _page_numbered(group: list[_EdgeLine], need: int) -> set[tuple[int, int]]:
    """(page, line) of the lines of one shape whose number at one place counts the pages: that number minus its
    page's index is the same on at least ``need`` pages (only those lines; none when no place does)."""
    numbers = [[int(n) for n in _DIGITS.findall(edge.text)] for edge in group]
    for place in range(len(numbers[0])):
        offsets = [found[place] - edge.page for found, edge in zip(numbers, group)]
        pages = Counter(offset for offset, _ in {(o, e.page) for o, e in zip(offsets, group)})
        offset, count = pages.most_common(1)[0]
        if count >= need:
            return {(edge.page, edge.line) for edge, o in zip(group, offsets) if o == offset}
    return set()


def _one_line(exc: BaseException) -> str:
    detail = " ".join(str(exc).split()) or type(exc).__name__
    if len(detail) > _MAX_DETAIL_CHARS:
        detail = detail[: _MAX_DETAIL_CHARS - 1] + "…"
    return detail


def _pdf_page_texts(data: bytes, name: str, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Extract the raw text of every page with pypdf, telling `progress` (pages read, pages) after each."""
    if _PDF_MAGIC not in data[:_PDF_MAGIC_WINDOW]:
        raise CorruptDocumentError(name, "not a PDF file (no %PDF header)")
    try:
        reader = PdfReader(io.BytesIO(data))  # tries the empty password by itself
        if reader.is_encrypted and reader.decrypt("") == PasswordType.NOT_DECRYPTED:
            raise EncryptedPDFError(name)
        pages = list(reader.pages)
    except DocumentError:
        raise
    except DependencyError as exc:  # e.g. AES without the `cryptography` package
        raise EncryptedPDFError(name, _one_line(exc)) from exc
    except Exception as exc:  # pypdf raises many types on malformed input
        raise CorruptDocumentError(name, f"pypdf cannot parse it: {_one_line(exc)}") from exc
    if not pages:
        raise EmptyDocumentError(name, "the PDF has no pages")
    texts = []
    for number, page in enumerate(pages, start=1):
        try:
            texts.append(page.extract_text() or "")
        except Exception as exc:
            raise CorruptDocumentError(
                name, f"pypdf cannot read page {number}: {_one_line(exc)}"
            ) from exc
        if progress is not None:
            progress(number, len(pages))
    return texts


def _decode_text(data: bytes, name: str) -> str:
    """Decode a text file; see the module docstring for the order of encodings."""
    text = None
    for bom, codec in _BOMS:
        if data.startswith(bom):
            try:
                text = data.decode(codec)
            except UnicodeDecodeError as exc:
                reason = f"invalid {codec.upper()} text: {_one_line(exc)}"
                raise CorruptDocumentError(name, reason) from exc
            break
    if text is None:
        if b"\x00" in data:
            raise CorruptDocumentError(name, f"contains NUL bytes; {_LOOKS_BINARY}")
        for codec in ("utf-8-sig", "cp1252"):
            try:
                text = data.decode(codec)
                break
            except UnicodeDecodeError:
                continue
        else:
            raise CorruptDocumentError(name, "is neither UTF-8 nor Windows-1252 text")
    controls = len(_CONTROL_CHARS.findall(text))
    if controls > _MAX_CONTROL_FRACTION * len(text):
        raise CorruptDocumentError(name, f"contains control characters; {_LOOKS_BINARY}")
    return text
