"""Many users at once through the engine's API: each asks its question over its own document at the same moment,
with every method, and the run reports what each user waited for and what the model served in all.

    squeeze bench serve [--model M] [--device cpu|cuda|auto] [--users 4] [--documents N] [--tokens 48]
                        [--methods squeeze,full] [--batch B] [--out FILE]

Documents: `assets/apache-2.0.txt` cut into --documents parts (default: one per user, each headed by its own
number, so that no two users share a context), each cut to the model's context; questions:
`assets/apache-2.0_questions.json`, user i the (i mod 6)-th. For each method the users' turns are asked at once
from one thread each (engine.serve.service.Engine.stream: its scheduler answers up to its batch together and
queues the rest), and once more one after another (each alone, the reference: every answer must be the same text).
Per user: the time to its first piece of answer (queue wait included) and to its end, its tokens; in all: time to
first token p50 / p95, tokens per second of the whole run against one user at a time, the answers' agreement with
their lone answers, the peak GPU memory where there is one. Ends with one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from engine.context.turn import Answer, Delta
from engine.serve.scheduler import Waiting
from engine.serve.service import Engine

ASSETS = Path(__file__).resolve().parents[2] / "assets"
TEXT = ASSETS / "apache-2.0.txt"
QUESTIONS = ASSETS / "apache-2.0_questions.json"
SPARSITY = 0.9


def documents(count: int, folder: Path) -> list[Path]:
    """`count` text files cut from TEXT in equal parts of its paragraphs, each headed by its number."""
    paragraphs = [p for p in TEXT.read_text().split("\n\n") if p.strip()]
    per = max(1, len(paragraphs) // count)
    out = []
    for i in range(count):
        part = paragraphs[i * per: (i + 1) * per] or paragraphs[-per:]
        path = folder / f"part-{i + 1}.txt"
        path.write_text(f"Part {i + 1} of the licence.\n\n" + "\n\n".join(part))
        out.append(path)
    return out


def questions() -> list[str]:
    """The users' questions: QUESTIONS' in order."""
    return [q["question"] for q in json.loads(QUESTIONS.read_text())]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between the nearest ranks."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def listen(events, t0: float) -> dict:
    """One user's turn from its stream of events: {first_s (to its first piece of answer; its end if none),
    total_s, waited (told it was queued), tokens, text}, times from t0."""
    first, waited, answer = None, False, None
    for event in events:
        if isinstance(event, Waiting):
            waited = True
        elif isinstance(event, Delta) and first is None:
            first = time.perf_counter() - t0
        elif isinstance(event, Answer):
            answer = event
    total = time.perf_counter() - t0
    return {"first_s": round(first if first is not None else total, 4), "total_s": round(total, 4),
            "waited": waited, "tokens": len(answer.tokens), "text": answer.text}


def ask_at_once(engine: Engine, asks: list[tuple[str, str]], method: str, tokens: int) -> tuple[list[dict], float]:
    """Every (context, question) of `asks` asked at the same moment, one thread each. Returns per user `listen`'s
    figures (times from the common start) and the wall time of the whole."""
    results: list[dict] = [{} for _ in asks]
    start = threading.Event()

    def user(i: int) -> None:
        context_id, question = asks[i]
        start.wait()
        results[i] = listen(engine.stream(context_id, question, method, SPARSITY, tokens), time.perf_counter())

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def one_at_a_time(engine: Engine, asks: list[tuple[str, str]], method: str, tokens: int) -> tuple[list[dict], float]:
    """The same asks, each alone after the previous one: per user `listen`'s figures (times from the run's start:
    a user's wait for the ones before it included) and the wall time."""
    t0 = time.perf_counter()
    results = [listen(engine.stream(context_id, question, method, SPARSITY, tokens), t0)
               for context_id, question in asks]
    return results, time.perf_counter() - t0


def comparison(together: list[dict], wall: float, alone: list[dict], alone_wall: float) -> dict:
    """A method's report: per-user figures ({first_s, total_s, waited, tokens, text}) of the users asked at once and
    asked one after another, each run's wall time -> the summaries, the answers alike, the users told to wait, the
    per-user figures of the run at once and its throughput against the other."""
    entry = {"together": summary(together, wall), "alone": summary(alone, alone_wall),
             "same_answers": sum(a["text"] == b["text"] for a, b in zip(together, alone)),
             "users_waited": sum(u["waited"] for u in together),
             "per_user": [{k: v for k, v in u.items() if k != "text"} for u in together]}
    entry["throughput_vs_alone"] = round(entry["together"]["tokens_per_s"]
                                         / max(entry["alone"]["tokens_per_s"], 1e-9), 3)
    return entry


def add_options(parser: argparse.ArgumentParser, tokens: int, least_tokens: int = 1) -> None:
    """The options both many-user benchmarks take (this one and the app's, `squeeze bench users`)."""
    parser.add_argument("--model", default=None, help="a transformers model id or path (default: the embedded one)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--documents", type=int, default=0, help="documents the users share (0: one each)")
    parser.add_argument("--tokens", type=int, default=tokens, help=f"answer tokens at most (at least {least_tokens})")
    parser.add_argument("--methods", default="squeeze,full")
    parser.add_argument("--batch", type=int, default=None, help="turns answered together (default: the engine's)")
    parser.add_argument("--out", default=None, help="also write the JSON here")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None, least_tokens: int = 1) -> argparse.Namespace:
    """add_options' values, refused (exit 2, argparse's way) where they make no run."""
    args = parser.parse_args(argv)
    if args.users < 1 or args.tokens < least_tokens or args.documents < 0 or (args.batch is not None
                                                                              and args.batch < 1):
        parser.error(f"--users and --batch must be positive, --tokens at least {least_tokens}, --documents at "
                     "least 0")
    return args


def emit(result: dict, out: str | None) -> None:
    """Print the report (and write it to `out`)."""
    text = json.dumps(result, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    print(text)


def summary(users: list[dict], wall: float) -> dict:
    firsts = [u["first_s"] for u in users]
    tokens = sum(u["tokens"] for u in users)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / max(wall, 1e-9), 3),
            "first_s_p50": round(percentile(firsts, 50), 4), "first_s_p95": round(percentile(firsts, 95), 4)}


def run(args: argparse.Namespace) -> dict:
    asked = questions()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(Path(tmp) / "cache", model=args.model, device=args.device, compile=args.compile,
                        max_batch=args.batch)
        paths = documents(args.documents or args.users, Path(tmp))
        contexts = [engine.ingest(p, truncate=True).context_id for p in paths]
        lm = engine.lm
        asks = [(contexts[i % len(contexts)], asked[i % len(asked)]) for i in range(args.users)]
        out = {"bench": "serve", "device": torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda"
               else "cpu", "model": lm.model_id, "users": args.users, "documents": len(contexts),
               "batch": engine.scheduler.max_batch, "tokens": args.tokens, "sparsity": SPARSITY, "methods": {}}
        for method in args.methods.split(","):
            engine.ask(asks[0][0], asks[0][1], method, SPARSITY, 2)  # builds what the method lacks, warms up
            if lm.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(lm.device)
            together, wall = ask_at_once(engine, asks, method, args.tokens)
            alone, alone_wall = one_at_a_time(engine, asks, method, args.tokens)
            entry = comparison(together, wall, alone, alone_wall)
            if lm.device.type == "cuda":
                entry["peak_gib"] = round(torch.cuda.max_memory_allocated(lm.device) / 2**30, 3)
            out["methods"][method] = entry
        engine.store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="squeeze bench serve", description=__doc__.split("\n\n")[0])
    add_options(parser, tokens=48)
    args = parse(parser, argv)
    emit(run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
