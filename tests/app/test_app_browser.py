"""End to end in a real browser (Debian's chromium driven by Playwright) on the embedded model: upload the shipped
passkey PDF, watch it being prepared, ask for the passkey, and see the answer, the kept-fraction heatmap, the
highlighted passage and the key projection; then a follow-up that only the first turn explains. Screenshots are
kept under the test's temporary directory (their paths are printed). And a first question with a method that must
learn once per model (duo's gates, trained in seconds here) shows the training in the chat until the answer comes.

assets/passkey.pdf is assets/passkey.md set as six pages with tests/support/pdfs.py (the passkey is on page 4).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from app.config import AppConfig
from app.demo import build_demo, launch_kwargs
from engine.bench.passkey import PASSKEY_QUESTION
from engine.serve.service import Engine
from tests.support.browser import needs_chromium
from tests.support.serving import serve_locally

PDF = Path(__file__).resolve().parents[2] / "assets" / "passkey.pdf"
KEY = "48213"
FOLLOW_UP = "Repeat that number."
PREPARE_MS = 600_000  # a ~4K-token ingest: ~15 s on 2 idle cores, minutes on a busy machine
ANSWER_MS = 300_000

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword is deprecated).*"),
    needs_chromium,
]


def serving(engine: Engine, config: AppConfig):
    """The app over `engine` served on a free local port while the generator is open: (URL, demo)."""
    demo = build_demo(engine, engine.store, config=config)
    yield serve_locally(demo, **launch_kwargs(config)), demo
    demo.close()
    demo.services.worker.close()


@pytest.fixture(scope="module")
def served(real_lm, tmp_path_factory):
    yield from serving(Engine(tmp_path_factory.mktemp("cache"), lm=real_lm), AppConfig(max_new_tokens=16))


@pytest.fixture
def viewport() -> dict:
    return {"width": 1500, "height": 1100}


def test_upload_prepare_ask_and_see_what_attention_retrieved(served, page, tmp_path_factory):
    from playwright.sync_api import expect

    url, demo = served
    shots = tmp_path_factory.mktemp("screenshots")
    timings = {}
    page.goto(url)
    page.locator("#sq-upload input[type=file]").set_input_files(str(PDF))
    # the file list shows the name's stem and extension in separate elements: "passkey .pdf" or "passkey.pdf"
    name = re.compile(re.escape(PDF.stem) + r"\s*" + re.escape(PDF.suffix))
    expect(page.locator("#sq-upload")).to_contain_text(name, timeout=60_000)
    # the name shows while the file is still on its way; its download link (with its size) once the server has it
    expect(page.locator("#sq-upload td.download a").first).to_be_visible(timeout=60_000)
    started = time.perf_counter()
    page.click("#sq-prepare")

    # The Chat tab opens on the document and shows its preparation: a progress bar, the stage, the time left.
    status = page.locator("#sq-doc-status")
    expect(status.locator(".sq-bar")).to_be_visible(timeout=60_000)
    expect(status).to_contain_text(re.compile(r"loading model|extracting|tokenizing|prefill|clustering|calibrating"))
    page.screenshot(path=shots / "preparing.png", full_page=True)
    page.reload()  # leaving and coming back: the document opens again, with its job where it is
    expect(page.locator("#sq-doc-status")).to_contain_text(
        re.compile(r"(extracting|tokenizing|prefill|clustering|calibrating|saving).*left|ready"), timeout=60_000)
    expect(status).to_contain_text(f"{PDF.name}: ready", timeout=PREPARE_MS)
    timings["prepare_s"] = time.perf_counter() - started

    page.locator("#sq-question textarea").fill(PASSKEY_QUESTION)
    started = time.perf_counter()
    page.click("#sq-ask")
    chat = page.locator("#sq-chatbot")
    expect(chat).to_contain_text(KEY, timeout=ANSWER_MS)
    timings["answer_visible_s"] = time.perf_counter() - started
    # The views appear when the turn is done: 3 global layers x 4 query heads, for the prefill and the answer, in an
    # interactive (plotly) figure whose hover tells each cell's layer, head, kept share and keys.
    heatmap = page.locator("#sq-view-heatmap .js-plotly-plot")
    page.wait_for_function("() => { const el = document.querySelector('#sq-view-heatmap .js-plotly-plot');"
                           " return el && el.data && el.data.some(t => t.type === 'heatmap'); }", timeout=ANSWER_MS)
    cells = heatmap.evaluate("el => el.data.filter(t => t.type === 'heatmap').map(t => t.z.length * t.z[0].length)")
    assert cells == [12, 12], cells
    passages = page.locator("#sq-passages li.sq-passage")
    expect(passages.first).to_be_visible()
    assert passages.locator("mark.sq-hit").count() > 0
    with_key = passages.filter(has_text=KEY)
    expect(with_key.first).to_contain_text("p. 4")  # the passkey's page
    # the answer's sentence with the passkey cites page 4; the citation opens the whole document at that passage
    cited = page.locator("#sq-view-answer sup.sq-cite a.sq-goto", has_text="p. 4")
    expect(cited.first).to_be_visible()
    cited.first.click()
    expect(page.locator("#sq-view-document .sq-doc")).to_be_visible()
    expect(page.locator("#sq-view-document .sq-flash")).to_have_count(1)  # the passage it lands on, marked
    expect(page.locator("#sq-view-document mark.sq-cited.sq-current").first).to_be_visible()
    expect(page.locator("#sq-budget")).to_contain_text("KV budget")
    projection = page.locator("#sq-view-projection .js-plotly-plot")
    expect(projection).to_be_visible()
    assert "keys of retrieved clusters" in projection.evaluate("el => el.data.map(t => t.name)")
    final = shots / "answered.png"
    page.screenshot(path=final, full_page=True)

    # A follow-up that only the first turn explains ("that number": without the chat, the model answers "100.")
    page.locator("#sq-question textarea").fill(FOLLOW_UP)
    page.click("#sq-ask")
    expect(chat).to_contain_text(FOLLOW_UP, timeout=ANSWER_MS)
    store = demo.services.store
    chat_id = store.chats.list(store.documents.list()[0]["id"])[0]["id"]
    deadline = time.monotonic() + ANSWER_MS / 1000
    while len(store.chats.turns(chat_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    expect(chat).to_contain_text(re.compile(re.escape(KEY) + r"[\s\S]*" + re.escape(FOLLOW_UP) + r"[\s\S]*"
                                            + re.escape(KEY)), timeout=ANSWER_MS)  # the answer, again

    turns = demo.services.store.chats.turns(demo.services.store.chats.list(
        demo.services.store.documents.list()[0]["id"])[0]["id"])
    assert [t["question"] for t in turns] == [PASSKEY_QUESTION, FOLLOW_UP] and KEY in turns[1]["answer"]
    assert turns[1]["stats"]["extra"]["history"] == 1
    turn = turns[0]
    t = turn["stats"]["timings"]
    print(f"\nscreenshots: {shots / 'preparing.png'} {final}")
    print(f"prepare {timings['prepare_s']:.1f} s (in the browser), "
          f"answer visible after {timings['answer_visible_s']:.1f} s; "
          f"first token {t['first_token_s']:.2f} s, {t['tokens_per_s']:.1f} tokens/s, KV budget "
          f"{turn['stats']['kv_budget']:.3f}; answer {turn['answer']!r}")
    keep = os.environ.get("SQUEEZE_SCREENSHOT_DIR")
    if keep:  # CI can collect them from a known place
        Path(keep).mkdir(parents=True, exist_ok=True)
        for shot in shots.iterdir():
            shutil.copy(shot, Path(keep) / shot.name)


def test_quest_answers_the_shipped_passkey_at_90_percent_in_the_app(served):
    """Quest, picked in the app at 90% sparsity (a 10% KV budget, its page bounds included), answers
    the shipped passkey PDF, through the app's own handlers (gradio_client). The first test uploads it; here it is
    uploaded again where that test did not run (the store keeps one copy)."""
    from gradio_client import Client

    from tests.app.test_app import ask, open_doc, upload

    url, demo = served
    store, worker = demo.services.store, demo.services.worker
    client = Client(url, verbose=False)
    if not any(d["name"] == PDF.name for d in store.documents.list()):
        upload(client, str(PDF))
    assert worker.wait_idle(PREPARE_MS / 1000)
    open_doc(client, store.documents.find(PDF.name)["id"])
    answer, _ = ask(client, PASSKEY_QUESTION, method="quest", sparsity=0.9)
    said = answer["chat"][-1]["content"]
    said = said[0]["text"] if isinstance(said, list) else said
    assert KEY in said, said
    assert "<b>quest</b> at 90% sparsity" in answer["budget"]


# duo's gates trained in seconds (the defaults take ~17 min on 2 cores): what the test watches is the wait, not them
QUICK_DUO = dict(train_steps=6, train_min_tokens=256, train_max_tokens=320, train_sink=16, train_recent=32,
                 train_passkeys=1, train_words=4)
MARKDOWN = PDF.with_suffix(".md")


@pytest.fixture
def served_untrained(real_lm, tmp_path_factory):
    """The app over a fresh cache where assets/passkey.md is prepared and duo has never been trained."""
    engine = Engine(tmp_path_factory.mktemp("cache-untrained"), lm=real_lm, methods={"duo": QUICK_DUO})
    engine.ingest(str(MARKDOWN))
    yield from serving(engine, AppConfig(max_new_tokens=8))


def test_a_first_question_with_a_method_that_trains_says_so_in_the_chat(served_untrained, page):
    """Choosing duo, which learns its gates once per model, says so before the question; the first question then
    shows, where its answer will be, that duo is training and how far, and the answer replaces it; a reload brings
    the document and the method back (kept in the browser)."""
    from playwright.sync_api import expect

    url, demo = served_untrained
    page.goto(url)
    page.locator("#sq-library-select input").click()  # the library: pick the document, open it on the Chat tab
    page.get_by_role("option", name=re.compile(re.escape(MARKDOWN.name))).click()
    page.click("#sq-open")
    expect(page.locator("#sq-doc-status")).to_contain_text(f"{MARKDOWN.name}: ready", timeout=60_000)
    page.locator("#sq-method").get_by_text("duo", exact=True).click()
    expect(page.locator("#sq-threshold")).to_contain_text("once per model", timeout=30_000)
    page.locator("#sq-question textarea").fill(PASSKEY_QUESTION)
    page.click("#sq-ask")
    chat = page.locator("#sq-chatbot")
    expect(chat).to_contain_text("Training duo", timeout=60_000)
    expect(page.locator("#sq-cancel-wait")).to_be_visible()
    expect(chat).not_to_contain_text("Training duo", timeout=ANSWER_MS)  # the answer took its place
    store = demo.services.store
    doc_id = store.documents.find(MARKDOWN.name)["id"]

    def turns() -> list[dict]:
        return [t for c in store.chats.list(doc_id) for t in store.chats.turns(c["id"])]

    deadline = time.monotonic() + ANSWER_MS / 1000
    while not turns() and time.monotonic() < deadline:  # the answer is recorded once it is whole
        time.sleep(0.5)
    (turn,) = turns()
    assert turn["method"] == "duo" and turn["question"] == PASSKEY_QUESTION
    assert demo.services.engine.needs_preparation("duo") == []
    page.reload()  # this browser's choices come back with the page: the document, and the method it asked with
    expect(page.locator("#sq-doc-status")).to_contain_text(f"{MARKDOWN.name}: ready", timeout=60_000)
    expect(page.locator("#sq-method input[value='duo']")).to_be_checked(timeout=30_000)
