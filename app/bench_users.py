"""Many users at once through the app's HTTP API: each opens its own document in its own browser session
(`gradio_client`, in a process of its own: app/user_session.py), starts a chat and asks at the same moment as the
others; the run reports what each user waited for and what the app served in all.

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
import multiprocessing
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

from app.config import MAX_NEW_MIN, REPETITIONS, TEMPERATURES, TOP_PS, AppConfig
from app.user_session import ask, user_process
from app.waits import queue_text

DEFAULTS = AppConfig()  # what the app's controls show until a user moves them
SPARSITY = DEFAULTS.sparsity
WAITING = queue_text(0).split(":")[0]  # how a queued question's place begins, in its answer's place
USER_START_S = 120.0  # a user's process starts, connects and opens its document within this
USER_ANSWER_S = 1800.0  # and is answered within this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def controls(method: str, tokens: int) -> tuple:
    """The /ask endpoint's values after the question and the history: a user who leaves every control but the
    method and the answer's length where it is (greedy; the Advanced sliders where app/chat.py starts them)."""
    return (method, SPARSITY, DEFAULTS.centroid_ratio, DEFAULTS.level1_ratio, False, tokens, TEMPERATURES[0],
            TOP_PS[1], REPETITIONS[0])


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
        config = AppConfig(max_new_tokens=args.tokens, questions_at_once=max(DEFAULTS.questions_at_once, args.users))
        demo = build_demo(engine, engine.store, worker=IngestWorker(engine), config=config)
        _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                                quiet=True, **launch_kwargs(config, engine.store))
        lm = engine.lm
        users = [(reports[i % len(reports)], questions[i % len(questions)]) for i in range(args.users)]
        out = {"bench": "users", "through": "the app's HTTP API (gradio_client)", "device": str(lm.device),
               "model": lm.model_id, "users": args.users, "documents": len(reports),
               "batch": engine.scheduler.max_batch, "tokens": args.tokens, "sparsity": SPARSITY, "methods": {}}
        try:
            for method in args.methods.split(","):
                engine.ask(users[0][0].context_id, users[0][1], method, SPARSITY, 2)  # builds what it lacks
                together, wall = _at_once(url, users, controls(method, args.tokens))
                t0 = time.perf_counter()
                alone = [ask(url, report.doc_id, question, controls(method, args.tokens), WAITING)
                         for report, question in users]
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


def _at_once(url: str, users: list, asked: tuple) -> tuple[list[dict], float]:
    """Every user's ask at the same moment, each in a process of its own (app/user_session.py: its client takes no
    time from this process, which serves the app): per user `ask`'s figures and the wall time from the common
    start to the last answer."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(users) + 1), ctx.Queue()
    processes = [ctx.Process(target=user_process, args=(i, url, report.doc_id, question, asked, WAITING, barrier,
                                                        results), daemon=True)
                 for i, (report, question) in enumerate(users)]
    for p in processes:
        p.start()
    try:
        barrier.wait(timeout=USER_START_S)  # every user connected and on its document
    except threading.BrokenBarrierError:  # a user failed before its question (or never came)
        raise RuntimeError(f"users failed before asking: {[results.get(timeout=5) for _ in range(results.qsize())]}")
    t0 = time.perf_counter()
    got = dict(results.get(timeout=USER_ANSWER_S) for _ in processes)
    wall = time.perf_counter() - t0
    for p in processes:
        p.join(timeout=USER_START_S)
    failed = {i: r["error"] for i, r in got.items() if "error" in r}
    if failed:
        raise RuntimeError(f"users failed: {failed}")
    return [got[i] for i in range(len(users))], wall


def main(argv: list[str] | None, workload: ModuleType) -> int:
    """The command (`squeeze bench users`) over `workload` (engine.bench.serve, handed over by the command line)."""
    parser = argparse.ArgumentParser(prog="squeeze bench users", description=__doc__.split("\n\n")[0])
    workload.add_options(parser, tokens=32, least_tokens=MAX_NEW_MIN)  # (the app's slider offers no fewer)
    args = workload.parse(parser, argv, least_tokens=MAX_NEW_MIN)
    workload.emit(run(args, workload), args.out)
    return 0
