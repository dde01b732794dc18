"""Build small, real PDF files in memory (only pypdf needed).

Used by the tests, and usable by a script that wants a sample PDF for the app::

    python tests/support/pdfs.py sample.pdf notes.txt   # pages split on form feeds (\\f)

The text is drawn in the standard Helvetica font (WinAnsi encoding), one
``BT /F1 size Tf x y Td (line) Tj ET`` block per line, so pypdf's
``extract_text()`` returns the lines back.  Characters outside Windows-1252
become ``?``.
"""

from __future__ import annotations

import io
import sys
import textwrap
from pathlib import Path

from pypdf import PdfWriter
from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject

PAGE_WIDTH, PAGE_HEIGHT = 612, 792  # US Letter, in points
MARGIN = 72  # one inch
FONT_SIZE = 10
LEADING = 12  # points between baselines
WRAP_CHARS = 90  # Helvetica 10pt fits about 90 average characters in 6.5 inches


def make_text_pdf(pages: list[str], *, title: str | None = None) -> bytes:
    """A PDF with one page per string; long lines wrap at about 90 characters.

    A page that overflows simply runs past the bottom margin (its text is
    still extractable); split long text into more pages if it must look right.
    """
    writer = PdfWriter()
    font = _helvetica()
    for text in pages:
        page = writer.add_blank_page(PAGE_WIDTH, PAGE_HEIGHT)
        page[NameObject("/Resources")] = DictionaryObject(
            {NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})}
        )
        stream = DecodedStreamObject()
        stream.set_data(_content_stream(text))
        page.replace_contents(stream)
    if title:
        writer.add_metadata({"/Title": title})
    return _to_bytes(writer)


def make_encrypted_pdf(
    text: str, *, user_password: str = "secret", owner_password: str = "owner", algorithm: str | None = None
) -> bytes:
    """A one-page text PDF encrypted with ``user_password`` (``""``: opens without one), by pypdf's default
    algorithm or ``algorithm`` (e.g. "AES-256", which needs the `cryptography` package)."""
    writer = PdfWriter(clone_from=io.BytesIO(make_text_pdf([text])))
    writer.encrypt(user_password=user_password, owner_password=owner_password, algorithm=algorithm)
    return _to_bytes(writer)


def make_blank_pdf(pages: int = 1) -> bytes:
    """A PDF whose pages draw nothing, so no text can be extracted (like a scan)."""
    writer = PdfWriter()
    for _ in range(pages):
        writer.add_blank_page(PAGE_WIDTH, PAGE_HEIGHT)
    return _to_bytes(writer)


def _helvetica() -> DictionaryObject:
    return DictionaryObject(
        {
            NameObject("/Type"): NameObject("/Font"),
            NameObject("/Subtype"): NameObject("/Type1"),
            NameObject("/BaseFont"): NameObject("/Helvetica"),
            NameObject("/Encoding"): NameObject("/WinAnsiEncoding"),
        }
    )


def _wrap(text: str) -> list[str]:
    lines: list[str] = []
    for paragraph in text.splitlines() or [""]:
        lines.extend(textwrap.wrap(paragraph, WRAP_CHARS, break_long_words=True) or [""])
    return lines


def _escape(line: str) -> bytes:
    raw = line.encode("cp1252", errors="replace")
    return raw.replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)")


def _content_stream(text: str) -> bytes:
    ops = []
    y = PAGE_HEIGHT - MARGIN
    for line in _wrap(text):
        if line:
            ops.append(b"BT /F1 %d Tf %d %d Td (%s) Tj ET" % (FONT_SIZE, MARGIN, y, _escape(line)))
        y -= LEADING
    return b"\n".join(ops)


def _to_bytes(writer: PdfWriter) -> bytes:
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def main(argv: list[str]) -> int:
    """``pdfs.py OUT.pdf [TEXT_FILE]``: write TEXT_FILE (or stdin) as a PDF, pages split on \\f."""
    if not 1 <= len(argv) <= 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    text = Path(argv[1]).read_text(encoding="utf-8") if len(argv) == 2 else sys.stdin.read()
    out = Path(argv[0])
    out.write_bytes(make_text_pdf(text.split("\f"), title=out.stem))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
