"""What a question waits for, told in the chat while it lasts, through gradio_client against a running app on the tiny
model: a method's training once per model (with its expected time before the first question, its steps and the time
left while it runs, and Cancel), the rebuild of an index after a change of the centroid ratio, and the plan hint,
which follows the index as it is built elsewhere; and, through the wait's own handler, the model's first load step
by step."""

from __future__ import annotations

import inspect
import re
import threading
import time

import pytest

from app.render import format_seconds
from engine.serve.jobs import IngestWorker
from engine.serve.service import Engine
from tests.app.test_app import ASK_NAMES, DOC, QUEST_HINT, WAIT_S, ask, launch, open_doc, texts, write
from tests.support.tiny_models import QUICK_TRAINING, SMALL_SAAP

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword is deprecated).*"),
]

SLOW_DUO = {"duo": {"train_steps": 2000, "train_min_tokens": 120, "train_max_tokens": 200, "train_passkeys": 2,
                    "train_words": 3, "train_sink": 4, "train_recent": 16}}  # minutes: cancelled, never finished
QUICK_DUO = {"duo": {**SLOW_DUO["duo"], "train_steps": 40}}
QUICK_SAAP = {"saap": {**SMALL_SAAP["saap"], **QUICK_TRAINING["saap"], "train_steps": 1000}}
LEARNED = [("duo", QUICK_DUO, r"training duo: step \d+/40"),  # each told by its own steps while it trains
           ("saap", QUICK_SAAP, r"training saap: [a-z ]+ \d+/1000")]


def prepared_app(tiny_lm, tmp_path, methods, worker_started=True):
    """An app over a fresh cache whose lighthouse.txt was prepared by the app's own worker (which so has learned
    its seconds per token); returns (app, doc id)."""
    engine = Engine(tmp_path / "cache", lm=tiny_lm, methods=methods)
    running = launch(engine, IngestWorker(engine))
    running.worker.submit_bytes(DOC.encode(), "lighthouse.txt")
    assert running.worker.wait_idle(WAIT_S)
    return running, engine.store.documents.find("lighthouse.txt")["id"]


def outputs_until(job, matches, timeout=WAIT_S) -> dict:
    """The first of a streaming /ask's outputs for which `matches` holds (by name)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for out in job.outputs():
            named = dict(zip(ASK_NAMES, out))
            if matches(named):
                return named
        time.sleep(0.05)
    raise AssertionError("no such output while the question waited")


def pending(named: dict) -> str:
    chat = texts(named["chat"])
    return chat[-1] if len(chat) == 2 else ""


@pytest.mark.parametrize("method,methods,steps", LEARNED, ids=[m for m, _, _ in LEARNED])
def test_a_method_that_learns_says_how_long_before_the_question_then_the_question_waits_with_its_steps(
        tiny_lm, tmp_path, method, methods, steps):
    """Choosing duo (or saap) says that it trains once per model and how long that takes here (the ingest rate the
    worker learned, times the method's work) without starting it; the first question starts it and waits in the
    chat, where the pending answer tells the training's steps and the time left, then the answer comes."""
    app, doc_id = prepared_app(tiny_lm, tmp_path, methods)
    try:
        client = app.client()
        open_doc(client, doc_id)
        hint = client.predict(method, 0.9, 0.05, 0.01, api_name="/threshold")
        expected = app.demo.services.preparer.expected_seconds(method)
        assert expected is not None and expected > 0
        assert hint == (f"{method} learns what it needs once per model, before its first answer: training {method} "
                        f"takes about {format_seconds(expected)} on this machine. The first question starts it "
                        f"(Cancel stops it).")
        assert app.demo.services.preparer.view(method) is None and app.engine.needs_preparation(method)
        job = ask(client, "Who kept the light?", method=method, wait=False)
        waiting = outputs_until(job, lambda o: re.search(steps, pending(o)))
        assert texts(waiting["chat"])[0] == "Who kept the light?"
        assert pending(waiting).startswith(f"Training {method}, once per model, before its first answer: training "
                                           f"{method}: ")
        assert re.search(r"\((about .+ left|estimating the time left)\)\.$", pending(waiting))
        assert f"Training {method}" in waiting["status"]
        answered = dict(zip(ASK_NAMES, job.result(timeout=WAIT_S)))
        chat = texts(answered["chat"])
        assert len(chat) == 2 and not chat[1].startswith("Training")
        turn = app.store.chats.turns(app.store.chats.list(doc_id)[0]["id"])[-1]
        assert (turn["method"], inspect.cleandoc(turn["answer"])) == (method, chat[1])  # (gradio's Chatbot shows a
        # text as inspect.cleandoc leaves it: tabs expanded, the common indent gone)
        assert not app.engine.needs_preparation(method)
    finally:
        app.close()


def test_cancel_stops_the_training_at_its_next_step_and_takes_the_question_back(tiny_lm, tmp_path):
    app, doc_id = prepared_app(tiny_lm, tmp_path, SLOW_DUO)
    try:
        client = app.client()
        open_doc(client, doc_id)
        job = ask(client, "Who kept the light?", method="duo", wait=False)
        outputs_until(job, lambda o: re.search(r"training duo: step \d+/2000", pending(o)))
        # the poll's status line above the chat follows the training too
        status, _hint = client.predict("duo", 0.9, 0.05, 0.01, api_name="/watch")
        assert "Training duo, once per model" in status
        client.predict(api_name="/cancel_wait")
        ended = dict(zip(ASK_NAMES, job.result(timeout=WAIT_S)))
        assert ended["chat"] == [] and ended["question"] == "Who kept the light?"
        assert "Cancelled: the training of duo stops at its next step" in ended["status"]
        preparer = app.demo.services.preparer
        deadline = time.monotonic() + WAIT_S
        while preparer.view("duo").state == "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert preparer.view("duo").state == "cancelled" and preparer.view("duo").done < 2000
        assert app.engine.needs_preparation("duo") and not app.store.chats.list(doc_id)
    finally:
        app.close()


def test_a_question_after_a_centroid_change_waits_for_the_rebuild_in_the_chat(tiny_lm, tmp_path):
    """A new centroid ratio is indexed by the worker; a question asked with it meanwhile waits, its pending answer
    telling which indexes are built and how far, then it is answered from the new index. Cancel stops a build."""
    engine = Engine(tmp_path / "cache", lm=tiny_lm)
    engine.ingest(write(tmp_path / "lighthouse.txt", DOC))
    app = launch(engine, IngestWorker(engine, start=False))  # rebuilds wait in the queue until the worker starts
    try:
        doc_id = app.store.documents.find("lighthouse.txt")["id"]
        context = app.store.contexts.list(doc_id)[0]["id"]
        client = app.client()
        open_doc(client, doc_id)
        assert "building the squeeze index in the background" in client.predict(0.1, 0.01, api_name="/reindex")
        job = ask(client, "Who kept the light?", centroid=0.1, wait=False)
        waiting = outputs_until(job, lambda o: pending(o).startswith("Building"))
        assert pending(waiting) == ("Building the squeeze index of this document (with the settings asked for) "
                                    "before the answer: next in the queue, estimating the time left.")
        app.worker.start()
        answered = dict(zip(ASK_NAMES, job.result(timeout=WAIT_S)))
        assert len(texts(answered["chat"])) == 2 and not texts(answered["chat"])[1].startswith("Building")
        assert app.store.methods.get(context, "squeeze")["settings"]["squeeze"]["centroid_ratio"] == 0.1
        # The plan hint follows the index: it names the plan as soon as the index exists (the poll), for any ratio.
        _status, hint = client.predict("squeeze", 0.8, 0.1, 0.01, api_name="/watch")
        assert hint.startswith("At 80% sparsity, squeeze uses: ")
        # Cancel: a question with another ratio hands its build to the worker, then stops it.
        app.worker.close()
        paused = IngestWorker(engine, start=False)
        app.demo.services.worker = paused
        job = ask(client, "Who kept the light?", centroid=0.15, wait=False)
        outputs_until(job, lambda o: pending(o).startswith("Building"))
        client.predict(api_name="/cancel_wait")
        ended = dict(zip(ASK_NAMES, job.result(timeout=WAIT_S)))
        assert "Cancelled: the index build stops at its next step" in ended["status"]
        assert len(texts(ended["chat"])) == 0 and ended["question"] == "Who kept the light?"
        paused.start()
        assert paused.wait_idle(WAIT_S)
        assert paused.views()[-1].status == "cancelled"
        assert app.store.methods.get(context, "squeeze")["settings"]["squeeze"]["centroid_ratio"] == 0.1
        paused.close()
    finally:
        app.close()


def test_the_plan_hint_says_built_at_the_first_question_only_while_it_is_not_built(tiny_lm, tmp_path):
    """One browser's hint for quest says its index is built at the first question; another browser's question
    builds it; the first browser's poll then shows the plan, without a control moved."""
    app, doc_id = prepared_app(tiny_lm, tmp_path, None)
    try:
        first, second = app.client(), app.client()
        open_doc(first, doc_id)
        open_doc(second, doc_id)
        assert "built at the first question" in first.predict("quest", 0.9, 0.05, 0.01, api_name="/threshold")
        _status, hint = first.predict("quest", 0.9, 0.05, 0.01, api_name="/watch")
        assert "built at the first question" in hint
        ask(second, "How many steps?", method="quest", sparsity=0.9)
        _status, hint = first.predict("quest", 0.9, 0.05, 0.01, api_name="/watch")
        assert re.fullmatch(QUEST_HINT, hint)
    finally:
        app.close()


def test_the_models_first_load_is_told_in_the_chat_step_by_step_until_stop():
    """While the model loads (its first load parses its weights: minutes), a question's wait says which step of the
    load is under way, each poll; Stop ends the wait in words and leaves the load going (not cancellable)."""
    from types import SimpleNamespace

    from app.waits import WaitEnded, _loading
    from engine.model.load import STEP_TOKENIZER, STEP_WEIGHTS, LoadStep

    loader = threading.Event()  # set: the load is over
    engine = SimpleNamespace(model_loaded=False, load_step=None)
    services = SimpleNamespace(engine=engine, config=SimpleNamespace(poll_s=0.01),
                               load_model=lambda: SimpleNamespace(is_alive=lambda: not loader.is_set()))
    stop, cancel = threading.Event(), threading.Event()
    told = []
    waiting = _loading(services, stop, cancel)
    for step in (None, LoadStep(STEP_TOKENIZER, 0, 2), LoadStep(STEP_WEIGHTS, 1, 2)):
        engine.load_step = step
        wait = next(waiting)
        assert wait.kind == "loading" and not wait.cancellable
        told.append(wait.text)
    assert told == ["Loading the model before its first answer: starting.",
                    f"Loading the model before its first answer: {STEP_TOKENIZER} (step 1 of 2).",
                    f"Loading the model before its first answer: {STEP_WEIGHTS} (step 2 of 2)."]
    stop.set()
    with pytest.raises(WaitEnded, match="Stopped waiting; the model goes on loading."):
        next(waiting)
    assert not loader.is_set()  # the load goes on
    engine.model_loaded = True  # loaded: nothing to wait for
    assert list(_loading(services, threading.Event(), threading.Event())) == []
