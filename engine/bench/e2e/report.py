"""The report: the whole run (the engine's phases, the peer, the bound), the ratios between them, one JSON line, and
the command line (`squeeze bench e2e`)."""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json

import torch

from engine.attention.follow import OFF
from engine.bench.e2e.bound import bound_ms, byte_bound, copy_bandwidth
from engine.bench.e2e.models import SHAPES, device_name, layers_per_device, open_model, peak_gib
from engine.bench.e2e.peer import measure_peer
from engine.bench.e2e.runner import PREFILL_TURNS, WARMUP_STEPS, context_ids, measure_engine, question_prompts
from engine.bench.e2e.timing import error_text, log
from engine.bench.settings import parse_settings
from engine.context.settings import ContextSettings
from engine.methods import METHODS, REGISTRY, build_order, make_method
from engine.model.catalog import DEFAULT_SPARSITY
from engine.model.compiled import compile_layers, wants_compile, warm_up
from kernels import centroid_ops, launch, union_ops
from kernels.dispatch import backend_for


def emit(doc: dict, out: str | None) -> None:
    """A benchmark's JSON document on stdout, and into `out` when given."""
    text = json.dumps(doc)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)

def _versions() -> dict:
    out = {"torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out

def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None

def add_ratios(out: dict) -> None:
    """Per method: the byte bound and the decode's distance to it, decode speedups against the engine's `full` and
    the peer's best decode, prefill speedups against `full`; the ingest against the peer's chunked prefill."""
    full = out["methods"].get("full", {})
    peer_ms = out["peer"].get("best_decode_ms")
    for row in out["methods"].values():
        if "decode_ms_median" not in row:
            continue
        if out["bandwidth_gbs"]:  # full's budget is 1: its recorder counts every key and no index
            row["bound_ms"] = round(bound_ms(out["bound"], row["kv_budget_decode"], out["bandwidth_gbs"]), 4)
            row["vs_bound"] = _ratio(row["decode_ms_median"], row["bound_ms"])
        row["speedup_vs_full"] = _ratio(full.get("decode_ms_median"), row["decode_ms_median"])
        row["speedup_vs_peer"] = _ratio(peer_ms, row["decode_ms_median"])
        row["prefill_speedup_vs_full"] = {n: _ratio(full.get("prefill_ms", {}).get(n), ms)
                                          for n, ms in row["prefill_ms"].items()}
    out["ingest"]["vs_peer_prefill"] = _ratio(out["ingest"]["seconds"], out["peer"].get("prefill_s"))

def run(args: argparse.Namespace) -> dict:
    """The whole benchmark; each phase's exception is recorded as an "error" string where it happened."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    methods = args.methods.split(",") if args.methods else list(METHODS)
    questions = [int(x) for x in args.questions.split(",") if x]
    settings = ContextSettings()
    method_settings = parse_settings(args.set)
    follow = None if args.follow else OFF
    out: dict = {"bench": "e2e", "device": device_name(device), "gpus": args.gpus,
                 **_versions(), "shape": args.shape if args.model is None else None, "model": args.model,
                 "follow": args.follow, "token_lookups": args.token_lookups}
    log(f"building {args.model or args.shape} on {device}" + (f" and {args.gpus - 1} more GPUs" * (args.gpus > 1)))
    lm = open_model(args.shape, args.model, args.device, args.gpus, args.token_layers)
    compiled_first = args.compile in ("auto", "on") and wants_compile(args.compile, lm)
    if compiled_first:  # as the product does by default on one GPU: compiled, then warmed up, once per process
        compile_layers(lm)
        out["compile_warm_up_s"] = round(warm_up(lm, backend_for(lm.device)), 3)
    backend = backend_for(lm.device)
    ids = context_ids(lm, args.context, args.document)
    fixed_len = int(ids.numel())
    out.update(model_id=lm.model_id, dtype=str(lm.dtype).removeprefix("torch."), backend=backend.name,
               config={"layers": lm.num_layers, "global_layers": lm.global_layers, "heads": lm.num_heads,
                       "kv_heads": lm.num_kv_heads, "head_dim": lm.head_dim, "vocab": lm.config.vocab_size,
                       "sliding_window": max((w for w in lm.sliding_windows if w is not None), default=None)},
               layers_per_device=layers_per_device(lm), context=fixed_len,
               settings={"sparsity": args.sparsity, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
                         "prefill_turns": args.prefill_turns, "questions": questions, "methods": methods,
                         "document": args.document, "peer_chunk": args.chunk, "graphs": args.graphs,
                         "compile": args.compile, "pdl": args.pdl, "fit_items": args.fit_items,
                         "one_launch": args.one_launch,
                         "token_layers": args.token_layers,
                         "context_settings": settings.as_dict(),
                         "method_settings": {m: make_method(m, method_settings.get(m)).settings.as_dict()
                                             for m in build_order(methods)},
                         # what a method learns per model (duo's gates) is not trained here: Method.stand_in
                         "stand_in": [m for m in build_order(methods) if REGISTRY[m].learns_per_model()]})
    try:
        log("copy bandwidth")
        out["bandwidth_gbs"] = round(copy_bandwidth(device), 1)
    except Exception as exc:  # noqa: BLE001
        out["bandwidth_gbs"] = None
        out["bandwidth_error"] = error_text(exc)
    if cuda:
        torch.cuda.empty_cache()

    prompts = question_prompts(lm, questions)
    new_tokens = questions[0] + (WARMUP_STEPS + 1 + args.steps) / 2  # mean over the timed decode steps
    out["bound"] = byte_bound(lm, fixed_len, new_tokens)
    out.update(measure_engine(lm, ids, settings, backend, methods, args.sparsity, prompts, args.steps, args.profile,
                              args.graphs, method_settings=method_settings, follow=follow,
                              token_lookups=args.token_lookups, prefill_turns=args.prefill_turns))
    if not args.peer:
        out["peer"] = {"skipped": "--no-peer"}
    elif args.gpus > 1:
        out["peer"] = {"skipped": "--gpus > 1: the peer runs on one GPU (torch.compile with CUDA graphs)"}
    elif not cuda:
        out["peer"] = {"skipped": "the peer runs on CUDA only (torch.compile with CUDA graphs)"}
    else:
        log("peer: transformers sdpa, StaticCache")
        try:
            out["peer"] = measure_peer(lm, ids, prompts[questions[0]], args.steps, args.chunk)
        except Exception as exc:  # noqa: BLE001
            out["peer"] = {"error": error_text(exc), "peak_gib": peak_gib(lm)}
        gc.collect()
        torch.cuda.empty_cache()
    add_ratios(out)

    out["compiled_layers"] = compiled_first
    if args.compile == "both":  # the same phases again with compiled layers, in this run (same-run ratios)
        log("compiling the decoder layers (engine.model.compiled); the engine's phases again")
        compile_layers(lm)
        out["compile_warm_up_s"] = round(warm_up(lm, backend_for(lm.device)), 3)
        compiled = measure_engine(lm, ids, settings, backend, methods, args.sparsity, prompts, args.steps,
                                  args.profile, args.graphs, tag="compiled ", method_settings=method_settings,
                                  follow=follow, token_lookups=args.token_lookups, prefill_turns=args.prefill_turns)
        add_ratios({**compiled, "peer": out["peer"], "bound": out["bound"], "bandwidth_gbs": out["bandwidth_gbs"]})
        for method, row in compiled["methods"].items():
            row["speedup_vs_uncompiled"] = _ratio(out["methods"].get(method, {}).get("decode_ms_median"),
                                                  row.get("decode_ms_median"))
        out["compiled"] = compiled
    return out

def failed(result: dict) -> bool:
    """Whether a phase failed: the bandwidth, the ingest, the session, a method or the peer (a peer whose compile
    failed but whose eager decode was timed has not)."""
    compiled = result.get("compiled", {})
    phases = [result.get("ingest", {}), result.get("session", {}), result.get("peer", {}),
              *result.get("methods", {}).values(), compiled.get("ingest", {}), compiled.get("session", {}),
              *compiled.get("methods", {}).values()]
    return "bandwidth_error" in result or any("error" in phase for phase in phases)

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="squeeze bench e2e", description="End-to-end benchmark: ingest, question "
                                     "prefill and decode through the engine's own API, beside plain transformers.")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b", help="random-weight shape")
    model.add_argument("--model", default=None, help="a transformers model id or path (engine.model.load.load_model)")
    parser.add_argument("--context", type=int, default=131072, help="fixed-context tokens (random ids)")
    parser.add_argument("--document", default=None, help="with --model: read this file instead (its first "
                                                         "--context tokens)")
    parser.add_argument("--methods", default="", help=f"comma-separated (default: all, {','.join(METHODS)})")
    parser.add_argument("--sparsity", type=float, default=DEFAULT_SPARSITY)
    parser.add_argument("--steps", type=int, default=32,
                        help=f"decode steps per turn; the first {WARMUP_STEPS} are warm-up, the median of the rest")
    parser.add_argument("--questions", default="64,1024", help="question prefill lengths; decode follows the first")
    parser.add_argument("--prefill-turns", type=int, default=PREFILL_TURNS,
                        help="timed one-token turns per question length (their prefills' median and fastest are "
                             "reported); more on a shared CPU, where a turn's time varies from one to the next")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gpus", type=int, default=1, help="CUDA: split the model's layers evenly over this many "
                                                            "GPUs with accelerate (as --device auto does)")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="replay decode steps from CUDA graphs where the model allows (one GPU)")
    parser.add_argument("--compile", nargs="?", const="on", default="auto", choices=("auto", "off", "on", "both"),
                        help="torch.compile the decoder layers around the engine's attention (engine.model.compiled): "
                             "'auto' (the product's default) on one GPU; 'both': the engine's phases without, then "
                             "with compiled layers, in one run")
    parser.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=True,
                        help="launch the engine's and inductor's kernels with programmatic dependent launch where the "
                             "GPU has it (kernels/launch.py; the product's default)")
    parser.add_argument("--one-launch", choices=centroid_ops.ONE_LAUNCH_MODES, default=centroid_ops.ONE_LAUNCH,
                        help="what a decode step's centroid lookup runs in one launch: nothing, both passes (the "
                             "product's default), both passes and the cut, or the whole lookup with its expansion "
                             "(kernels/centroid_ops.py ONE_LAUNCH)")
    parser.add_argument("--fit-items", action=argparse.BooleanOptionalAction, default=True,
                        help="a decode step's attention cuts a heavier selection than planned into longer items on "
                             "the device (kernels/union_ops.py FIT_ITEMS; the product's default)")
    parser.add_argument("--token-layers", action=argparse.BooleanOptionalAction, default=True,
                        help="a random-weight shape's one-token steps end each Llama-style layer in the gated down "
                             "product (engine.model.token_layer; the product's default)")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                        help="also time plain transformers (CUDA only)")
    parser.add_argument("--chunk", type=int, default=4096, help="the peer's prefill chunk")
    parser.add_argument("--set", action="append", default=[], metavar="METHOD.SETTING=VALUE",
                        help="a method's setting (repeatable), e.g. --set saap.buckets=1024")
    parser.add_argument("--follow", action=argparse.BooleanOptionalAction, default=True,
                        help="sparse steps also read the follow rows (engine.attention.follow)")
    parser.add_argument("--token-lookups", action="store_true",
                        help="a question's prefill looks up each of its tokens' keys on its own (engine.attention.function)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--profile", default=None, help="CUDA: append torch.profiler tables of each method's "
                                                        "decode steps and of each question's prefill to this "
                                                        "file (kernels and GPU time in the JSON)")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    if args.prefill_turns < 1:
        parser.error("--prefill-turns must be at least 1")
    if args.context < 2 or args.chunk < 1 or not args.questions.strip(","):
        parser.error("--context must be at least 2, --chunk positive and --questions non-empty")
    unknown = [m for m in args.methods.split(",") if m and m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if args.document and not args.model:
        parser.error("--document needs --model: a random-weight shape has no tokenizer")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    if args.gpus < 1 or (args.gpus > 1 and (args.device != "cuda" or torch.cuda.device_count() < args.gpus)):
        parser.error(f"--gpus {args.gpus}: needs --device cuda and that many GPUs "
                     f"({torch.cuda.device_count()} here)")
    launch.ENABLED = args.pdl  # before any kernel is compiled: the process's one setting
    union_ops.FIT_ITEMS = args.fit_items
    centroid_ops.ONE_LAUNCH = args.one_launch
    result = run(args)
    emit(result, args.out)
    return 1 if failed(result) else 0
