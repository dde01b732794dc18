"""Each sentence of an answer cites the page of the retrieved passage that best supports it (app.citations), and the
views link every citation and passage to an anchor of the whole document's view (app.render)."""

from __future__ import annotations

import re
from html import unescape
from html.parser import HTMLParser

import pytest

from app import render
from app.citations import cite, content_words, lexical_support, sentence_spans
from engine.serve.explain import Passage

PAGES = [
    "The lighthouse stands on the northern cliff above the harbour. It was built of granite in 1852 by the harbour "
    "board, and its lamp burned whale oil until the war.",
    "Storms came often in winter. The keeper rang the bronze bell every hour during fog, and logged each ship that "
    "passed the point in a leather book.",
    "The secret passkey is 48213. Visitors may climb the tower on Sundays only, after the keeper has trimmed the "
    "wick and cleaned the great lens.",
]
TEXT = "\n\n".join(PAGES)
PAGE_STARTS = tuple(TEXT.index(p) for p in PAGES)


def passage(phrase: str, score: float) -> Passage:
    """A retrieved passage over `phrase` (a stretch of one page), on the page where it lies."""
    start = TEXT.index(phrase)
    page = sum(1 for s in PAGE_STARTS if s <= start)
    return Passage(start=start, end=start + len(phrase), page=page, score=score, marks=[(start, start + 4, 1.0)])


@pytest.fixture
def passages() -> list[Passage]:
    """Best retrieved first: page 2's, then page 3's; page 1's passage is the weakest."""
    return [passage("The keeper rang the bronze bell every hour", 5.0), passage("The secret passkey is 48213", 3.0),
            passage("built of granite in 1852", 0.5)]


def test_each_sentence_cites_the_page_its_words_come_from(passages):
    answer = ("The keeper rang a bronze bell every hour when there was fog. The passkey is 48213. "
              "I cannot say what colour the door is. It was built of granite in 1852.")
    citations = cite(TEXT, PAGE_STARTS, passages, answer)
    sentences = [answer[c.start:c.end] for c in citations]
    assert sentences == ["The keeper rang a bronze bell every hour when there was fog.", "The passkey is 48213.",
                         "I cannot say what colour the door is.", "It was built of granite in 1852."]
    assert [c.pages for c in citations] == [(2,), (3,), (), (1,)]
    assert [c.sources for c in citations] == [(0,), (1,), (), (2,)]
    assert citations[2].score == 0.0 and all(c.score > 0 for c in citations if c.sources)


def test_a_sentence_copying_the_weakest_passage_still_cites_its_page(passages):
    """Lexical support leads: page 1's passage was retrieved ten times less strongly than page 2's, yet a sentence
    made of its words cites page 1."""
    copied = "The keeper's lighthouse stands on the northern cliff above the harbour."  # "keeper": pages 2 and 3
    (citation,) = cite(TEXT, PAGE_STARTS, passages, copied)
    assert citation.pages == (1,)  # the passage's shown text reaches the page's first sentence


def test_no_passage_no_citation_and_a_few_shared_words_are_not_support(passages):
    assert cite(TEXT, PAGE_STARTS, [], "The passkey is 48213.")[0].sources == ()
    # "keeper" alone is on pages 2 and 3: one shared word out of five is not support
    (citation,) = cite(TEXT, PAGE_STARTS, passages, "My keeper painted blue fences yesterday.")
    assert citation.sources == () and citation.pages == ()
    assert cite(TEXT, PAGE_STARTS, passages, "") == []
    answer = "The passkey is 48213."
    shown = render.cited_answer_html(answer, cite(TEXT, PAGE_STARTS, [], answer), [], paged=True)
    assert "sq-cite" not in shown and "nothing to cite" in shown and answer in shown
    assert render.cited_answer_html(" \n", [], [], paged=True) == ""


def test_retrieval_breaks_a_tie_and_a_near_tie_on_another_page_is_cited_too():
    both = "the keeper"  # on page 2 and page 3
    first = passage("The keeper rang the bronze bell", 3.0)
    second = passage("after the keeper has trimmed the wick", 4.0)
    (citation,) = cite(TEXT, PAGE_STARTS, [first, second], f"Ask {both} about the wick.")
    assert citation.pages == (3,)  # only page 3 holds "wick"
    (citation,) = cite(TEXT, PAGE_STARTS, [first, second], "The keeper did.")
    assert citation.pages == (3, 2)  # equal words: the more strongly retrieved page first, the other beside it


def test_a_passage_counts_the_words_of_its_own_page_only():
    """The text shown around a passage stops at its page: words just over the page break do not support it."""
    start = PAGE_STARTS[1]
    first_words = Passage(start=start, end=start + len("Storms came often in winter."), page=2, score=1.0, marks=[])
    (citation,) = cite(TEXT, PAGE_STARTS, [first_words], "Its lamp burned whale oil until the war.")
    assert citation.sources == ()


def test_sentences_split_at_ends_and_line_breaks_not_inside_abbreviations():
    answer = "  The bell, e.g. the bronze one, rang!  \nThen fog came (twice.) Ships passed?\n\nYes"
    assert [answer[a:b] for a, b in sentence_spans(answer)] == [
        "The bell, e.g. the bronze one, rang!", "Then fog came (twice.)", "Ships passed?", "Yes"]
    assert content_words("The keeper's Bells, rang 3 times in 1852") == {"keeper", "bell", "rang", "3", "time",
                                                                          "1852"}
    assert lexical_support({"48213"}, {"passkey", "48213"}) == 1.0  # a one-word sentence: its one word suffices
    assert lexical_support({"keeper", "bell", "fog", "ship", "log"}, {"keeper"}) == 0.0


def ids_and_links(html: str) -> tuple[list[str], list[str]]:
    """The ids in `html`, and the anchors its links go to (href, without the app's click handler)."""
    return re.findall(r'\bid="([^"]+)"', html), re.findall(r'href="#([^"]+)"', html)


def targets(html: str) -> list[str]:
    """Where the app's click handler takes each link: the passage's place."""
    return re.findall(r'data-target="([^"]+)"', html)


def test_the_views_link_every_passage_and_citation_to_an_anchor_of_the_document(passages):
    answer = "The passkey is 48213. Nothing here supports this one."
    citations = cite(TEXT, PAGE_STARTS, passages, answer)
    marks = sorted(m for p in passages for m in p.marks)
    document = render.document_html(TEXT, marks, PAGE_STARTS, passages=passages)
    listed = render.passages_html(TEXT, passages)
    cited = render.cited_answer_html(answer, citations, passages, paged=True)
    ids, _ = ids_and_links(document)
    assert len(ids) == len(set(ids))
    assert {"sq-page-1", "sq-page-2", "sq-page-3"} <= set(ids)
    assert re.search(r'<div class="sq-pagebreak" id="sq-page-2">page 2</div>', document)
    for html in (listed, cited):
        _, links = ids_and_links(html)
        assert links and set(links) <= set(ids), (links, ids)
        assert set(targets(html)) <= set(ids)
    assert targets(listed) == ["sq-passage-1", "sq-passage-2", "sq-passage-3"] and targets(cited) == ["sq-passage-2"]
    assert ids_and_links(listed)[1] == ["sq-page-2", "sq-page-3", "sq-page-1"]  # best passage first
    assert re.search(r'48213\.<sup class="sq-cite">\[<a class="sq-goto" href="#sq-page-3"[^>]*>p\. 3</a>\]</sup>',
                     cited)
    assert cited.count('class="sq-cite"') == 1 and "1 of 2 sentence(s) cited" in cited
    text = re.sub(r"<sup.*?</sup>|<div class=\"sq-caption\">.*?</div>|<[^>]+>", "", cited)
    assert text == answer  # the answer itself is shown as it is


def test_a_document_without_pages_cites_the_passages_place():
    text = PAGES[1] + " " + PAGES[2]
    found = [Passage(start=text.index(p), end=text.index(p) + len(p), page=1, score=s, marks=[])
             for p, s in (("The keeper rang the bronze bell", 2.0), ("The secret passkey is 48213", 1.0))]
    answer = "The passkey is 48213."
    citations = cite(text, (0,), found, answer)
    assert citations[0].sources == (1,) and citations[0].pages == (1,)
    document = render.document_html(text, [], (0,), passages=found)
    cited = render.cited_answer_html(answer, citations, found, paged=render.is_paged((0,)))
    listed = render.passages_html(text, found, paged=False)
    ids, _ = ids_and_links(document)
    assert "sq-pagebreak" not in document and {"sq-page-1", "sq-passage-1", "sq-passage-2"} <= set(ids)
    assert ids_and_links(cited)[1] == ["sq-passage-2"] and ">passage 2</a>" in cited
    assert ids_and_links(listed)[1] == ["sq-passage-1", "sq-passage-2"] and ">p. 1</a>" in listed
    assert '<mark class="sq-cited" id="sq-passage-2" data-passage="sq-passage-2">The secret passkey' in document


def test_pages_without_text_keep_an_anchor():
    text = "First page.\n\nThird page."
    starts = (0, text.index("Third"), text.index("Third"))  # page 2 has no text: it shares page 3's start
    ids, _ = ids_and_links(render.document_html(text, [], starts))
    assert ids[1:] == ["sq-page-1", "sq-page-2", "sq-page-3"]
    assert render.document_html(text, [], starts).count('class="sq-pagebreak"') == 2


class Highlights(HTMLParser):
    """The text inside each passage's highlight (`data-passage`) pieces of a document view, joined in order, and the
    passage whose highlight carries each id."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.text: dict[str, str] = {}
        self.ids: dict[str, str] = {}
        self.open: list[str | None] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "mark" and "data-passage" in attrs:
            if "id" in attrs:
                self.ids[attrs["id"]] = attrs["data-passage"]
            self.text.setdefault(attrs["data-passage"], "")
        self.open.append(attrs.get("data-passage") if tag == "mark" else None)

    def handle_endtag(self, tag):
        self.open.pop()

    def handle_data(self, data):
        for passage in {p for p in self.open if p}:
            self.text[passage] += data


def test_a_followed_link_lands_on_the_passage_text_held_in_its_highlight():
    """The anchor each citation's and passage's link goes to is the highlight of that passage, whose pieces hold
    exactly the passage's text, however it meets page breaks, retrieved tokens and the dense tail."""
    across = TEXT.index("harbour board")  # page 1's end to page 2's start: a passage over the page break
    found = [passage("The secret passkey is 48213", 3.0),
             Passage(start=across, end=PAGE_STARTS[1] + len("Storms came"), page=1, score=2.0,
                     marks=[(across, across + 7, 1.0)]),
             passage("The keeper rang the bronze bell", 1.0)]
    marks = sorted(m for p in found for m in p.marks)
    answer = "The passkey is 48213. The keeper rang the bronze bell."
    citations = cite(TEXT, PAGE_STARTS, found, answer)
    cited = render.cited_answer_html(answer, citations, found, paged=True)
    listed = render.passages_html(TEXT, found)
    document = render.document_html(TEXT, marks, PAGE_STARTS, tail_start=TEXT.index("Visitors"), passages=found)
    shown = Highlights(document)
    assert targets(cited) == ["sq-passage-1", "sq-passage-3"]
    assert targets(listed) == ["sq-passage-1", "sq-passage-2", "sq-passage-3"]
    for rank, p in enumerate(found, 1):
        anchor = render.passage_anchor(rank)
        assert shown.ids[anchor] == anchor  # the link's target is the passage's highlight ...
        assert shown.text[anchor] == TEXT[p.start:p.end]  # ... which holds the passage's text, nothing else
    assert document.count(f'id="{render.passage_anchor(2)}"') == 1  # one anchor, though split by the page break
    plain = re.sub(r'<div class="sq-pagebreak"[^>]*>page \d</div>|<[^>]+>', "", document)
    assert unescape(plain) == TEXT  # the document's text, whole and in order


def test_a_pdfs_citations_and_passages_link_to_their_pages_of_the_pdf(passages):
    """Beside each "p. N" of a PDF, "PDF p. N" opens the kept file at page N in a new tab; a document without a
    kept PDF (pdf=None), or without pages, gets no such link."""
    pdf = render.pdf_url("/cache/blobs/documents/0123456789abcdef.a1b2c3.pdf")
    assert pdf == "gradio_api/file=/cache/blobs/documents/0123456789abcdef.a1b2c3.pdf"
    answer = "The passkey is 48213. The keeper rang the bronze bell every hour."
    citations = cite(TEXT, PAGE_STARTS, passages, answer)
    cited = render.cited_answer_html(answer, citations, passages, paged=True, pdf=pdf)
    listed = render.passages_html(TEXT, passages, pdf=pdf)
    opens = r'<a class="sq-pdf" href="([^"]+)#page=(\d+)" target="_blank" rel="noopener"[^>]*>PDF p\. (\d+)</a>'
    for html, pages in ((cited, [p for c in citations for p in c.pages]), (listed, [p.page for p in passages])):
        links = re.findall(opens, html)
        assert [(href, int(at), int(shown)) for href, at, shown in links] == [(pdf, p, p) for p in pages]
    assert [p.page for p in passages] == [2, 3, 1] and [p for c in citations for p in c.pages] == [3, 2]
    assert re.search(r'>p\. 3</a> · <a class="sq-pdf" href="[^"]+#page=3"', cited)  # beside its page's link
    for html in (render.cited_answer_html(answer, citations, passages, paged=True),
                 render.passages_html(TEXT, passages),
                 render.cited_answer_html(answer, citations, passages, paged=False, pdf=pdf),
                 render.passages_html(TEXT, passages, paged=False, pdf=pdf)):
        assert "sq-goto" in html and "sq-pdf" not in html and "PDF p." not in html
