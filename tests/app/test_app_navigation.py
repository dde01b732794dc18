"""The page stays where the user put it, through the app's handlers on the tiny model: Cancel, a refused or failed
upload and a document prepared again change the library's lists only (never the open document, its status line or
the tab); Prepare opens its document on the Chat tab only when none is open there; and a reload restores the chat's
controls and the tab this browser left, a stored value that is no longer valid falling back to the default."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr
import pytest

from app.chat import CHAT_TAB, LIBRARY_TAB, new_state
from app.config import AppConfig
from app.demo import build_demo
from app.settings import ChatSettings
from engine.serve import METHODS
from engine.serve.jobs import IngestWorker
from engine.serve.service import Engine
from tests.app.test_app import DOC, WAIT_S, write

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword is deprecated).*"),
]

CONFIG = AppConfig(poll_s=0.5, max_new_tokens=16)
METHOD, SPARSITY = CONFIG.method, CONFIG.sparsity
KEEPERS = "# Keepers\n\nWalter Jago kept the light from 1851 to 1880; his daughter Ann kept it after him.\n" * 3


@pytest.fixture
def demo(tiny_lm, tmp_path):
    """The app over a cache where lighthouse.txt is prepared; its worker takes no job until a test starts it."""
    engine = Engine(tmp_path / "cache", lm=tiny_lm)
    engine.ingest(write(tmp_path / "lighthouse.txt", DOC))
    demo = build_demo(engine, worker=IngestWorker(engine, start=False), config=CONFIG)
    yield demo
    demo.services.worker.close()
    engine.store.close()


@pytest.fixture
def lighthouse(demo) -> str:
    return demo.services.store.documents.find("lighthouse.txt")["id"]


def named(components: list, values: list) -> dict:
    """A handler's outputs by component (its `_id`)."""
    assert len(components) == len(values)
    return {c._id: v for c, v in zip(components, values)}


def sets_value(update) -> bool:
    """Whether an output sets its component's value (an update of choices only, or a skip, does not)."""
    return not (isinstance(update, dict) and update.get("__type__") == "update" and "value" not in update)


def open_lighthouse(demo, lighthouse) -> dict:
    """The user opens lighthouse.txt from the library: its state (the Open button's first output)."""
    page = demo.page
    out = named([*page.chat.open_outputs, page.tabs, page.kept_tab],
                page.library.open(lighthouse, new_state(CONFIG), METHOD, SPARSITY))
    assert out[page.tabs._id].selected == CHAT_TAB and out[page.kept_tab._id] == CHAT_TAB
    return out[page.state._id]


def status_line(demo, state: dict) -> str:
    """The line above the chat as the chat's poll shows it for the session's state."""
    line, _hint, _seen = demo.page.chat.watch(state, METHOD, SPARSITY, CONFIG.centroid_ratio, CONFIG.level1_ratio,
                                              {})
    return line


def prepare(demo, state: dict, *paths: str) -> dict:
    """Prepare (the upload and the step after it that opens a document) as the page runs them: each output by
    component, the second step's included."""
    page, library = demo.page, demo.page.library
    first = named([library.message, library.files, library.to_open, *library.refresh_outputs],
                  library.upload(list(paths), False, state))
    then = named([*page.chat.open_outputs, page.tabs, page.kept_tab],
                 library.open(first[library.to_open._id], state, METHOD, SPARSITY))
    return {**first, **{k: v for k, v in then.items() if sets_value(v)}}


def event_outputs(demo, fn) -> list:
    """The components each event that runs `fn` updates."""
    found = [f.outputs for f in demo.fns.values() if f.fn == fn]
    assert found, fn
    return [c for outputs in found for c in outputs]


def test_what_happens_in_the_background_never_moves_the_page(demo):
    """The library's poll and Cancel update the library's lists only; the chat's poll updates its status line and
    plan hint only: none of them the session's state, the tab, the open document or the document kept for a
    reload. Each tab the user picks is kept for the next reload."""
    page = demo.page
    navigation = {page.state._id, page.tabs._id, page.kept_tab._id, page.last_doc._id}
    for fn in (page.library.poll, page.library.cancel, page.chat.watch):
        assert not navigation & {c._id for c in event_outputs(demo, fn)}, fn
    for fn in (page.library.poll, page.library.cancel):
        assert page.chat.status._id not in {c._id for c in event_outputs(demo, fn)}
    ticks = [f for f in demo.fns.values() if (page.timer._id, "tick") in f.targets]
    assert {f.fn for f in ticks} == {page.library.poll, page.chat.watch}
    for tab, tab_id in ((page.library_tab, LIBRARY_TAB), (page.chat_tab, CHAT_TAB)):
        (kept,) = [f for f in demo.fns.values() if (tab._id, "select") in f.targets]
        assert [c._id for c in kept.outputs] == [page.kept_tab._id] and kept.fn() == tab_id


def test_cancel_leaves_the_open_document_its_status_line_and_the_tab(demo, lighthouse, tmp_path):
    page, library = demo.page, demo.page.library
    state = open_lighthouse(demo, lighthouse)
    prepared = prepare(demo, state, write(tmp_path / "keepers.md", KEEPERS))
    keepers = demo.services.worker.views()[-1].doc_id
    # Prepare while a document is open: the new one is picked in the library, the open one stays, the tab too
    assert prepared[library.selected._id]["value"] == keepers
    assert "keepers.md is picked in the library below: Open shows it on the Chat tab." in prepared[library.message._id]
    assert prepared[library.to_open._id] is None
    assert not {page.tabs._id, page.state._id, page.last_doc._id} & set(prepared)
    assert not sets_value(prepared[page.chat.doc._id])  # its choices only

    cancelled = named([library.notice, *library.refresh_outputs], library.cancel(keepers))
    assert "Cancelling the preparation of keepers.md" in cancelled[library.notice._id]
    assert not sets_value(cancelled[library.selected._id]) and not sets_value(cancelled[page.chat.doc._id])
    demo.services.worker.start()
    assert demo.services.worker.wait_idle(WAIT_S)
    assert demo.services.worker.views()[-1].status == "cancelled"

    polled = named([*library.refresh_outputs, library.seen], library.poll(None))
    assert not sets_value(polled[library.selected._id]) and not sets_value(polled[page.chat.doc._id])
    assert ("keepers.md (cancelled)", keepers) in polled[page.chat.doc._id]["choices"]
    assert library.poll(polled[library.seen._id])[1:4] == [gr.skip()] * 3  # unchanged: not sent again
    assert "lighthouse.txt: ready" in status_line(demo, state)  # the document the dropdown shows


def test_a_refused_or_failed_upload_opens_nothing(demo, lighthouse, tmp_path):
    page, library = demo.page, demo.page.library
    empty, other = write(tmp_path / "empty.txt", ""), write(tmp_path / "notes.docx", b"PK\x03\x04")
    # no document open: the first Prepare opens its document; a refused one after it opens nothing
    assert prepare(demo, new_state(CONFIG), write(tmp_path / "keepers.md", KEEPERS))[library.to_open._id]
    refused = prepare(demo, new_state(CONFIG), empty, other)
    assert "empty.txt: the file is empty" in refused[library.message._id]
    assert refused[library.to_open._id] is None and not sets_value(refused[library.selected._id])
    assert not {page.tabs._id, page.kept_tab._id, page.state._id, page.last_doc._id} & set(refused)

    # a document open: a file that fails on the worker (not a PDF inside) leaves it, and the tab, where they are
    state = open_lighthouse(demo, lighthouse)
    failing = prepare(demo, state, write(tmp_path / "scan.pdf", b"%PDF-1.4 not a pdf at all"))
    assert failing[library.to_open._id] is None and not {page.tabs._id, page.state._id} & set(failing)
    demo.services.worker.start()
    assert demo.services.worker.wait_idle(WAIT_S)
    assert demo.services.worker.views()[-1].status == "failed"
    polled = named([*library.refresh_outputs, library.seen], library.poll(None))
    assert any(row[0] == "scan.pdf" and row[3].startswith("failed") for row in polled[library.table._id])
    assert not sets_value(polled[page.chat.doc._id])
    assert "lighthouse.txt: ready" in status_line(demo, state)


def test_preparing_a_document_again_leaves_the_open_one(demo, lighthouse, tmp_path):
    """A document whose preparation was cancelled, uploaded again while another is open: it is prepared anew and
    picked in the library; the open document, its status line and the tab stay. A new centroid ratio re-indexes
    the open document in the background and its status line stays on it."""
    page, library, worker = demo.page, demo.page.library, demo.services.worker
    path = write(tmp_path / "keepers.md", KEEPERS)
    state = open_lighthouse(demo, lighthouse)
    prepare(demo, state, path)
    keepers = worker.views()[-1].doc_id
    library.cancel(keepers)
    worker.start()
    assert worker.wait_idle(WAIT_S)

    again = prepare(demo, state, path)
    assert worker.views()[-1].doc_id == keepers and worker.views()[-1].status in ("queued", "running", "done")
    assert again[library.selected._id]["value"] == keepers and again[library.to_open._id] is None
    assert not {page.tabs._id, page.state._id, page.last_doc._id} & set(again)
    assert "lighthouse.txt: ready" in status_line(demo, state)
    assert worker.wait_idle(WAIT_S)

    state, status = page.chat.reindex(state, 0.1, CONFIG.level1_ratio)
    assert state["doc_id"] == lighthouse and "lighthouse.txt" in status
    polled = named([*library.refresh_outputs, library.seen], library.poll(None))
    assert not sets_value(polled[page.chat.doc._id])
    assert worker.wait_idle(WAIT_S)
    assert "lighthouse.txt: ready" in status_line(demo, state)


def test_opening_a_stored_document_without_a_context_prepares_it_again(demo, lighthouse, tmp_path):
    """A document of the library whose context is gone (the store's migration that re-cuts a PDF's text drops it,
    as here; or one prepared for another model) is prepared again from its stored text when the user opens it, and
    is ready again; so is one whose preparation was cancelled. Coming back to the page does not start it; an
    upload cancelled before its text was stored, and a preparation that failed, are left as they are."""
    page, worker, store = demo.page, demo.services.worker, demo.services.store
    with store.transaction() as db:  # what the migration does to a document whose text changed
        db.execute("UPDATE jobs SET context_id = NULL WHERE doc_id = ?", [lighthouse])
        db.execute("DELETE FROM contexts WHERE doc_id = ?", [lighthouse])
    restored = named(page.chat.open_outputs, page.chat.open_document(lighthouse, new_state(CONFIG), METHOD,
                                                                      SPARSITY, prepare=False))
    assert "not prepared for this model yet; open it from the library to prepare it" in \
        restored[page.chat.status._id]
    assert worker.views() == []  # a page coming back to it started nothing

    state = open_lighthouse(demo, lighthouse)
    (job,) = worker.views()
    assert job.doc_id == lighthouse and job.status == "queued"
    assert "ready" not in status_line(demo, state)
    open_lighthouse(demo, lighthouse)
    assert len(worker.views()) == 1  # opened again while it waits: the same preparation
    worker.cancel(job.id)
    worker.start()
    assert worker.wait_idle(WAIT_S) and worker.views()[-1].status == "cancelled"
    assert "its preparation was cancelled; open it from the library to prepare it" in status_line(demo, state)
    open_lighthouse(demo, lighthouse)  # cancelled, opened again: prepared again
    assert worker.wait_idle(WAIT_S) and worker.views()[-1].status == "done"
    assert "lighthouse.txt: ready" in status_line(demo, state)

    worker.close()  # an upload cancelled while it waited: its text was never stored, so only uploading it helps
    demo.services.worker = worker = IngestWorker(demo.services.engine, start=False)
    prepare(demo, state, write(tmp_path / "keepers.md", KEEPERS))
    keepers = worker.views()[-1]
    worker.cancel(keepers.id)
    worker.start()
    assert worker.wait_idle(WAIT_S) and worker.views()[-1].status == "cancelled"
    opened = named(page.chat.open_outputs, page.chat.open_document(keepers.doc_id, state, METHOD, SPARSITY))
    assert "its preparation was cancelled; upload it again to prepare it" in opened[page.chat.status._id]
    jobs = len(worker.views())

    prepare(demo, state, write(tmp_path / "scan.pdf", b"%PDF-1.4 not a pdf at all"))  # failed: left as it is
    assert worker.wait_idle(WAIT_S) and worker.views()[-1].status == "failed"
    page.chat.open_document(worker.views()[-1].doc_id, state, METHOD, SPARSITY)
    assert len(worker.views()) == jobs + 1


def test_an_answer_leaves_the_page_alone_once_the_user_opens_another_document(demo, lighthouse, tmp_path):
    """A question still being answered when its browser opens another document (or chat): the page stays on what
    the user opened (the answer's later updates change nothing but hide Cancel, once), the turn is saved to the
    chat it was asked in, and coming back to that chat shows it. An answer whose session stays put updates the
    page to the end (the same handler, the control)."""
    page, worker, store = demo.page, demo.services.worker, demo.services.store
    worker.start()
    prepare(demo, new_state(CONFIG), write(tmp_path / "keepers.md", KEEPERS))
    assert worker.wait_idle(WAIT_S) and worker.views()[-1].status == "done"
    keepers = worker.views()[-1].doc_id
    browser = SimpleNamespace(session_hash="browser-1")

    def opened(doc_id, state):
        return named(page.chat.open_outputs, page.chat.open_document(doc_id, state, METHOD, SPARSITY,
                                                                      request=browser))[page.state._id]

    def asking(state, question):
        return page.chat.ask(question, [], state, METHOD, SPARSITY, CONFIG.centroid_ratio, CONFIG.level1_ratio,
                             False, 8, request=browser)

    state = opened(lighthouse, new_state(CONFIG))
    stayed = list(asking(state, "Who kept the light?"))
    assert stayed[-1][0][-1]["role"] == "assistant" and stayed[-1][0][-1]["content"]  # the answer, on the page
    assert stayed[-1][2]["doc_id"] == lighthouse

    state = opened(lighthouse, stayed[-1][2])
    answer = asking(state, "Who kept it after him?")
    first = next(answer)  # the question shown, its answer pending
    assert first[0][-2] == {"role": "user", "content": "Who kept it after him?"}
    elsewhere = opened(keepers, state)  # the user opens another document meanwhile
    later = list(answer)
    assert later, "the answer went on"
    assert later[0][:-1] == [gr.skip()] * (len(later[0]) - 1) and later[0][-1] == gr.update(visible=False)
    assert all(update == [gr.skip()] * len(update) for update in later[1:])
    assert elsewhere["doc_id"] == keepers

    (chat,) = store.chats.list(lighthouse, elsewhere["owner"])
    assert [t["question"] for t in store.chats.turns(chat["id"])] == ["Who kept the light?", "Who kept it after him?"]
    back = named(page.chat.open_outputs, page.chat.open_document(lighthouse, elsewhere, METHOD, SPARSITY,
                                                                  request=browser))
    assert [m["content"] for m in back[page.chat.chatbot._id] if m["role"] == "user"] == \
        ["Who kept the light?", "Who kept it after him?"]


def test_prepare_with_no_document_open_opens_it_on_the_chat_tab(demo, tmp_path):
    page = demo.page
    prepared = prepare(demo, new_state(CONFIG), write(tmp_path / "keepers.md", KEEPERS))
    keepers = demo.services.worker.views()[-1].doc_id
    assert prepared[page.tabs._id].selected == CHAT_TAB and prepared[page.kept_tab._id] == CHAT_TAB
    assert prepared[page.chat.doc._id]["value"] == keepers and prepared[page.state._id]["doc_id"] == keepers
    assert "keepers.md" in prepared[page.chat.status._id]
    assert "keepers.md" in status_line(demo, prepared[page.state._id])


# ---------------------------------------------------------------------------------------------- a reload

KEPT = {"method": "quest", "sparsity": 0.75, "max_new_tokens": 32, "temperature": 0.7, "top_p": 0.9,
        "repetition": 1.3, "compare": True, "centroid_ratio": 0.1, "level1_ratio": 0.02}


def restore(demo, last, tab, kept) -> dict:
    page = demo.page
    return named(page.restore_outputs, page.restore(last, None, tab, kept, new_state(CONFIG)))


def controls(demo, restored: dict) -> list:
    return [restored[c._id] for c in demo.page.chat.setting_controls]


def test_a_reload_restores_the_controls_the_tab_and_the_document(demo, lighthouse):
    page = demo.page
    kept = page.chat.remember(*KEPT.values())  # what the browser keeps when the user sets the controls
    assert kept == KEPT
    restored = restore(demo, lighthouse, LIBRARY_TAB, kept)
    assert controls(demo, restored) == list(KEPT.values())
    assert restored[page.tabs._id].selected == LIBRARY_TAB  # where the user left the page
    assert restored[page.chat.doc._id]["value"] == lighthouse
    state = restored[page.state._id]
    assert (state["centroid_ratio"], state["level1_ratio"], state["doc_id"]) == (0.1, 0.02, lighthouse)
    assert "quest" in restored[page.chat.threshold._id]  # the plan hint is the restored method's
    assert restore(demo, lighthouse, CHAT_TAB, kept)[page.tabs._id].selected == CHAT_TAB


def test_a_first_visit_keeps_the_defaults_and_opens_the_tab_that_fits(demo, lighthouse):
    page = demo.page
    fresh = restore(demo, None, None, None)
    assert controls(demo, fresh) == [gr.skip()] * len(page.chat.setting_controls)  # as rendered: the defaults
    assert fresh[page.tabs._id].selected == LIBRARY_TAB and not sets_value(fresh[page.chat.doc._id])
    assert restore(demo, lighthouse, None, None)[page.tabs._id].selected == CHAT_TAB  # a document opens
    assert restore(demo, "0123456789abcdef", "elsewhere", None)[page.tabs._id].selected == LIBRARY_TAB  # a gone one


INVALID = {"method": "retired-method", "sparsity": 1.5, "max_new_tokens": 10_000, "temperature": "hot",
           "top_p": None, "repetition": float("nan"), "compare": "yes", "centroid_ratio": True, "level1_ratio": -1}


def test_stored_settings_that_are_no_longer_valid_fall_back_to_the_defaults(demo, lighthouse):
    page = demo.page
    defaults = ChatSettings.defaults(CONFIG)
    assert "retired-method" not in METHODS
    restored = restore(demo, lighthouse, CHAT_TAB, INVALID)
    assert controls(demo, restored) == defaults.values()
    assert restored[page.chat.doc._id]["value"] == lighthouse  # no error: the document opens as ever
    for garbage in ("not a dict", [1, 2], {}):
        assert controls(demo, restore(demo, None, None, garbage)) == defaults.values()
    # each value on its own: the valid ones are kept beside the invalid ones
    mixed = {**KEPT, "method": "retired-method", "sparsity": 0.2, "max_new_tokens": 12.5}
    assert ChatSettings.restored(mixed, CONFIG) == ChatSettings(**{**KEPT, "method": defaults.method,
                                                                   "sparsity": defaults.sparsity,
                                                                   "max_new_tokens": defaults.max_new_tokens})
    assert page.chat.remember(*INVALID.values()) == defaults.as_stored()


def test_what_the_browser_keeps_is_read_again_after_a_restart(demo, tiny_lm, tmp_path):
    """The key of the browser's kept values (the open document, the chats' owner token, the tab, the settings) is
    the cache's own, made once and readable by its owner only: a server started again over the same cache decrypts
    what the browser kept; another cache has another key."""
    import stat

    from app.secret import SECRET_FILE

    page = demo.page
    keys = {page.last_doc.secret, page.owner.secret, page.kept_tab.secret, page.kept_settings.secret}
    assert len(keys) == 1 and len(next(iter(keys))) >= 32
    path = demo.services.store.database.root / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = build_demo(demo.services.engine, worker=IngestWorker(demo.services.engine, start=False), config=CONFIG)
    try:
        assert again.page.owner.secret == page.owner.secret  # the restarted server's
    finally:
        again.services.worker.close()
    other = Engine(tmp_path / "other-cache", lm=tiny_lm)
    elsewhere = build_demo(other, worker=IngestWorker(other, start=False), config=CONFIG)
    try:
        assert elsewhere.page.owner.secret != page.owner.secret
    finally:
        elsewhere.services.worker.close()
        other.store.close()
