"""Many users at once through the engine's API: each asks its question over its own document at the same moment,
with every method, and the run reports what each user waited for and what the model served in all.

    squeeze bench serve [--model M | --shape llama3-8b --context 32768] [--device cpu|cuda|auto] [--users 4]
                        [--documents N] [--tokens 48] [--methods squeeze,full] [--batch B] [--steps N]
                        [--stagger] [--capture-after K] [--no-ahead] [--no-concurrent] [--split-gpu]
                        [--shared-launches] [--out FILE]

Documents: `assets/apache-2.0.txt` cut into --documents parts (default: one per user, each headed by its own number,
so that no two users share a context), each cut to the model's context; with --shape (a random-weight model of
engine.bench.e2e's shapes, read through the engine's byte tokenizer: its time is what it measures, its answers mean
nothing) each document is --context bytes (one token each) of that text, from an offset of its own; questions:
`assets/apache-2.0_questions.json`, user i the (i mod 6)-th; answers of --tokens at most each, or with --stagger of
fewer the later the user (so that turns leave a batch one by one). For each method, the users' contexts open (up to
the batch of them, as on a server that has answered on them before: opening one is its read from disk) and a first
round of two tokens a user at once compiles the batch's kernels (its wall time: `first_round_s`), then the turns are
asked at once from one thread each (engine.serve.service.Engine.stream: its scheduler answers up to its batch
together and queues the rest), and once more one after another (each alone, the reference: every answer must be the
same text). Per user: the time to its first piece of answer (queue wait included) and to its end, its tokens; in
all: time to first token p50 / p95, tokens per second of the whole run against one user at a time, the answers'
agreement with their lone answers, the time per answer token after the first (p50 over the users: together, at the
batch, and alone) beside the byte bound of a decode step at that batch and alone (the weights once, each turn's
share of its document's K/V), the scheduler's steps by batch size, the peak GPU memory where there is one; with
--steps N, the median decode step of one turn and of a full batch over the open contexts, their sequences attending
at once (their union kernels in launches of their own, planned for the whole GPU or for their share of it, or
shared; each step launched ahead or not) and one after another (batch_steps). The report goes to --out as the run
goes; it ends with one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from engine.bench.compiles import RunEvents
from engine.bench.e2e.bound import byte_bound, copy_bandwidth
from engine.bench.e2e.models import SHAPES, device_name, open_model
from engine.bench.e2e.runner import idle_time, kernel_spans
from engine.context import batching as turn_batching
from engine.context.batching import TurnBatch
from engine.context.turn import Answer
from engine.context.warm import warm_load
from engine.methods import make_method
from engine.model import batch as batching
from engine.model import capture
from engine.model.catalog import DEFAULT_SPARSITY
from engine.model.compiled import compile_layers, wants_compile
from engine.model.generate import generate_tokens
from engine.model.load import LoadedModel
from engine.serve.scheduler import Waiting, default_batch
from engine.serve.service import DEFAULT_METHODS, Engine
from engine.text.byte_tokens import byte_tokenizer
from kernels.dispatch import backend_for

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


def shape_documents(count: int, tokens: int, folder: Path) -> list[Path]:
    """`count` text files of `tokens` bytes each (one byte-tokenizer token each, up to the chat format's few), each
    headed by its number and going on with TEXT, repeated, from an offset of its own."""
    text = " ".join(TEXT.read_text().split())  # ASCII, one space between words: a byte is a token
    out = []
    for i in range(count):
        head = f"Part {i + 1} of the licence.\n\n"
        start = i * len(text) // max(count, 1)
        body = (text[start:] + " " + text) * (tokens // len(text) + 2)
        path = folder / f"part-{i + 1}.txt"
        path.write_text((head + body)[:tokens])
        out.append(path)
    return out


def shape_model(shape: str, device: str, compile: str, batch: int | None) -> LoadedModel:
    """SHAPES[shape]'s random-weight model on `device` ("auto": CUDA where there is one) with the byte tokenizer,
    its layers compiled where `compile` asks and warmed up for `batch` turns together (None: the engine's default),
    the default methods' kernels with them, as the product's load does on one GPU (engine.context.warm.warm_load)."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    lm = dataclasses.replace(open_model(shape, None, device), tokenizer=byte_tokenizer())
    if wants_compile(compile, lm):
        compile_layers(lm)
        warm_load(lm, backend_for(lm.device), batch if batch is not None else default_batch(lm.device),
                  [make_method(name) for name in DEFAULT_METHODS], DEFAULT_SPARSITY)
    return lm


class StageClock:
    """An ingest's progress callback that times its stages: `seconds` {stage: s}, each stage's start told on stderr
    (a 32K-token document of an 8B shape takes seconds per stage; users watching a long run see where it is)."""

    def __init__(self, label: str):
        self.label, self.seconds, self._stage, self._t = label, {}, None, time.perf_counter()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage == self._stage:
            return
        now = time.perf_counter()
        if self._stage is not None:
            self.seconds[self._stage] = round(self.seconds.get(self._stage, 0.0) + now - self._t, 3)
        self._stage, self._t = stage, now
        if stage:
            print(f"{self.label}: {stage}", file=sys.stderr, flush=True)

    def close(self) -> dict:
        """The stages' seconds, the last one ended now."""
        self("", 0, 1)
        return self.seconds


def step_ms(users: list[dict]) -> float:
    """The median over `users` of the time per answer token after the first, in ms."""
    return round(percentile([(u["total_s"] - u["first_s"]) / (u["tokens"] - 1) * 1e3 for u in users
                             if u["tokens"] > 1], 50), 3)


def steps_by_batch(timeline: list[tuple[str, int, float, float]], events: RunEvents | None = None,
                   slowest: int = 3) -> dict:
    """The scheduler's work while users were served together (Scheduler.timeline): each batch size's steps (count,
    median and largest ms: the first step after a turn joined or left captures the batch's step anew on a GPU), and
    the turns' starts (count, total seconds: the preparation, the prefill and the first token of each turn admitted,
    while the turns under way wait); with `events` (engine.bench.compiles.RunEvents over the same work) what was
    compiled and allocated, and the `slowest` steps each with the Triton kernels compiled during it."""
    steps: dict[int, list[float]] = {}
    for kind, turns, _, seconds in timeline:
        if kind == "step":
            steps.setdefault(turns, []).append(seconds * 1e3)
    starts = [seconds for kind, _, _, seconds in timeline if kind == "start"]
    out = {"steps": {str(n): {"count": len(v), "median_ms": round(percentile(v, 50), 3), "max_ms": round(max(v), 3)}
                     for n, v in sorted(steps.items())},
           "starts": {"count": len(starts), "total_s": round(sum(starts), 3)}}
    if events is not None:
        out["events"] = events.summary()
        worst = sorted((w for w in timeline if w[0] == "step"), key=lambda w: -w[3])[:slowest]
        out["slowest_steps"] = [{"turns": turns, "ms": round(seconds * 1e3, 3),
                                 "triton_compiles": events.compiled_between(start, start + seconds)}
                                for _, turns, start, seconds in worst]
    return out


def step_bounds(lm: LoadedModel, context: int, batch: int, kv_budget: float, new_tokens: float,
                bandwidth_gbs: float) -> dict:
    """The byte bound of a decode step in ms at `batch` turns and alone: the weights once, and each turn its
    document's global-layer K/V times kv_budget, its sliding windows and its new tokens' K/V."""
    bound = byte_bound(lm, context, new_tokens)
    per_turn = kv_budget * bound["global_fixed_kv_bytes"] + bound["sliding_window_kv_bytes"] + bound["new_kv_bytes"]
    ms = lambda turns: round((bound["weight_bytes"] + turns * per_turn) / (bandwidth_gbs * 1e9) * 1e3, 4)  # noqa: E731
    return {"batch": ms(batch), "alone": ms(1)}


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
    """One user's turn from its stream of events: {first_s (to its first answer token), total_s, waited (told it was
    queued), tokens, text}, times from t0. The times are the engine's own (the Answer's first_token_s and total_s,
    from the ask): a token shows no text (a random-weight model's, mostly) yet counts."""
    began = time.perf_counter() - t0
    waited, answer = False, None
    for event in events:
        if isinstance(event, Waiting):
            waited = True
        elif isinstance(event, Answer):
            answer = event
    timings = answer.stats.timings
    return {"first_s": round(began + timings["first_token_s"], 4), "total_s": round(began + timings["total_s"], 4),
            "waited": waited, "tokens": len(answer.tokens), "text": answer.text}


def staggered(tokens: int, users: int) -> list[int]:
    """Answer lengths that end at different steps: user i's at most tokens - i * tokens // (2 * users) (at least
    2), so that turns answered together leave one by one."""
    return [max(2, tokens - i * tokens // (2 * users)) for i in range(users)]


def ask_at_once(engine: Engine, asks: list[tuple[str, str]], method: str,
                most: list[int]) -> tuple[list[dict], float]:
    """Every (context, question) of `asks` asked at the same moment, one thread each, user i's answer at most
    most[i] tokens. Returns per user `listen`'s figures (times from the common start) and the wall time of the
    whole."""
    results: list[dict] = [{} for _ in asks]
    start = threading.Event()

    def user(i: int) -> None:
        context_id, question = asks[i]
        start.wait()
        results[i] = listen(engine.stream(context_id, question, method, SPARSITY, most[i]), time.perf_counter())

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def one_at_a_time(engine: Engine, asks: list[tuple[str, str]], method: str,
                  most: list[int]) -> tuple[list[dict], float]:
    """The same asks, each alone after the previous one: per user `listen`'s figures (times from the run's start:
    a user's wait for the ones before it included) and the wall time."""
    t0 = time.perf_counter()
    results = [listen(engine.stream(context_id, question, method, SPARSITY, tokens), t0)
               for (context_id, question), tokens in zip(asks, most)]
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
    parser.add_argument("--out", default=None, help="also write the JSON here, as the run goes (\"complete\" false "
                                                    "until it ends)")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None, least_tokens: int = 1) -> argparse.Namespace:
    """add_options' values, refused (exit 2, argparse's way) where they make no run."""
    args = parser.parse_args(argv)
    if args.users < 1 or args.tokens < least_tokens or args.documents < 0 or (args.batch is not None
                                                                              and args.batch < 1):
        parser.error(f"--users and --batch must be positive, --tokens at least {least_tokens}, --documents at "
                     "least 0")
    return args


def write_profile(profiler: cProfile.Profile, method: str, path: str) -> None:
    """Append the scheduler thread's profile of `method`'s users asked at once to `path`: its functions by their
    cumulative time, then by their own."""
    with open(path, "a") as f:
        f.write(f"=== {method}: the scheduler's steps, {len(profiler.getstats())} entries\n")
        stats = pstats.Stats(profiler, stream=f)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(30)


def checkpoint(result: dict, out: str | None) -> None:
    """The report so far written to `out`, marked incomplete: a run stopped midway (a time limit) leaves what it
    measured."""
    if out:
        Path(out).write_text(json.dumps({**result, "complete": False}, indent=1) + "\n")


def emit(result: dict, out: str | None) -> None:
    """Print the whole report (and write it to `out`)."""
    text = json.dumps({**result, "complete": True}, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    print(text)


def summary(users: list[dict], wall: float) -> dict:
    firsts = [u["first_s"] for u in users]
    tokens = sum(u["tokens"] for u in users)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / max(wall, 1e-9), 3),
            "first_s_p50": round(percentile(firsts, 50), 4), "first_s_p95": round(percentile(firsts, 95), 4)}


PROFILED_STEPS = 4  # steps of a full batch under torch.profiler in each way it attends (--kernel-profile)


def batch_steps(engine: Engine, contexts: list[str], question: str, method: str, steps: int,
                profile: str | None = None, out: dict | None = None, saved=lambda: None) -> dict:
    """The median ms of a decode step of one turn and of len(contexts) turns answered together (one over each
    context, already open: engine.context.batching.TurnBatch, captured steps on a GPU), with a batch's sequences
    attending at once on streams of their own ("concurrent_ms"; "split_ms" with each one's union kernels planned for
    its share of the GPU rather than the whole: engine.model.batch.SPLIT_GPU), so and with their union kernels in
    shared launches ("shared_ms"), one after another ("one_after_another_ms"; engine.model.batch.CONCURRENT,
    SHARED_LAUNCHES), and on streams with each step launched before the previous one's tokens are read back
    ("ahead_ms"; TurnBatch.ahead), `steps` steps each after two (the capture's); a step counts only while every turn
    is under way; and one turn through its session's own path ("session_ms" of one turn: session_step_ms). profile:
    also run PROFILED_STEPS more steps of the full batch in each way under torch.profiler, appending its kernels'
    table to that file, and report where the GPU was busy and idle in them (key "profiled": way -> ms a step).
    out: the dict the figures go into (returned), saved() called after each of them."""
    out = {} if out is None else out
    out.setdefault("1", {})["session_ms"] = session_step_ms(engine, contexts[0], question, method, steps)
    saved()
    modes = {"concurrent_ms": (True, False, False, False), "split_ms": (True, True, False, False),
             "ahead_ms": (True, False, False, True), "shared_ms": (True, False, True, False),
             "one_after_another_ms": (False, False, False, False)}
    settings = batching.CONCURRENT, batching.SPLIT_GPU, batching.SHARED_LAUNCHES
    try:
        for name, (concurrent, split, shared, ahead) in modes.items():
            batching.CONCURRENT, batching.SPLIT_GPU, batching.SHARED_LAUNCHES = concurrent, split, shared
            _time_way(engine, contexts, question, method, steps, profile, out, saved, name, ahead)
    finally:
        batching.CONCURRENT, batching.SPLIT_GPU, batching.SHARED_LAUNCHES = settings
    return out


def _time_way(engine: Engine, contexts: list[str], question: str, method: str, steps: int, profile: str | None,
              out: dict, saved, name: str, ahead: bool) -> None:
    """batch_steps' figures of one way a batch attends (`name`; the switches set by the caller), at one turn and at
    len(contexts) turns, into out[size][name]."""
    for size in sorted({1, len(contexts)}):
        turns = [engine.session(c).turn(question, method, SPARSITY, steps + 8 + PROFILED_STEPS)
                 for c in contexts[:size]]
        batch = TurnBatch(engine.lm, ahead=ahead)
        for turn in turns:
            batch.join(turn)
        times = []
        for _ in range(steps + 2):
            start = time.perf_counter()
            batch.step()  # (reads its tokens back: a step's whole time)
            if len(batch.turns) == size:
                times.append((time.perf_counter() - start) * 1e3)
        out.setdefault(str(size), {})[name] = round(percentile(times[2:], 50), 3) if len(times) > 2 else None
        saved()
        if profile is not None and size == len(contexts) and len(batch.turns) == size:
            out.setdefault("profiled", {})[name] = profiled_steps(batch, f"{method}, {size} turns, {name}", profile)
        for turn in list(batch.turns):
            batch.leave(turn)


def session_step_ms(engine: Engine, context: str, question: str, method: str, steps: int) -> float | None:
    """The median ms between two tokens of one turn answered through its session's own path (what a scheduler of
    max_batch 1 runs: engine.model.generate.generate_tokens, its steps replayed from CUDA graphs on a GPU), `steps`
    after two; None where its answer ended before."""
    turn = engine.session(context).turn(question, method, SPARSITY, steps + 3)
    stamps = []
    with torch.inference_mode():
        tokens = generate_tokens(engine.lm, turn.step, turn.prompt, turn.max_new_tokens, turn.sampler)
        for _ in tokens:
            stamps.append(time.perf_counter())
        tokens.close()
    turn.step.cache.reset_dynamic()
    gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])][2:]
    return round(percentile(gaps, 50), 3) if gaps else None


def profiled_steps(batch: TurnBatch, tag: str, path: str) -> dict:
    """PROFILED_STEPS steps of `batch` under torch.profiler: its table of kernels by GPU time appended to `path`
    (headed "== tag"); returns the GPU's busy and idle ms a step (engine.bench.e2e.runner.idle_time) and the
    kernels launched a step."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    device = batch.lm.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            batch.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    with open(path, "a") as f:
        f.write(f"== {tag}: {PROFILED_STEPS} steps\n")
        f.write(averages.table(sort_by="self_device_time_total", row_limit=25) + "\n")
    kernels = kernel_spans(prof)
    launched = sum(e.count for e in averages if e.device_type == torch.autograd.DeviceType.CUDA)
    return {**idle_time(kernels, PROFILED_STEPS), "kernels_per_step": launched / PROFILED_STEPS}


def run(args: argparse.Namespace) -> dict:
    asked = questions()
    with tempfile.TemporaryDirectory() as tmp:
        shaped = shape_model(args.shape, args.device, args.compile, args.batch) if args.shape else None
        engine = Engine(Path(tmp) / "cache", model=args.model, device=args.device, compile=args.compile,
                        max_batch=args.batch, lm=shaped)
        count = args.documents or args.users
        paths = (shape_documents(count, args.context, Path(tmp)) if shaped is not None
                 else documents(count, Path(tmp)))
        ingested, stages = [], []
        for i, path in enumerate(paths):
            clock = StageClock(f"document {i + 1} of {len(paths)}")
            ingested.append(engine.ingest(path, truncate=True, progress=clock))
            stages.append(clock.close())
        contexts = [c.context_id for c in ingested]
        lm = engine.lm
        asks = [(contexts[i % len(contexts)], asked[i % len(asked)]) for i in range(args.users)]
        batch = engine.scheduler.max_batch
        lengths = staggered(args.tokens, args.users) if args.stagger else [args.tokens] * args.users
        out = {"bench": "serve", "device": device_name(lm.device), "model": lm.model_id, "shape": args.shape,
               "users": args.users, "documents": len(contexts), "context_tokens": [c.tokens for c in ingested],
               "ingest_s": stages, "batch": batch, "tokens": args.tokens, "sparsity": SPARSITY,
               "tokens_per_user": lengths,
               "ahead": turn_batching.AHEAD, "capture_after": turn_batching.CAPTURE_AFTER,
               "capture_unwarmed": turn_batching.CAPTURE_UNWARMED, "sync_captures": capture.SYNC_FIRST,
               "concurrent": batching.CONCURRENT, "split_gpu": batching.SPLIT_GPU,
               "shared_launches": batching.SHARED_LAUNCHES,
               "bandwidth_gbs": round(copy_bandwidth(lm.device), 1),
               "methods": {}}
        context = max(out["context_tokens"])
        for method in args.methods.split(","):
            print(f"{method}: {args.users} users at once, then one at a time", file=sys.stderr, flush=True)
            engine.ask(asks[0][0], asks[0][1], method, SPARSITY, 2)  # builds what the method lacks, warms up
            for context_id in list(dict.fromkeys(c for c, _ in asks))[:batch]:  # open, as on a server that has
                engine.ensure_methods(context_id, [method])  # answered on them: every method's run alike
                engine.session(context_id)
            # what a server's first users at once pay: the batch's kernels compiled (once a process), so that the
            # timed run is the steady one
            _, first_wall = ask_at_once(engine, asks, method, [2] * len(asks))
            if lm.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(lm.device)
            profiler = engine.scheduler.profiler = cProfile.Profile() if args.profile else None
            timeline = engine.scheduler.timeline = []
            with RunEvents(lm.device) as events:
                together, wall = ask_at_once(engine, asks, method, lengths)
            engine.scheduler.profiler = engine.scheduler.timeline = None
            if profiler is not None:
                write_profile(profiler, method, args.profile)
            alone, alone_wall = one_at_a_time(engine, asks, method, lengths)
            entry = comparison(together, wall, alone, alone_wall)
            entry["step_ms"] = {"together": step_ms(together), "alone": step_ms(alone)}
            entry["scheduler"] = steps_by_batch(timeline, events)
            entry["first_round_s"] = round(first_wall, 3)
            budget = 1.0 if method == "full" else round(1.0 - SPARSITY, 6)
            entry["bound_ms"] = step_bounds(lm, context, min(batch, args.users), budget, args.tokens / 2,
                                            out["bandwidth_gbs"])
            if lm.device.type == "cuda":
                entry["peak_gib"] = round(torch.cuda.max_memory_allocated(lm.device) / 2**30, 3)
            out["methods"][method] = entry
            checkpoint(out, args.out)
            if args.steps:
                batch_steps(engine, contexts[: min(batch, len(contexts))], asked[0], method, args.steps,
                            args.kernel_profile, entry.setdefault("batch_steps", {}), lambda: checkpoint(out, args.out))
        engine.store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="squeeze bench serve", description=__doc__.split("\n\n")[0])
    add_options(parser, tokens=48)
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="a random-weight model of this shape instead of --model (its time is what it measures)")
    parser.add_argument("--context", type=int, default=32768, help="with --shape: each document's tokens")
    parser.add_argument("--profile", default=None,
                        help="write the scheduler thread's Python profile of each method's users at once to this file")
    parser.add_argument("--stagger", action="store_true",
                        help="user i's answer at most tokens - i * tokens // (2 * users) tokens: answers end at "
                             "different steps, so that turns leave the batch one by one")
    parser.add_argument("--steps", type=int, default=0,
                        help="also time this many decode steps of one turn and of a batch of turns over the open "
                             "contexts, sequences attending at once and one after another (batch_steps)")
    parser.add_argument("--kernel-profile", default=None,
                        help="with --steps: append a torch.profiler table of a full batch's steps in each way it "
                             "attends to this file, and report the GPU's busy and idle time in them")
    parser.add_argument("--concurrent", action=argparse.BooleanOptionalAction, default=True,
                        help="a batch's sequences attend at once, each on a CUDA stream of its own "
                             "(engine.model.batch.CONCURRENT; the product's default)")
    parser.add_argument("--split-gpu", action=argparse.BooleanOptionalAction, default=batching.SPLIT_GPU,
                        help="a batch's sequences attending at once each plan their union kernels for their share "
                             "of the GPU's workers (engine.model.batch.SPLIT_GPU)")
    parser.add_argument("--shared-launches", action=argparse.BooleanOptionalAction, default=batching.SHARED_LAUNCHES,
                        help="a batch's attentions at a global layer share the union kernels' launches "
                             "(engine.model.batch.SHARED_LAUNCHES)")
    parser.add_argument("--capture-after", type=int, default=turn_batching.CAPTURE_AFTER,
                        help="a GPU's batch runs this many steps eagerly after its turns change before it captures "
                             "their step (engine.context.batching.CAPTURE_AFTER)")
    parser.add_argument("--capture-unwarmed", action=argparse.BooleanOptionalAction,
                        default=turn_batching.CAPTURE_UNWARMED,
                        help="a GPU's batch whose turns all ran in its last captured step (one left) captures "
                             "their step without a warm step first (engine.context.batching.CAPTURE_UNWARMED)")
    parser.add_argument("--sync-captures", action=argparse.BooleanOptionalAction, default=capture.SYNC_FIRST,
                        help="every CUDA graph capture first synchronises the device and empties its memory caches, "
                             "as torch.cuda.graph does (engine.model.capture.SYNC_FIRST)")
    parser.add_argument("--ahead", action=argparse.BooleanOptionalAction, default=turn_batching.AHEAD,
                        help="a GPU's batch launches each step before reading the previous one's tokens back "
                             "(engine.context.batching.AHEAD)")
    args = parse(parser, argv)
    if args.capture_after < 0:
        parser.error("--capture-after must be at least 0")
    turn_batching.AHEAD = args.ahead
    turn_batching.CAPTURE_AFTER = args.capture_after
    turn_batching.CAPTURE_UNWARMED = args.capture_unwarmed
    capture.SYNC_FIRST = args.sync_captures
    batching.CONCURRENT = args.concurrent
    batching.SPLIT_GPU = args.split_gpu
    batching.SHARED_LAUNCHES = args.shared_launches
    if args.shape and args.model:
        parser.error("--shape and --model exclude each other")
    if args.shape and args.context < 64:
        parser.error("--context must be at least 64 tokens")
    emit(run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
