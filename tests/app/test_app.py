"""The app's handlers through gradio_client against a running app, on a tiny random-weight model (GQA Llama:
two global layers, two KV heads). The answers are noise; what is checked is what the app does with them:
background preparation, refusals with the time left, streaming, stop, history across a restart, re-indexing,
errors in plain words, limits, delete, and the per-turn views."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import gradio.utils
import httpx
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from app.config import AppConfig
from app.demo import build_demo, launch_kwargs
from engine.methods import SPARSE_METHODS
from engine.serve.jobs import IngestWorker
from engine.serve.service import Engine
from engine.serve.turns import EMPTY_ANSWER, Turns, same_answer
from engine.text.prompt import ANSWER_RESERVE, Exchange
from storage import NotFoundError
from tests.support.pdfs import make_text_pdf
from tests.support.serving import serve_locally
from tests.support.tiny_models import QUICK_TRAINING

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # Gradio's queue calls pandas options that pandas 3 deprecates; not ours to fix.
    pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword is deprecated).*"),
]

DOC = (
    "Callow Head Light was first lit in 1847. Its keeper, Walter Jago, logged the weather every four hours. "
    "The stone staircase has 143 steps. A stray dog named Biscuit warned ships in fog. The secret passkey is "
    "48213. Fishermen call the reef southwest of the headland the Gannet Teeth. "
) * 4  # ~1,100 bytes: the tiny model's byte tokenizer makes one token per byte
UPLOAD_MB = 0.05
WAIT_S = 120


@dataclass
class RunningApp:
    url: str
    demo: object
    engine: Engine

    @property
    def worker(self) -> IngestWorker:
        return self.demo.services.worker

    @property
    def store(self):
        return self.engine.store

    def client(self) -> Client:
        return Client(self.url, verbose=False)

    def close(self) -> None:
        self.demo.close()
        self.worker.close()


def launch(engine: Engine, worker: IngestWorker | None = None, **config) -> RunningApp:
    cfg = AppConfig(max_upload_mb=UPLOAD_MB, poll_s=0.5, max_new_tokens=16, **config)
    demo = build_demo(engine, engine.store, worker=worker or IngestWorker(engine), config=cfg)
    return RunningApp(serve_locally(demo, **launch_kwargs(cfg, engine.store)), demo, engine)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def app(tiny_lm, cache_dir):
    running = launch(Engine(cache_dir, lm=tiny_lm, methods=QUICK_TRAINING))
    yield running
    running.close()


def write(path: Path, text: str | bytes) -> str:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


def upload(client: Client, *paths: str, truncate: bool = False) -> dict:
    message, _files, jobs, table, *_ = client.predict([handle_file(p) for p in paths], truncate, api_name="/upload")
    return {"message": message, "jobs": jobs, "table": table}


def poll(client: Client) -> dict:
    jobs, table, _selected, _doc = client.predict(api_name="/poll")
    return {"jobs": jobs, "table": table}


def open_doc(client: Client, doc_id: str) -> dict:
    out = client.predict(doc_id, "squeeze", 0.8, api_name="/open_document")
    names = ["doc", "status", "chat", "turn", "threshold", "heatmap", "budget", "compare", "clusters", "passages",
             "document", "layer", "head", "projection", "answer", "evaluation", "last_doc", "chats"]
    assert len(out) == len(names)
    return dict(zip(names, out))


# The plan hint of Quest at 90% on the short test document: with one-byte bounds a 10% budget is above what Quest's
# index and the dense rows read there, so the hint adds no "reads at least" line
QUEST_HINT = r"At 90% sparsity, quest uses: its best pages up to .* \(top [0-9.]+% of the pages on a GPU\)"
ASK_NAMES = ["chat", "question", "status", "turn", "heatmap", "budget", "compare", "clusters", "passages", "document",
             "layer", "head", "projection", "answer", "chats", "cancel"]


def ask(client: Client, question: str, method="squeeze", sparsity=0.8, centroid=0.05, level1=0.01, compare=False,
        max_new=16, wait=True, temperature=0.0, top_p=1.0, repetition=1.0):
    job = client.submit(question, [], method, sparsity, centroid, level1, compare, max_new, temperature, top_p,
                        repetition, api_name="/ask")
    if not wait:
        return job
    return dict(zip(ASK_NAMES, job.result(timeout=WAIT_S))), job


def figure(value) -> dict:
    """A gr.Plot output as the client gets it: the plotly figure's JSON."""
    assert isinstance(value, dict) and value.get("type") == "plotly", value
    return json.loads(value["plot"])


def kept_cells(value) -> list[float]:
    """The kept fractions a heatmap figure shows (every cell of its heatmaps), in [0, 1]."""
    return [z / 100 for trace in figure(value)["data"] if trace["type"] == "heatmap" for row in trace["z"] for z in row]


def texts(chat: list[dict]) -> list[str]:
    return [m["content"][0]["text"] if isinstance(m["content"], list) else m["content"] for m in chat]


def row_of(table: dict, name: str) -> list:
    return next(r for r in table["data"] if r[0] == name)


@pytest.fixture(scope="module")
def ready_doc(app, tmp_path_factory) -> str:
    """lighthouse.txt uploaded through the app and prepared by its worker; returns its id."""
    path = write(tmp_path_factory.mktemp("docs") / "lighthouse.txt", DOC)
    upload(app.client(), path)
    assert app.worker.wait_idle(WAIT_S)
    return app.store.documents.find("lighthouse.txt")["id"]


def test_upload_prepares_in_the_background_and_the_library_lists_it(app, tmp_path):
    client = app.client()
    path = write(tmp_path / "keepers.md", "# Keepers\n\n" + DOC[:700])
    started = time.perf_counter()
    out = upload(client, path)
    assert time.perf_counter() - started < 10  # the request only hands the bytes over
    assert "keepers.md" in out["message"]
    assert app.worker.wait_idle(WAIT_S)
    view = app.worker.views()[-1]
    assert (view.name, view.status, view.fraction, view.eta_s) == ("keepers.md", "done", 1.0, 0.0)
    row = row_of(poll(client)["table"], "keepers.md")
    name, pages, tokens, status, added, doc_id = row
    assert (pages, status) == (1, "ready") and tokens == len("# Keepers\n\n" + DOC[:700]) + 1  # bytes + BOS
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", added)
    opened = open_doc(client, doc_id)
    assert "keepers.md: ready" in opened["status"] and opened["chat"] == []
    assert opened["threshold"].startswith("At 80% sparsity, squeeze uses: its best clusters up to ")


def test_the_plan_hint_says_how_low_the_budget_reaches_on_the_document(app, ready_doc):
    """Before the question: where the asked budget is below what the method's index and the dense rows alone read on
    this (short) document, the hint says the least it reads; the answer then shows the asked budget beside the read
    one and why they differ; at 80% sparsity it reads what it asked."""
    client = app.client()
    open_doc(client, ready_doc)
    _, lowest = app.engine.plan_and_floor(app.store.contexts.list(ready_doc)[0]["id"], "squeeze")
    assert 0.01 < lowest < 0.2
    hint = client.predict("squeeze", 0.99, 0.05, 0.01, api_name="/threshold")
    assert f"On this document squeeze reads at least {lowest:.1%} of the K/V bytes" in hint
    assert "reads at least" not in client.predict("squeeze", 0.8, 0.05, 0.01, api_name="/threshold")
    out, _ = ask(client, "Who kept the light?", sparsity=0.99)
    assert 'asked <b class="sq-asked">1.0%</b>' in out["budget"] and "more than asked" in out["budget"]
    out, _ = ask(client, "Who kept the light?", sparsity=0.8)
    assert 'asked <b class="sq-asked">20.0%</b>' in out["budget"] and "more than asked" not in out["budget"]


def test_answers_stream_and_every_turn_shows_what_attention_did(app, ready_doc):
    client = app.client()
    open_doc(client, ready_doc)
    out, job = ask(client, "What is the secret passkey?", max_new=16)
    assert len(job.outputs()) >= 3  # the question, then pieces of the answer, then the views
    chat = texts(out["chat"])
    assert chat[0] == "What is the secret passkey?" and len(chat) == 2 and chat[1]
    # (a) kept fraction: 2 global layers x 4 query heads, for the prefill and for the answer
    kept = kept_cells(out["heatmap"])
    assert len(kept) == 2 * 2 * 4
    assert all(0 < k <= 1 for k in kept) and min(kept) < 0.6  # sparse: most heads read well under the whole context
    heat = figure(out["heatmap"])["data"][0]
    assert "layer %{y}, head %{x}" in heat["hovertemplate"] and "keys kept" in heat["hovertemplate"]
    fixed = app.store.chats.turns(app.store.chats.list(ready_doc)[0]["id"])[-1]["stats"]["fixed_len"]
    assert heat["customdata"][0][0] == round(heat["z"][0][0] / 100 * fixed)  # the keys the hover tells
    # (c) KV budget and the time split
    assert re.search(r"KV budget <b class=\"sq-kv\">\d+\.\d%</b>", out["budget"]) and "lookup" in out["budget"]
    # (b) clusters with sizes and scores, passages with pages, the document with highlights
    assert out["clusters"]["headers"][:5] == ["layer", "KV head", "unit", "keys", "score (question)"]
    first = out["clusters"]["data"][0]
    assert first[0] in (0, 1) and first[1] in (0, 1) and int(first[3]) > 0 and first[7] == "1"
    assert '<ol class="sq-passages"' in out["passages"] and "p. 1" in out["passages"] and "<mark" in out["passages"]
    assert out["document"].count("<mark") > 10
    # a text file has one page: each passage links to its place in the document, and the answer is shown beside them
    assert 'href="#sq-passage-1"' in out["passages"] and 'id="sq-passage-1"' in out["document"]
    assert out["answer"] == "" or 'class="sq-answer"' in out["answer"]
    # (d) projection of layer 0, KV head 0 keys
    proj = figure(out["projection"])
    keys = {t["name"]: len(t["x"]) for t in proj["data"]}
    assert keys["other keys"] + keys["keys of retrieved clusters"] > 100 and keys["retrieved centroids"] > 0
    assert proj["layout"]["dragmode"] == "zoom"
    assert out["layer"]["choices"] == [["layer 0", 0], ["layer 1", 1]] and out["turn"]["value"] == 0
    # another layer and head, and the turn again from the history
    other = figure(client.predict(0, 1, 1, api_name="/show_projection"))
    assert other["layout"]["title"]["text"].startswith("layer 1, KV head 1")
    again = client.predict(0, api_name="/show_turn")
    assert again[0] == out["heatmap"]


def test_an_answer_streams_each_piece_as_the_engine_makes_it(app, ready_doc):
    """The chat shows every piece of an answer in an update of its own as the engine yields it (none held for the
    next): the answer's texts the browser receives include, in order, each prefix the engine's pieces make for the
    same question."""
    from engine.context.turn import Delta

    context = app.store.contexts.list(ready_doc)[0]["id"]
    pieces = [e.text for e in app.engine.stream(context, "Who kept the light?", "squeeze", 0.8, 16)
              if isinstance(e, Delta)]
    assert len(pieces) >= 3
    client = app.client()
    open_doc(client, ready_doc)
    _, job = ask(client, "Who kept the light?", max_new=16)
    shown = [texts(o[0])[1] for o in job.outputs() if len(texts(o[0])) == 2]  # the answer's text in each update
    prefixes = ["".join(pieces[: i + 1]) for i in range(len(pieces))]
    at = 0
    for text in shown:
        if at < len(prefixes) and text == prefixes[at]:
            at += 1
    assert at == len(prefixes), (prefixes, shown)


def test_the_latest_evaluation_of_the_model_is_shown(app, ready_doc):
    """The chat tab shows the newest `squeeze eval` of the app's model, again when a document is opened."""
    client = app.client()
    model = app.engine.model_id
    assert f"No evaluation yet for {model}: run `squeeze eval`" in open_doc(client, ready_doc)["evaluation"]
    doc = {"bench": "eval", "model": model, "device": "cpu", "created": "2025-01-02T03:04:05+00:00",
           "summary": [{"method": m, "budget": 0.2, "needles": 1.0, "recall": 0.9, "oracle": 0.95, "top1": 1.0,
                        "kl": 0.01, "read_prefill": 0.2, "read_decode": 0.19} for m in SPARSE_METHODS]}
    app.engine.record_eval(doc)
    shown = open_doc(client, ready_doc)["evaluation"]
    assert client.predict(api_name="/evaluation") == shown  # as a page load shows it
    assert f"Latest squeeze eval of {model}" in shown
    assert re.findall(r"<tr><td>([\w-]+)</td><td>20%</td><td>100%</td>", shown) == list(SPARSE_METHODS)


def test_every_method_answers_and_full_reads_everything(app, ready_doc):
    client = app.client()
    open_doc(client, ready_doc)
    # The sparsity slider shows the plan it maps to: the share of the K/V bytes its lookups cut their scores at,
    # less for a higher sparsity.
    low, high = (client.predict("squeeze", pct, 0.05, 0.01, api_name="/threshold") for pct in (0.6, 0.95))
    share = r"([\d.]+)% (?:of the K/V bytes )?in the (?:question|answer)'s"
    room = [[float(x) for x in re.findall(share, text)] for text in (low, high)]
    assert len(room[0]) == len(room[1]) == 2 and all(a > b for a, b in zip(*room)), (low, high)
    # A method not built for the document yet says so; its first question builds it (then its plan is shown).
    assert "built at the first question" in client.predict("quest", 0.9, 0.05, 0.01, api_name="/threshold")
    out, _ = ask(client, "How many steps?", method="quest", sparsity=0.9)
    # at a 10% KV budget the bounds (1/64 of the bytes), the dense tail and the follow rows leave Quest ~1% of the
    # pages on this short document
    assert re.search(r"top [0-9.]+% of the pages", out["budget"])
    pages = out["clusters"]["data"]  # the pages the question kept, with their text: units of 16 keys
    assert pages and all(row[3] == 16 for row in pages) and 'class="sq-passages"' in out["passages"]
    assert re.fullmatch(QUEST_HINT, client.predict("quest", 0.9, 0.05, 0.01, api_name="/threshold"))
    # and the page shows it without a slider move: each answer is followed by the hint's refresh
    deps = app.demo.config["dependencies"]
    answered = [d["id"] for d in deps if d.get("api_name") == "ask"]
    chained = [app.demo.fns[d["id"]].fn for d in deps if d.get("trigger_after") in answered]
    assert [getattr(f, "__name__", "") for f in chained].count("show_threshold") == len(answered) == 1
    out, _ = ask(client, "How many steps?", method="hsqueeze", sparsity=0.9)  # its plan: the room it cuts at
    assert re.search(r"its best clusters up to [0-9.]+% of the K/V bytes", out["budget"])
    out, _ = ask(client, "How many steps?", method="full")
    assert "KV budget <b class=\"sq-kv\">100.0%</b>" in out["budget"]
    assert set(kept_cells(out["heatmap"])) == {1.0}


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_compare_with_full_attention_says_whether_the_answers_agree(app, ready_doc, method):
    """Every sparse method's turn compared through the app: full attention's answer is the one it gives to the same
    question after the same earlier turns of the chat, and the verdict says whether the two answers are the same.
    (After the test above, which needs quest unbuilt.)"""
    client = app.client()
    open_doc(client, ready_doc)
    question, max_new = "Who kept the light?", 16
    # (duo's first question waits in the chat while its gates are trained: tests/app/test_app_waits.py)
    out, _ = ask(client, question, method=method, compare=True, max_new=max_new)
    chat = texts(out["chat"])
    assert len(chat) == 3 and chat[2].startswith("Full attention: ")
    assert chat[2].endswith(("✓ the answers agree", "✗ the answers differ"))
    assert re.search(r'sq-badge sq-(agree|differ)">answers (agree|differ)', out["compare"])
    chat_id = app.store.chats.list(ready_doc)[0]["id"]
    turn = app.store.chats.turns(chat_id)[-1]
    compare = turn["stats"]["compare"]
    assert (turn["question"], turn["method"], turn["stats"]["method"]) == (question, method, method)
    earlier = Turns(app.engine).history(chat_id)[:-1]
    assert turn["stats"]["extra"]["history"] == len(earlier)  # (all of them fit)
    alone = app.engine.ask(turn["stats"]["context_id"], question, "full", 0.0, max_new, history=earlier)
    assert compare["answer"] == alone.text and chat[2] == f"Full attention: {alone.text}\n\n" + (
        "✓ the answers agree" if compare["agree"] else "✗ the answers differ")
    assert compare["agree"] == same_answer(alone.text, turn["answer"]) and chat[1] == turn["answer"]
    assert compare["total_s"] > 0


def test_stop_ends_the_answer_and_keeps_what_was_said(app, ready_doc, monkeypatch):
    """The tiny model may end its answer within a few tokens, faster than a stop request's round trip: each streamed
    piece is held back a while, so that the stop sent after the first pieces lands while the answer still streams."""
    stream = app.engine.stream

    def slowed(*args, **kwargs):
        for event in stream(*args, **kwargs):
            time.sleep(0.2)
            yield event

    monkeypatch.setattr(app.engine, "stream", slowed)
    client = app.client()
    open_doc(client, ready_doc)
    job = ask(client, "Tell me everything.", max_new=512, wait=False)
    deadline = time.monotonic() + WAIT_S
    while len(job.outputs()) < 3 and not job.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    client.predict(api_name="/stop")
    out = dict(zip(ASK_NAMES, job.result(timeout=WAIT_S)))
    answer = texts(out["chat"])[-1]
    assert answer.endswith("[stopped]")
    assert "stopped before it finished" in json.dumps(figure(out["heatmap"]))
    saved = app.store.chats.turns(app.store.chats.list(ready_doc)[0]["id"])[-1]
    assert saved["answer"].endswith("[stopped]") and saved["stats"]["stopped"]
    assert len(saved["answer"]) < 512


def resumed(client: Client, token: str = "") -> str:
    """The session's owner token after /resume_chats with `token` (what a browser restores at each page load)."""
    return client.predict(token, api_name="/resume_chats")


def test_history_is_saved_per_document_and_shown_after_a_restart(app, ready_doc, tiny_lm, cache_dir):
    client = app.client()
    open_doc(client, ready_doc)
    ask(client, "In what year was the light first lit?")
    token = resumed(client)
    later = app.client()  # the same user in another session (a reload): its token brings its chats back
    assert resumed(later, token) == token
    before = open_doc(later, ready_doc)["chat"]
    assert texts(before)[-2] == "In what year was the light first lit?"
    # a new process, the same settings: it sees the same index
    restarted = launch(Engine(cache_dir, lm=tiny_lm, methods=QUICK_TRAINING))
    try:
        again = restarted.client()
        resumed(again, token)
        after = open_doc(again, ready_doc)
        assert texts(after["chat"]) == texts(before)
        assert len(kept_cells(after["heatmap"])) == 16  # the last turn's views, from the saved stats
    finally:
        restarted.close()


def test_changing_the_centroid_ratio_reindexes_in_the_background(app, ready_doc):
    """The slider changes squeeze's settings: its index of the open document is rebuilt in the background (the
    context, its K/V, stays); the next question uses the new one."""
    client = app.client()
    open_doc(client, ready_doc)
    context = app.store.methods.list(app.store.contexts.list(ready_doc)[0]["id"])[0]["context_id"]
    status = client.predict(0.1, 0.01, api_name="/reindex")
    # (the hsqueeze index too, where an earlier test of the module built it)
    assert re.search(r"building the squeeze (and hsqueeze indexes|index) in the background", status) or \
        "ready" in status
    assert app.worker.wait_idle(WAIT_S)
    built = app.store.methods.get(context, "squeeze")
    assert built["settings"]["squeeze"]["centroid_ratio"] == 0.1
    ask(client, "Who kept the light?", centroid=0.1)
    turn = app.store.chats.turns(app.store.chats.list(ready_doc)[0]["id"])[-1]
    assert turn["stats"]["context_id"] == context
    client.predict(0.05, 0.01, api_name="/reindex")  # back to the default for the other tests
    assert app.worker.wait_idle(WAIT_S)


def test_a_users_sliders_change_that_users_turns_only(app, ready_doc):
    """Two browsers on one document: one moves the centroid ratio, the other keeps the default. Each one's turns
    are built with its own settings, the engine's settings never change, and each one's preview of the plan is the
    plan its next turn runs."""
    engine_settings = dict(app.engine.method_settings)
    first, second = app.client(), app.client()
    open_doc(first, ready_doc)
    open_doc(second, ready_doc)
    context = app.store.contexts.list(ready_doc)[0]["id"]
    first.predict(0.1, 0.01, api_name="/reindex")
    assert app.worker.wait_idle(WAIT_S)
    assert app.store.methods.get(context, "squeeze")["settings"]["squeeze"]["centroid_ratio"] == 0.1
    # the second browser's preview is its own: its settings (0.05) are not the index's now
    assert "built at the first question" in second.predict("squeeze", 0.8, 0.05, 0.01, api_name="/threshold")
    preview = first.predict("squeeze", 0.8, 0.1, 0.01, api_name="/threshold")
    ask(first, "Who kept the light?", centroid=0.1)
    turns = lambda: app.store.chats.turns(app.store.chats.list(ready_doc)[0]["id"])  # noqa: E731 (newest chat)
    assert preview == f"At 80% sparsity, squeeze uses: {turns()[-1]['stats']['extra']['plan']}"
    assert app.store.methods.get(context, "squeeze")["settings"]["squeeze"]["centroid_ratio"] == 0.1
    ask(second, "Who kept the light?")  # the default ratio: the index is built again with it for this turn
    assert app.store.methods.get(context, "squeeze")["settings"]["squeeze"]["centroid_ratio"] == 0.05
    preview = second.predict("squeeze", 0.8, 0.05, 0.01, api_name="/threshold")
    assert preview == f"At 80% sparsity, squeeze uses: {turns()[-1]['stats']['extra']['plan']}"
    assert app.engine.method_settings == engine_settings


def test_empty_and_repeated_files_in_one_upload_are_told_at_once(app, tmp_path):
    """Two empty files and the same bytes under two names, in one upload: each empty one is refused by its own
    name at once, and the copy is named as the file it repeats (one document, prepared once), instead of statuses
    of another file's job that never resolve."""
    client = app.client()
    text = "The ferry log of the eastern pier, kept by the harbour master. " * 10
    out = upload(client, write(tmp_path / "empty-a.txt", b""), write(tmp_path / "empty-b.txt", b""),
                 write(tmp_path / "log.txt", text), write(tmp_path / "log-copy.txt", text))
    assert "empty-a.txt: the file is empty" in out["message"] and "empty-b.txt: the file is empty" in out["message"]
    assert "log-copy.txt: the same file as log.txt (prepared once)" in out["message"]
    assert app.worker.wait_idle(WAIT_S)
    assert row_of(poll(client)["table"], "log.txt")[3] == "ready"
    assert not any(v.name.startswith("empty-") for v in app.worker.views())


def test_errors_and_limits_are_told_in_plain_words(app, tmp_path):
    client = app.client()
    limit = app.engine.lm.max_context - ANSWER_RESERVE
    broken = write(tmp_path / "broken.pdf", b"%PDF-1.4 not really a PDF")
    long = write(tmp_path / "long.txt", "word " * (limit // 5 + 200))
    big = write(tmp_path / "big.txt", "x" * int(UPLOAD_MB * 2**20 + 10))
    empty = write(tmp_path / "nothing.txt", "")
    out = upload(client, broken, long, big, empty)  # (Gradio's file picker refuses other types before the handler)
    assert f"big.txt: 0.1 MB is over the {UPLOAD_MB:g} MB limit per file" in out["message"]
    assert "nothing.txt: the file is empty" in out["message"]
    uploads = Path(gradio.utils.get_upload_folder())
    for refused in ("big.txt", "nothing.txt"):
        assert not list(uploads.rglob(refused)), f"a refused upload ({refused}) stays in Gradio's upload folder"
    assert Path(big).exists() and Path(empty).exists()  # (the client's own files are the client's)
    assert app.worker.wait_idle(WAIT_S)
    now = poll(client)
    assert "Could not prepare it: broken.pdf: pypdf cannot parse it" in now["jobs"] or \
        "Could not prepare it: broken.pdf:" in now["jobs"]
    assert "Keep the start of long documents" in now["jobs"]
    assert row_of(now["table"], "long.txt")[3].startswith("failed: the document is")
    upload(client, long, truncate=True)
    assert app.worker.wait_idle(WAIT_S)
    assert row_of(poll(client)["table"], "long.txt")[2:4] == [limit, "ready"]


def test_asking_before_ready_is_refused_with_the_time_left(tiny_lm, tmp_path):
    engine = Engine(tmp_path / "cache", lm=tiny_lm)
    paused = launch(engine, IngestWorker(engine, start=False, seconds_per_token=0.01))
    try:
        client = paused.client()
        path = write(tmp_path / "later.txt", DOC)
        out = upload(client, path)
        assert "later.txt: next in the queue" in out["message"]
        doc_id = paused.worker.views()[-1].doc_id
        opened = open_doc(client, doc_id)
        assert "next in the queue · about 3 s left" in opened["status"]
        refused, _ = ask(client, "What is the passkey?")
        # told above the chat, not in it; the question stays in its box
        assert ("later.txt is not ready yet: still being prepared: next in the queue, about 3 s left. Ask again "
                "when it is ready.") in refused["status"]
        assert refused["chat"] == [] and refused["question"] == "What is the passkey?"
        assert 'data-status="queued"' in poll(client)["jobs"]
        paused.worker.start()
        assert paused.worker.wait_idle(WAIT_S)
        answered, _ = ask(client, "What is the passkey?")
        assert len(kept_cells(answered["heatmap"])) == 16
    finally:
        paused.close()


def test_a_cached_document_opens_at_once(app, ready_doc, tmp_path):
    client = app.client()
    jobs_before = len(app.worker.views())
    out = upload(client, write(tmp_path / "lighthouse.txt", DOC))
    assert "lighthouse.txt: already in the library, ready" in out["message"]
    assert len(app.worker.views()) == jobs_before  # no job: nothing to prepare


def test_delete_asks_first_can_be_undone_then_removes_everything(app, tmp_path):
    """Delete names what goes and asks; once confirmed the document leaves the library at once, Undo brings it
    back with its chat, and after the undo window it is deleted for good with its tensors and chats."""
    client = app.client()
    upload(client, write(tmp_path / "gone.txt", "A short note about the harbor wall. " * 12))
    assert app.worker.wait_idle(WAIT_S)
    doc_id = app.store.documents.find("gone.txt")["id"]
    open_doc(client, doc_id)
    ask(client, "What is it about?")
    contexts = [c["id"] for c in app.store.contexts.list(doc_id)]
    question, _notice = client.predict(doc_id, api_name="/ask_delete")  # (the row around them is layout)
    assert "Delete gone.txt and its 1 chat?" in question
    assert app.store.documents.find(doc_id)  # asking deletes nothing

    notice, _jobs, table, *_ = client.predict(doc_id, api_name="/delete")
    assert "Deleted gone.txt and its chats. Undo within 30 s." in notice
    assert all(r[0] != "gone.txt" for r in table["data"])
    with pytest.raises(NotFoundError):
        app.store.documents.find(doc_id)
    assert all((app.store.blob_dir / c).exists() for c in contexts)  # nothing deleted yet
    notice, _jobs, table, *_ = client.predict(api_name="/undo")
    assert "gone.txt is back, with its chats." in notice
    assert any(r[0] == "gone.txt" for r in table["data"])
    assert len(app.store.chats.list(doc_id)) == 1

    client.predict(doc_id, api_name="/delete")
    assert app.engine.delete_hidden(0.0) == [doc_id]  # the undo window has passed (the poll does this)
    assert app.engine.delete_hidden(0.0) == []  # (every page polls: the next finds nothing left to delete)
    assert not any((app.store.blob_dir / c).exists() for c in contexts)
    assert app.store.chats.list(doc_id) == []
    notice, *_ = client.predict(api_name="/undo")
    assert "Too late: that document is deleted for good." in notice


def test_an_uploaded_pdf_links_each_page_to_itself_served_by_the_app(app, ready_doc, tmp_path):
    """A PDF's passages link to their pages of the uploaded file, which the app serves (that file only, and only
    while the document exists); a text file's passages have no such link."""
    client = app.client()
    data = make_text_pdf([DOC[:500], DOC[500:1000]])
    upload(client, write(tmp_path / "light.pdf", data))
    assert app.worker.wait_idle(WAIT_S)
    doc_id = app.store.documents.find("light.pdf")["id"]
    open_doc(client, doc_id)
    out, _ = ask(client, "What is the secret passkey?")
    items = re.findall(r'<li class="sq-passage" data-page="(\d+)">(.*?)</li>', out["passages"], re.S)
    assert items
    path = app.store.documents.source_file(doc_id)
    for page, item in items:
        link = re.search(r'<a class="sq-pdf" href="([^"#]+)#page=(\d+)" target="_blank"[^>]*>PDF p\. (\d+)</a>', item)
        assert link and link.group(2) == link.group(3) == page, item
        assert unquote(link.group(1)) == f"gradio_api/file={path}"
    pdf_url = app.url + next(re.finditer(r'class="sq-pdf" href="([^"#]+)#', out["passages"])).group(1)
    served = httpx.get(pdf_url, timeout=30)
    assert served.status_code == 200 and served.headers["content-type"] == "application/pdf"
    assert served.content == data
    for other in (app.store.index_path, app.store.root / app.store.artifacts.list(
            app.store.contexts.list(doc_id)[0]["id"])[0]["path"]):  # the rest of the cache stays out of reach
        assert httpx.get(f"{app.url}gradio_api/file={quote(str(other))}", timeout=30).status_code == 403

    open_doc(client, ready_doc)
    text_out, _ = ask(client, "What is the secret passkey?")
    assert "sq-passage" in text_out["passages"] and "sq-pdf" not in text_out["passages"] + text_out["answer"]

    client.predict(doc_id, api_name="/delete")
    assert app.engine.delete_hidden(0.0) == [doc_id]
    assert not path.exists() and httpx.get(pdf_url, timeout=30).status_code == 403  # gone with its document


def test_a_refusal_is_told_beside_the_chat_not_in_it(app, ready_doc):
    """No document open, an empty question: the reason shows in the status line above the chat (and as a toast in
    a browser), the chat keeps its turns and no bubble is added; the question stays in its box."""
    client = app.client()
    out, _ = ask(client, "Who kept the light?")  # nothing open yet
    assert "Open a document first" in out["status"] and out["chat"] == []
    assert out["question"] == "Who kept the light?"
    open_doc(client, ready_doc)
    answered, _ = ask(client, "Who kept the light?")
    empty, _ = ask(client, "   ")
    assert "Type a question first." in empty["status"]
    assert empty["chat"] == [] and empty["question"] == ""  # (the client sent no history; nothing added)
    assert texts(answered["chat"])[0] == "Who kept the light?"


def test_chats_stay_with_the_user_who_started_them(app, ready_doc):
    """Another user opening the same document starts clean: none of the first user's chats is listed, reopened
    (even by its id) or read as history; a malformed token is refused (the session keeps its own)."""
    alice, bob = app.client(), app.client()
    open_doc(alice, ready_doc)
    ask(alice, "Who kept the light?")
    alice_token = resumed(alice)
    [alice_chat] = [c for c in app.store.chats.list(ready_doc) if c["owner"] == alice_token]
    opened = open_doc(bob, ready_doc)
    assert opened["chat"] == [] and not opened["chats"]["choices"]
    with pytest.raises(AppError, match="not in the list of choices"):  # by its id: not bob's to open
        bob.predict(alice_chat["id"], api_name="/open_chat")
    bob_token = resumed(bob, "not-a-token")
    assert bob_token != alice_token and len(bob_token) == 32
    ask(bob, "And the dog's name?")
    [bob_chat] = app.store.chats.list(ready_doc, bob_token)
    [turn] = app.store.chats.turns(bob_chat["id"])
    assert turn["stats"]["extra"]["history"] == 0  # alice's exchange is not bob's history
    assert [c["id"] for c in app.store.chats.list(ready_doc, alice_token)] == [alice_chat["id"]]
    assert len(app.store.chats.turns(alice_chat["id"])) == 1


def test_a_follow_up_reads_the_chat_and_earlier_chats_reopen(app, ready_doc):
    """Two questions in one chat: the second turn's input holds the first exchange (its answer is the engine's
    answer after that history); a new chat starts clean; the first chat reopens from the list and goes on."""
    client = app.client()
    client.predict(api_name="/new_chat")
    open_doc(client, ready_doc)
    client.predict(api_name="/new_chat")
    ask(client, "Who kept the light?")
    ask(client, "And the dog's name?")
    chat_id = app.store.chats.list(ready_doc)[0]["id"]
    turns = app.store.chats.turns(chat_id)
    assert [t["question"] for t in turns] == ["Who kept the light?", "And the dog's name?"]
    assert turns[1]["stats"]["extra"]["history"] == 1 and turns[0]["stats"]["extra"]["history"] == 0
    want = app.engine.ask(turns[1]["stats"]["context_id"], "And the dog's name?", "squeeze", 0.8, 16,
                          history=[Exchange(turns[0]["question"], turns[0]["answer"])])
    assert turns[1]["answer"] in (want.text, EMPTY_ANSWER)
    client.predict(api_name="/new_chat")
    ask(client, "Who kept the light?")
    newest = app.store.chats.list(ready_doc)[0]
    assert newest["id"] != chat_id and app.store.chats.turns(newest["id"])[0]["stats"]["extra"]["history"] == 0
    out = client.predict(chat_id, api_name="/open_chat")
    assert texts(out[0]) == [x for t in turns for x in (t["question"], t["answer"])]  # (the state is not sent)
    ask(client, "How many steps?")
    assert [t["question"] for t in app.store.chats.turns(chat_id)][-1] == "How many steps?"
    assert app.store.chats.turns(chat_id)[-1]["stats"]["extra"]["history"] == 2


def test_generation_settings_are_checked_and_sampling_answers(app, ready_doc):
    client = app.client()
    open_doc(client, ready_doc)
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="less than minimum"):  # the slider's range, checked by Gradio
        ask(client, "Who kept the light?", temperature=-1.0)
    out, _ = ask(client, "Who kept the light?", temperature=0.8, top_p=0.9, repetition=1.2)
    turn = app.store.chats.turns(app.store.chats.list(ready_doc)[0]["id"])[-1]
    assert turn["stats"]["extra"]["generation"] == {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.2,
                                                    "seed": None}


def test_cancel_says_when_nothing_is_being_prepared(app, ready_doc):
    notice, *_ = app.client().predict(ready_doc, api_name="/cancel")
    assert "not being prepared" in notice


def test_an_app_served_with_logins_asks_for_them(app, ready_doc):
    """`squeeze serve --auth-file` hands its logins to Gradio: without one no client gets in; with one it does."""
    cfg = AppConfig(max_upload_mb=UPLOAD_MB, poll_s=0.5, max_new_tokens=16)
    demo = build_demo(app.engine, app.store, worker=app.worker, config=cfg)
    url = serve_locally(demo, auth=[("ana", "s3cret")], **launch_kwargs(cfg))
    try:
        with pytest.raises(Exception):  # noqa: B017, PT011 - refused at the door, whatever the client makes of it
            Client(url, verbose=False)
        with pytest.raises(Exception):  # noqa: B017, PT011
            Client(url, auth=("ana", "wrong"), verbose=False)
        client = Client(url, auth=("ana", "s3cret"), verbose=False)
        assert "ready" in open_doc(client, ready_doc)["status"]
    finally:
        demo.close()


def test_quests_scores_and_duos_views_as_the_browser_gets_them(app, ready_doc):
    """Through the client, as the page draws them: Quest's retrieved pages are scored for the answer's lookups too
    (not a column of zeros) and previewed with the document's words (not punctuation); duo's heatmap marks every
    head R or S, and its projection says in words why there is none (never "choose one of []")."""
    client = app.client()
    open_doc(client, ready_doc)
    out, _ = ask(client, "Who kept the light?", method="quest", sparsity=0.8, max_new=8)
    table = out["clusters"]
    answer, preview = table["headers"].index("score (answer)"), len(table["headers"]) - 1
    assert table["data"] and any(float(row[answer]) > 0 for row in table["data"])
    assert all(re.search(r"[A-Za-z]{3}", row[preview]) for row in table["data"])
    out, _ = ask(client, "Who kept the light?", method="duo", max_new=8)
    heat = figure(out["heatmap"])
    marks = [cell for trace in heat["data"] if trace["type"] == "heatmap" for row in trace.get("text") or []
             for cell in row]
    assert marks and set(marks) <= {"R", "S"}
    said = " ".join(a["text"] for a in figure(out["projection"])["layout"].get("annotations", []))
    assert "keeps whole heads" in said and "choose one of" not in said


def test_an_answer_that_runs_on_into_a_page_number_ends_before_it_in_the_chat(app, ready_doc, monkeypatch):
    """The model's tokens after its answer go on with a page footer's number (scripted here, in place of the tiny
    model's own, as a model that reads the document's pages writes it): the chat and the stored turn hold the answer
    alone."""
    from engine.context.turn import Turn

    answer = "The keeper was Ada Voss."
    tok = app.engine.lm.tokenizer
    said = tok(answer + "\n18\n\nThe lighthouse", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    script = iter(said)
    own = Turn.feed
    monkeypatch.setattr(Turn, "feed", lambda turn, token: own(turn, next(script)))
    client = app.client()
    open_doc(client, ready_doc)
    out, _ = ask(client, "Who kept the light?", method="full", max_new=max(8, len(said)))
    assert texts(out["chat"])[1] == answer
    turn = app.store.chats.turns(app.store.chats.list(ready_doc)[0]["id"])[-1]
    assert turn["answer"] == answer
