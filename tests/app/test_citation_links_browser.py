"""In a real browser (Debian's chromium driven by Playwright), without a model: the views beside the chat (app.views)
filled with a three-page document, its passages and a cited answer. A click on a citation or on a passage's page
opens the closed "Whole document" accordion, scrolls the document to the passage and keeps its text highlighted."""

from __future__ import annotations

import re

import gradio as gr
import pytest

from app import render
from app.citations import cite
from app.demo import CSS_PATH
from app.views import DOCUMENT_BOX, TurnViews
from engine.serve.explain import Passage
from tests.support.browser import needs_chromium
from tests.support.serving import serve_locally

LOAD_MS = 60_000  # the page loads and fills its views: seconds on a busy 2-core machine

FILLER = "The tide came in and went out again over the grey stones of the bay. " * 12
PAGES = [f"The lighthouse was built of granite in 1852. {FILLER}",
         f"{FILLER}The keeper rang the bronze bell every hour during fog. {FILLER}",
         f"{FILLER}{FILLER}The secret passkey is 48213. {FILLER}"]
TEXT = "\n\n".join(PAGES)
ANSWER = "The passkey is 48213. The keeper rang the bronze bell in fog."

pytestmark = needs_chromium


def found(starts: tuple[int, ...]) -> list[Passage]:
    """The passages over the answer's facts, best first (page 3's, then page 2's)."""
    out = []
    for phrase, score in (("The secret passkey is 48213", 2.0), ("The keeper rang the bronze bell", 1.0)):
        start = TEXT.index(phrase)
        out.append(Passage(start=start, end=start + len(phrase), page=sum(1 for s in starts if s <= start),
                           score=score, marks=[(start, start + len(phrase), 1.0)]))
    return out


def views_html(paged: bool) -> list[str]:
    """The cited answer, the passages and the whole document, as TurnViews.show renders them."""
    starts = tuple(TEXT.index(p) for p in PAGES) if paged else (0,)
    passages = found(starts)
    marks = sorted(m for p in passages for m in p.marks)
    return [render.cited_answer_html(ANSWER, cite(TEXT, starts, passages, ANSWER), passages, paged),
            render.passages_html(TEXT, passages, paged=paged),
            render.document_html(TEXT, marks, starts, passages=passages)]


@pytest.fixture(scope="module", params=[True, False], ids=["pages", "one-page"])
def served(request):
    with gr.Blocks() as demo:
        views = TurnViews(services=None)
        views.render()
        demo.load(lambda: views_html(request.param), None, [views.answer, views.passages, views.document])
    yield serve_locally(demo, css_paths=[CSS_PATH]), request.param
    demo.close()


def in_view(page, selector: str) -> bool:
    """Whether the element is shown inside its scrolled box (the document view) and inside the window."""
    return page.evaluate("""(selector) => {
        const el = document.querySelector(selector);
        if (el.offsetParent === null) return false;
        const r = el.getBoundingClientRect();
        let box = el.parentElement;
        while (box && !(box.scrollHeight > box.clientHeight && /(auto|scroll)/.test(getComputedStyle(box).overflowY)))
            box = box.parentElement;
        const b = box ? box.getBoundingClientRect() : {top: 0, bottom: window.innerHeight};
        return r.top >= b.top - 1 && r.bottom <= b.bottom + 1 && r.top >= 0 && r.bottom <= window.innerHeight;
    }""", selector)


def highlighted(page, anchor: str) -> bool:
    """Whether every piece of a passage's text in the document view is drawn highlighted: marked as the followed
    passage, with a visible outline and background."""
    return page.evaluate("""(anchor) => {
        const pieces = [...document.querySelectorAll(`#sq-view-document [data-passage="${anchor}"]`)];
        return pieces.length > 0 && pieces.every((el) => {
            const style = getComputedStyle(el);
            return el.classList.contains("sq-current") && style.outlineStyle !== "none"
                && style.backgroundColor !== "rgba(0, 0, 0, 0)";
        });
    }""", anchor)


def test_a_citation_opens_the_document_at_its_passage_highlighted(served, page, tmp_path):
    from playwright.sync_api import expect

    url, paged = served
    page.goto(url)
    answer = page.locator("#sq-view-answer .sq-answer")
    expect(answer).to_contain_text("The passkey is 48213.", timeout=LOAD_MS)  # the page's load fills the views
    document = page.locator("#sq-view-document .sq-doc")
    expect(document).to_be_hidden()  # the accordion starts closed
    cites = page.locator("#sq-view-answer sup.sq-cite a.sq-goto")
    expect(cites).to_have_count(2)
    first, second = "sq-passage-1", "sq-passage-2"  # the passages on page 3 and page 2
    assert cites.first.get_attribute("href") == ("#sq-page-3" if paged else f"#{first}")
    cites.first.click()
    expect(document).to_be_visible()
    expect(page.locator(f"#{first}")).to_have_class(re.compile("sq-flash"))
    expect(page.locator(f"#{first}")).to_have_text("The secret passkey is 48213")  # the passage's own text
    page.wait_for_timeout(300)
    assert in_view(page, f"#{first}"), "the cited passage is not shown"
    assert highlighted(page, first), "the cited passage is not highlighted"
    page.screenshot(path=tmp_path / "cited.png")
    print(f"screenshot: {tmp_path / 'cited.png'}")
    # the passages' links go to the same anchors; the accordion stays open
    page.locator("#sq-view-passages a.sq-goto").nth(1).click()
    expect(page.locator(f"#{second}")).to_have_class(re.compile("sq-flash"))
    page.wait_for_timeout(2500)  # the flash is over: the highlight stays
    assert in_view(page, f"#{second}")
    assert highlighted(page, second) and not highlighted(page, first)  # only the passage followed last
    expect(page.locator(f"#{DOCUMENT_BOX} .label-wrap")).to_have_class(re.compile("open"))
