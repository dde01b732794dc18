"""Many users at once through the app's HTTP API: each opens its own document in its own browser session
(`gradio_client`), starts a chat and asks at the same moment as the others; the run reports what each user waited
for and what the app served in all.

    squeeze bench users [--model M] [--device cpu|cuda|auto] [--users 4] [--documents N] [--tokens 32]
                        [--methods squeeze,full] [--batch B] [--out FILE]

The documents, questions, options and report are `squeeze bench serve`'s (engine/bench/serve.py, the `workload`
module the command line hands over); the app is served on this machine on a free port, with its own engine and
cache in a temporary folder. For each method the users ask at once (the app hands their questions to the engine's
scheduler, which answers up to its batch together), then once more one after another through the same API (each
alone: every answer must be the same text). Per user: the time from its ask to the first piece of answer the app
streams back and to the end, and the answer's tokens (its text tokenized again); in all: p50 / p95 of the first,
tokens per second against one user at a time, the answers' agreement with their lone answers. Ends with one JSON
document on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

from app.config import MAX_NEW_MIN, AppConfig
from app.waits import queue_text

SPARSITY = AppConfig().sparsity  # the app's default, as a user who leaves the slider where it is asks
INDEX_SETTINGS = (0.05, 0.01)  # the app's centroid-ratio and level-1 sliders at their defaults
WAITING = queue_text(0).split(":")[0]  # how a queued question's place begins, in its answer's place


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answer_text(chat: list) -> str:
    """The text of the last assistant message of a Chatbot value (messages as dicts whose content is a string or a
    list of parts, Gradio 6's {"type": "text", "text": ...}; or [user, assistant] pairs)."""
    for message in reversed(chat or []):
        if isinstance(message, dict) and message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(part.get("text", "") for part in content if isinstance(part, dict))
            return content if isinstance(content, str) else ""
        if isinstance(message, (list, tuple)) and len(message) == 2:
            return message[1] or ""
    return ""


def ask(url: str, doc_id: str, question: str, method: str, tokens: int, ready: threading.Event | None = None,
        t0: list[float] | None = None) -> dict:
    """One user: a session on `url` opens the document and a new chat, waits for `ready` (all users at once), then
    asks. Returns {first_s (to the first piece of answer; its end if none), total_s, waited (told its place in
    the queue), text}, times from its ask (or from t0[0] when given: a shared start)."""
    from gradio_client import Client  # noqa: PLC0415 - imported with the app's own dependencies

    client = Client(url, verbose=False)
    client.predict(doc_id, method, SPARSITY, api_name="/open_document")
    client.predict(api_name="/new_chat")
    if ready is not None:
        ready.wait()
    start = t0[0] if t0 else time.perf_counter()
    job = client.submit(question, [], method, SPARSITY, *INDEX_SETTINGS, False, tokens, 0.0, 1.0, 1.0,
                        api_name="/ask")
    first, text, waited = None, "", False
    for update in job:
        text = answer_text(update[0]) if update else text
        if text.startswith(WAITING):
            waited = True
        elif first is None and text.strip():
            first = time.perf_counter() - start
    text = answer_text(job.result()[0])  # (an error of the app's is raised here)
    total = time.perf_counter() - start
    return {"first_s": round(first if first is not None else total, 4), "total_s": round(total, 4),
            "waited": waited, "text": text.strip()}


def run(args: argparse.Namespace, workload: ModuleType) -> dict:
    """workload: engine.bench.serve (its documents(count, folder), questions() and comparison)."""
    from app.demo import build_demo, launch_kwargs  # noqa: PLC0415 - gradio is slow to import
    from engine.serve import Engine, IngestWorker  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(Path(tmp) / "cache", model=args.model, device=args.device, compile=args.compile,
                        max_batch=args.batch)
        reports = [engine.ingest(p, truncate=True)
                   for p in workload.documents(args.documents or args.users, Path(tmp))]
        questions = workload.questions()
        config = AppConfig(max_new_tokens=args.tokens, questions_at_once=max(AppConfig().questions_at_once,
                                                                              args.users))
        demo = build_demo(engine, engine.store, worker=IngestWorker(engine), config=config)
        _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                                quiet=True, **launch_kwargs(config))
        lm = engine.lm
        users = [(reports[i % len(reports)], questions[i % len(questions)]) for i in range(args.users)]
        out = {"bench": "users", "through": "the app's HTTP API (gradio_client)", "device": str(lm.device),
               "model": lm.model_id, "users": args.users, "documents": len(reports),
               "batch": engine.scheduler.max_batch, "tokens": args.tokens, "sparsity": SPARSITY, "methods": {}}
        try:
            for method in args.methods.split(","):
                engine.ask(users[0][0].context_id, users[0][1], method, SPARSITY, 2)  # builds what it lacks
                together, wall = _at_once(url, users, method, args.tokens)
                t0 = time.perf_counter()
                alone = [ask(url, report.doc_id, question, method, args.tokens) for report, question in users]
                alone_wall = time.perf_counter() - t0
                for u in (*together, *alone):  # the answer's tokens: its text tokenized again
                    u["tokens"] = len(lm.tokenizer(u["text"], add_special_tokens=False).input_ids)
                out["methods"][method] = workload.comparison(together, wall, alone, alone_wall)
        finally:
            with contextlib.redirect_stdout(sys.stderr):  # (Gradio says it closes the server: not the report's)
                demo.close()
            demo.services.worker.close()
            engine.store.close()
    return out


def _at_once(url: str, users: list, method: str, tokens: int) -> tuple[list[dict], float]:
    """Every user's ask at the same moment, one session and thread each: per user `ask`'s figures (times from the
    common start) and the wall time of the whole."""
    results: list[dict] = [{} for _ in users]
    ready, t0 = threading.Event(), [0.0]

    def user(i: int) -> None:
        report, question = users[i]
        results[i] = ask(url, report.doc_id, question, method, tokens, ready, t0)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(users))]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every session connected and on its document (what it does before `ready` takes < 1 s here)
    t0[0] = time.perf_counter()
    ready.set()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0[0]


def main(argv: list[str] | None, workload: ModuleType) -> int:
    """The command (`squeeze bench users`) over `workload` (engine.bench.serve, handed over by the command line)."""
    parser = argparse.ArgumentParser(prog="squeeze bench users", description=__doc__.split("\n\n")[0])
    workload.add_options(parser, tokens=32, least_tokens=MAX_NEW_MIN)  # (the app's slider offers no fewer)
    args = workload.parse(parser, argv, least_tokens=MAX_NEW_MIN)
    workload.emit(run(args, workload), args.out)
    return 0
