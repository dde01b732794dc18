"""The Documents tab's view of the preparations, through its handlers on the tiny model: where a queued upload
stands, an upload a killed server left queued shown as resumed on the next start (and prepared), and Delete refused,
with its reason, while a document is being prepared."""

from __future__ import annotations

import re

import pytest

from app.chat import new_state
from app.config import AppConfig
from app.demo import build_demo
from engine.serve.jobs import IngestWorker, document_id
from engine.serve.service import Engine
from tests.app.test_app import DOC, WAIT_S, write

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword is deprecated).*"),
]

CONFIG = AppConfig(poll_s=0.5, max_new_tokens=16)
KEEPERS = "# Keepers\n\nWalter Jago kept the light from 1851 to 1880; his daughter Ann kept it after him.\n" * 3
DEAD_PID = 2**22 + 12345  # above Linux's pid_max: no process has it


def named(components: list, values: list) -> dict:
    """A handler's outputs by component (its `_id`)."""
    assert len(components) == len(values)
    return {c._id: v for c, v in zip(components, values)}


def cards(jobs_html: str) -> dict[str, str]:
    """The job cards of the "Being prepared" markup, by the name each shows."""
    found = {}
    for card in jobs_html.split('<div class="sq-job ')[1:]:
        name = re.search(r"<b>(.*?)</b>", card)
        assert name is not None, card
        found[name.group(1)] = card
    return found


def upload(demo, *paths: str) -> str:
    """Prepare, as the Documents tab's button runs it (no document open): the message it shows."""
    library = demo.page.library
    out = named([library.message, library.files, library.to_open, *library.refresh_outputs],
                library.upload(list(paths), False, new_state(CONFIG)))
    return out[library.message._id]


@pytest.fixture
def paused(tiny_lm, tmp_path):
    """The app over an empty cache; its worker takes no job until a test starts it."""
    engine = Engine(tmp_path / "cache", lm=tiny_lm)
    demo = build_demo(engine, worker=IngestWorker(engine, start=False), config=CONFIG)
    yield demo
    demo.services.worker.close()
    engine.store.close()


def test_a_queued_upload_says_where_it_stands(paused, tmp_path):
    message = upload(paused, write(tmp_path / "lighthouse.txt", DOC), write(tmp_path / "keepers.md", KEEPERS))
    assert "lighthouse.txt: next in the queue" in message and "keepers.md: waiting: 1 ahead" in message
    shown = cards(paused.page.library.jobs_html())
    assert "next in the queue" in shown["lighthouse.txt"] and "waiting: 1 ahead" in shown["keepers.md"]
    assert "position" not in paused.page.library.jobs_html()


def test_an_upload_a_killed_server_left_queued_is_shown_resumed_then_prepared(tiny_lm, tmp_path):
    """The next start queues the upload again and its card says "resumed after a restart"; an upload made after the
    start is an ordinary queued one; both are then prepared."""
    cache = tmp_path / "cache"
    killed = Engine(cache, lm=tiny_lm)
    worker = IngestWorker(killed, start=False)
    left = worker.submit_bytes(DOC.encode(), "lighthouse.txt")
    worker.close()  # never started: the upload stays queued, as a kill leaves it
    with killed.store.transaction() as db:  # the process that queued it is gone
        db.execute("UPDATE jobs SET pid = ? WHERE id = ?", [DEAD_PID, left.id])
    killed.store.close()

    engine = Engine(cache, lm=tiny_lm)  # marks the dead process's job interrupted
    demo = build_demo(engine, worker=IngestWorker(engine, resume=True, start=False), config=CONFIG)
    try:
        upload(demo, write(tmp_path / "keepers.md", KEEPERS))
        shown = cards(demo.page.library.jobs_html())
        assert set(shown) == {"lighthouse.txt", "keepers.md"}
        assert "next in the queue (resumed after a restart)" in shown["lighthouse.txt"]
        assert "resumed" not in shown["keepers.md"] and "waiting: 1 ahead" in shown["keepers.md"]
        demo.services.worker.start()
        assert demo.services.worker.wait_idle(WAIT_S)
        statuses = {d["name"]: d["status"] for d in engine.store.documents.list()}
        assert statuses == {"lighthouse.txt": "ready", "keepers.md": "ready"}
        assert cards(demo.page.library.jobs_html()) == {}  # prepared: none left under "Being prepared"
    finally:
        demo.services.worker.close()
        engine.store.close()


def test_delete_is_refused_while_the_document_is_being_prepared(paused, tmp_path):
    """Delete of a document whose preparation is queued (or running) is refused with the reason and deletes
    nothing; once it is prepared, the same Delete goes ahead."""
    page, library = paused.page, paused.page.library
    path = write(tmp_path / "keepers.md", KEEPERS)
    upload(paused, path)
    keepers = document_id(KEEPERS.encode())
    outputs = [library.notice, *library.refresh_outputs, page.state, library.confirm_row, library.undo_btn]
    state = new_state(CONFIG)
    refused = named(outputs, library.delete(keepers, state))
    assert "keepers.md is being prepared; delete it when that has finished." in refused[library.notice._id]
    assert 'class="sq-notice sq-error"' in refused[library.notice._id]
    assert refused[page.state._id] == state and refused[library.undo_btn._id]["visible"] is False
    assert paused.services.worker.view(paused.services.worker.views()[-1].id).status == "queued"  # not cancelled
    paused.services.worker.start()
    assert paused.services.worker.wait_idle(WAIT_S)
    assert paused.services.store.documents.find(keepers)["status"] == "ready"
    deleted = named(outputs, library.delete(keepers, state))
    assert "Deleted keepers.md and its chats." in deleted[library.notice._id]
    assert [d["name"] for d in paused.services.store.documents.list()] == []
