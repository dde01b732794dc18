"""`squeeze`: ingest documents, ask questions, list and delete cached documents. JSON output is a public interface."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from dataclasses import replace

from app.method_flags import METHOD_SETTINGS, RANGES, Range, unordered
from engine.model.catalog import (
    DEFAULT_METHOD,
    DEFAULT_SPARSITY,
    EMBEDDED_MODEL,
    MAX_SPARSITY,
    METHODS,
    SPARSE_METHODS,
    TRAINED_METHODS,
    GenerationOptions,
    default_cache_dir,
)

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # every control character but tab and newline


def terminal_text(text: str) -> str:
    """`text` as the terminal should print it: control characters (an escape sequence in a question, a file name or an
    answer would move the cursor, recolour or retitle the terminal) written as \\xNN."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _progress(enabled: bool):
    state = {"start": time.perf_counter(), "last": ""}

    def report(stage: str, done: int, total: int) -> None:
        if not enabled:
            return
        line = f"[{time.perf_counter() - state['start']:6.1f}s] {stage} {done}/{total}"
        if line != state["last"]:
            print(line, file=sys.stderr, flush=True)
            state["last"] = line

    return report


SHOWN_VALUES = 64  # an artifact of at most this many values is printed whole by `squeeze train`


@contextlib.contextmanager
def _engine(args):
    """The engine of the command's cache and model (the model loads when first needed, each step on stderr), one turn
    at a time; its index is closed when the command ends (what it wrote is then in index.db itself, none left in a
    -wal file)."""
    from engine.serve import Engine  # noqa: PLC0415 - keep `squeeze --help` fast

    report = _progress(not args.quiet)
    engine = Engine(args.cache_dir, model=args.model, device=args.device, compile=args.compile,
                    methods=_method_settings(args), max_batch=1,  # (a command asks one question at a time)
                    load_progress=lambda step, done, total: report(f"loading model: {step}", done, total))
    try:
        yield engine
    finally:
        engine.store.close()


# Short names kept for the settings that had them before each method had its own (--squeeze-centroid-ratio, ...).
ALIASES = {("squeeze", "centroid_ratio"): "--centroid-ratio", ("hsqueeze", "level1_ratio"): "--level1-ratio",
           ("hsqueeze", "level1_prune"): "--level1-prune"}


def _dest(method: str, name: str) -> str:
    return f"setting__{method}__{name}"


def _method_settings(args) -> dict[str, dict]:
    """Each method's settings named on the command line (method -> {field: value}); the others stay at defaults."""
    out: dict[str, dict] = {}
    for method, settings in METHOD_SETTINGS.items():
        for name in settings:
            value = getattr(args, _dest(method, name), None)
            if value is not None:
                out.setdefault(method, {})[name] = value
    return out


def _ranged(kind: type, allowed: Range | None):
    """An argparse type: `kind` (int, float, str) of the text, refused outside `allowed` (None: any)."""
    def convert(text: str):
        value = kind(text)  # a ValueError: argparse says "invalid int value: ..."
        if allowed is not None and not allowed.allows(value):
            raise argparse.ArgumentTypeError(f"must be {allowed.text()}, got {text}")
        return value
    convert.__name__ = kind.__name__  # what argparse names in "invalid ... value"
    return convert


def _method_options() -> argparse.ArgumentParser:
    """Every registered method's settings as options `--{method}-{setting}` (unset: the method's default); a
    method's index is built, or rebuilt, with them when a question asks for the method. Typed from
    app/method_flags.py (no method loaded): a wrong value is refused before torch loads."""
    p = argparse.ArgumentParser(add_help=False)
    group = p.add_argument_group("method settings (each method's index is built with its own)")
    for method, settings in METHOD_SETTINGS.items():
        for name, default in settings.items():
            flags = [f"--{method}-{name.replace('_', '-')}"] + [a for a in [ALIASES.get((method, name))] if a]
            group.add_argument(*flags, dest=_dest(method, name), type=_flag if isinstance(default, bool)
                               else _ranged(type(default), RANGES.get((method, name))), default=None,
                               metavar=type(default).__name__.upper(), help=f"default {default}")
    return p


def cmd_ingest(args) -> int:
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in SPARSE_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(SPARSE_METHODS)}")
    with _engine(args) as engine:
        report = engine.ingest(args.path, truncate=args.truncate, progress=_progress(not args.quiet),
                               methods=methods)
    out = report.to_json()
    print(json.dumps(out) if args.json else
          f"{out['doc_id']}  {out['tokens']} tokens, {out['pages']} page(s), context {out['context_id']}"
          f"{' (cached)' if out['cached'] else ''} in {out['seconds']:.1f}s")
    return 0


def cmd_ask(args) -> int:
    from engine.serve import EMPTY_ANSWER, Answer, Delta  # noqa: PLC0415

    options = GenerationOptions(temperature=args.temperature, top_p=args.top_p,  # (refused before the model loads)
                                repetition_penalty=args.repetition_penalty, seed=args.seed)
    progress = _progress(not args.quiet)
    answer = None
    with _engine(args) as engine:
        context_id = engine.resolve(args.doc, truncate=args.truncate, progress=progress)
        for event in engine.stream(context_id, args.question, args.method, args.sparsity, args.max_new_tokens,
                                   progress=progress, options=options):
            if isinstance(event, Delta) and not args.json:
                print(terminal_text(event.text), end="", flush=True)
            elif isinstance(event, Answer):
                answer = event
    stats = answer.stats.to_json()
    if args.json:
        print(json.dumps({"answer": answer.text, "empty": answer.empty, "context_id": context_id, **stats,
                          "follow": answer.follow}))
    else:
        print(EMPTY_ANSWER if answer.empty else "")
        print(f"[{stats['method']} sparsity={stats['sparsity']} kv_budget={stats['kv_budget']:.3f} "
              f"(question {stats['kv_budget_prefill']:.3f}, answer {stats['kv_budget_decode']:.3f}) "
              f"follow rows {len(answer.follow)}, first token {stats['timings']['first_token_s']:.2f}s, "
              f"{stats['timings']['tokens_per_s']:.1f} tok/s]",
              file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    """Learn a method's model-level artifacts now (e.g. DuoAttention's gates); stored for every later document."""
    with _engine(args) as engine:
        start = time.perf_counter()
        found = engine.prepared(args.method, _progress(not args.quiet))
    out = {"method": args.method, "model": engine.model_id, "seconds": round(time.perf_counter() - start, 1),
           "artifacts": {name: _summary(t) for name, t in sorted(found.items())}}
    print(json.dumps(out) if args.json else "\n".join(f"{name}: {values}" for name, values in out["artifacts"].items()))
    return 0


def _summary(t) -> list | dict:
    """An artifact as the train command shows it: its values when few (gates), else its shape and statistics."""
    if t.numel() <= SHOWN_VALUES:
        return [round(float(x), 4) for x in t.flatten()]
    f = t.float()
    return {"shape": list(t.shape), "mean": round(float(f.mean()), 4), "std": round(float(f.std()), 4)}


def _flag(text: str) -> bool:
    """A boolean setting's value on the command line."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _store(args):
    """The cache's index alone (list and delete need no model: `squeeze list` answers in a fraction of a second)."""
    from storage import Store  # noqa: PLC0415

    return Store(args.cache_dir or default_cache_dir())


def cmd_list(args) -> int:
    store = _store(args)
    try:  # an ingest whose process is gone is told as failed ("interrupted"), not as running
        store.jobs.recover_interrupted()
    except Exception:  # noqa: BLE001 - a cache this user cannot write is still listed as it is
        pass
    docs = store.documents.list()
    if args.json:
        print(json.dumps(docs, default=str))
    else:
        for d in docs:
            print(f"{d['id']}  {d.get('status') or '-':8} {d.get('tokens') or 0:>7} tok  {d['pages']:>4} p  {d['name']}")
    return 0


def cmd_delete(args) -> int:
    store = _store(args)
    doc = store.documents.find(args.doc_id)
    store.documents.delete(doc["id"])
    print(f"deleted {doc['id']}")
    return 0


def cmd_repair(args) -> int:
    """Rebuild a damaged cache index from the rows it can still read (storage.salvage_index)."""
    from storage import salvage_index  # noqa: PLC0415

    report = salvage_index(args.cache_dir or default_cache_dir())
    if args.json:
        print(json.dumps({"copied": report.copied, "lost": report.lost, "damaged": str(report.damaged)}))
    else:
        print("\n".join(report.lines()))
    return 0


def cmd_serve(args) -> int:
    from app.serve import check_exposure, parse_auth  # noqa: PLC0415 - (no gradio, no torch: checked first)

    auth = parse_auth(args.auth, args.auth_file)
    check_exposure(args.host, auth)
    from app.config import AppConfig  # noqa: PLC0415 - gradio loads only for this command
    from app.serve import serve  # noqa: PLC0415

    config = AppConfig(max_upload_mb=args.max_upload_mb)
    if args.batch is not None:  # the app hands the engine at least as many questions as it answers together
        config = replace(config, questions_at_once=max(config.questions_at_once, args.batch))
    serve(args.host, args.port, model=args.model, cache_dir=args.cache_dir, device=args.device, config=config,
          compile=args.compile, auth=auth, batch=args.batch)
    return 0


def cmd_bench(args) -> int:
    if args.which == "kernels":
        from engine.bench.kernels import main as bench_main  # noqa: PLC0415
    elif args.which == "e2e":
        from engine.bench.e2e.report import main as bench_main  # noqa: PLC0415
    elif args.which == "serve":
        from engine.bench.serve import main as bench_main  # noqa: PLC0415
    elif args.which == "users":  # through the app, over `serve`'s workload
        from app.bench_users import main as users_main  # noqa: PLC0415
        from engine.bench import serve as workload  # noqa: PLC0415

        return users_main(args.rest, workload)
    else:
        from engine.bench.capture import main as bench_main  # noqa: PLC0415
    return bench_main(args.rest)


def cmd_eval(args) -> int:
    from engine.bench.evaluate import main as eval_main  # noqa: PLC0415

    return eval_main(args.rest)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text}")
    return value


def _generation(field: str):
    """An argparse type for one of GenerationOptions' fields, checked as the options check it (before torch loads)."""
    def parse(text: str) -> float:
        value = float(text)
        try:
            GenerationOptions(**{field: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    parse.__name__ = field  # argparse names the type in its "invalid value" message
    return parse


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a whole number from 0 to 65535, got {text}")
    return value


def _batch(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"questions answered together: a whole number of 1 or more, got {text}")
    return value


def _megabytes(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a size in MB above 0, got {text}")
    return value


def _sparsity(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= MAX_SPARSITY:
        raise argparse.ArgumentTypeError(f"sparsity must be between 0 and {MAX_SPARSITY}, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: built and checked without torch or the methods loaded (their settings' flags come
    from app/method_flags.py), so a bad option is refused at once."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", default=None, help="where contexts are cached (default: $SQUEEZE_CACHE_DIR or ~/.cache/squeeze)")
    common.add_argument("--model", default=EMBEDDED_MODEL, help="transformers model id or local path (default: the embedded Gemma 3 270M)")
    common.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    common.add_argument("--compile", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                        help="torch.compile the model's layers around the engine's attention, compiled once per "
                             "process as a stage of the model's load: 'auto' (the default) on one GPU, 'on' (or "
                             "--compile alone) anywhere, 'off' never")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_argument("--quiet", action="store_true", help="no progress on stderr")
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    parser = argparse.ArgumentParser(prog="squeeze", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    method_options = _method_options()
    p = sub.add_parser("ingest", parents=[common, method_options], help="prefill a document and build its indexes")
    p.add_argument("path")
    p.add_argument("--methods", default="squeeze",
                   help=f"comma-separated methods whose indexes are built now (of {', '.join(SPARSE_METHODS)}; the "
                        "others are built when first asked for)")
    p.add_argument("--truncate", action="store_true", help="keep the start of a document longer than the context")
    p.set_defaults(func=cmd_ingest)
    p = sub.add_parser("ask", parents=[common, method_options],
                       help="answer a question about a document (the method's index is built first if missing, or "
                            "rebuilt when its settings differ)")
    p.add_argument("doc", metavar="DOC_ID_OR_PATH")
    p.add_argument("question")
    p.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                   help=f"the sparse-attention method, or full attention (default {DEFAULT_METHOD})")
    p.add_argument("--sparsity", type=_sparsity, default=DEFAULT_SPARSITY,
                   help="1 - the KV budget: a step reads 1 - SPARSITY of the document's K/V bytes, its method's "
                        f"index and follow rows included, in the question's prefill as in decoding (default "
                        f"{DEFAULT_SPARSITY}; full attention reads every key whatever it is)")
    p.add_argument("--max-new-tokens", type=_positive, default=64, help="the longest answer, in tokens")
    p.add_argument("--temperature", type=_generation("temperature"), default=0.0,
                   help="0 (the default): greedy; else sample")
    p.add_argument("--top-p", type=_generation("top_p"), default=1.0,
                   help="sample from the smallest set of tokens of this mass")
    p.add_argument("--repetition-penalty", type=_generation("repetition_penalty"), default=1.0,
                   help="> 1 discourages the answer from repeating its own tokens (1: none)")
    p.add_argument("--seed", type=int, default=None, help="the sampler's seed (with --temperature)")
    p.add_argument("--truncate", action="store_true")
    p.set_defaults(func=cmd_ask)
    p = sub.add_parser("train", parents=[common, method_options],
                       help="learn a method's model-level artifacts once (DuoAttention's gates, Saap's partitions), "
                            "with a progress line "
                            "per step; resumes a stopped run; later documents reuse them")
    p.add_argument("method", choices=TRAINED_METHODS)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("list", parents=[common], help="cached documents")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("delete", parents=[common], help="delete a cached document and its contexts")
    p.add_argument("doc_id")
    p.set_defaults(func=cmd_delete)
    p = sub.add_parser("repair", parents=[common],
                       help="rebuild a damaged cache index from the rows it can still read (the damaged file is kept "
                            "beside it as index.db.damaged-TIME)")
    p.set_defaults(func=cmd_repair)
    p = sub.add_parser("serve", parents=[common], help="the web app: upload, chat, and what attention retrieved")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only; another needs a "
                                                        "login: --auth-file or --auth)")
    p.add_argument("--auth-file", default=None, help="the logins the app asks for: lines USER:PASSWORD")
    p.add_argument("--auth", default=None, metavar="USER:PASSWORD", help="one login (visible to other users of "
                                                                          "this machine: prefer --auth-file)")
    p.add_argument("--port", type=_port, default=7860)
    p.add_argument("--max-upload-mb", type=_megabytes, default=50.0, help="largest file accepted, per file")
    p.add_argument("--batch", type=_batch, default=None, help="users' questions answered together, each in the "
                                                              "same steps (default: 4 on the CPU, 8 on a GPU); "
                                                              "more wait, told their place")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("bench", help="benchmarks that print JSON: `kernels` (GPU), `capture` (real keys for it), "
                                     "`e2e` (ingest, prefill and decode through the engine, beside transformers), "
                                     "`serve` (many users at once through the engine), `users` (the same "
                                     "through the app's HTTP API)")
    p.add_argument("which", choices=("kernels", "capture", "e2e", "serve", "users"))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options (see `squeeze bench kernels --help`)")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("eval", add_help=False,  # every option after `eval` is its own (main)
                       help="every sparse method beside full attention at equal KV budgets: needles in haystacks of "
                            "real text (JSON; --table for a summary; `squeeze eval --help`)")
    p.set_defaults(func=cmd_eval, rest=[], debug=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # `eval` takes every option after it as its own (argparse's remainder does not start at an option)
    args = parser.parse_args(argv[:1]) if argv[:1] == ["eval"] else parser.parse_args(argv)
    if argv[:1] == ["eval"]:
        args.rest = argv[1:]
    wrong = unordered(_method_settings(args))
    if wrong:
        parser.error(wrong)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one plain line unless --debug
        if args.debug:
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: {terminal_text(message)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
