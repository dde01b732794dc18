"""`squeeze`: ingest documents, ask questions, list and delete cached documents. JSON output is a public interface."""

from __future__ import annotations

import argparse
import json
import sys
import time

from engine.config import LEVEL1_PRUNE, PREFILL_THRESHOLDS, IndexSettings
from engine.model import EMBEDDED_MODEL
from engine.policies import METHODS
from engine.session import Answer, Delta


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


def _engine(args):
    from engine.service import Engine  # noqa: PLC0415 - keep `squeeze --help` fast

    return Engine(args.cache_dir, model=args.model, device=args.device, compile=args.compile)


INDEX_OPTIONS = ("centroid_ratio", "level1_ratio", "level1_prune", "prefill_threshold")


def _settings(args) -> IndexSettings | None:
    """The index settings named on the command line (the others at their defaults); None when none is named."""
    given = {name: getattr(args, name) for name in INDEX_OPTIONS if getattr(args, name) is not None}
    if not given:
        return None
    defaults = IndexSettings()
    values = {name: given.get(name, getattr(defaults, name)) for name in INDEX_OPTIONS}
    values["level1_ratio"] = min(values["level1_ratio"], values["centroid_ratio"])
    return IndexSettings(**values)


def _index_options() -> argparse.ArgumentParser:
    """The index settings of `ingest` and `ask` (no defaults here: unset means IndexSettings' default)."""
    p = argparse.ArgumentParser(add_help=False)
    defaults = IndexSettings()
    p.add_argument("--centroid-ratio", type=float, default=None,
                   help=f"centroids per key of each global layer and KV head (default {defaults.centroid_ratio})")
    p.add_argument("--level1-ratio", type=float, default=None,
                   help=f"hsqueeze: level-1 centroids per key (default {defaults.level1_ratio})")
    p.add_argument("--level1-prune", type=float, default=None,
                   help=f"hsqueeze: fraction of the keys the level-1 threshold rules out (default {LEVEL1_PRUNE})")
    p.add_argument("--prefill-threshold", choices=PREFILL_THRESHOLDS, default=None,
                   help="the question prefill's threshold: decode's (default; keeps up to twice 1 - s) or its own, "
                        "calibrated to keep about 1 - s (lost the passkey at 90%% in 2/15 draws)")
    return p


def cmd_ingest(args) -> int:
    engine = _engine(args)
    settings = _settings(args) or IndexSettings()
    report = engine.ingest(args.path, settings, truncate=args.truncate, progress=_progress(not args.quiet))
    out = report.to_json()
    print(json.dumps(out) if args.json else
          f"{out['doc_id']}  {out['tokens']} tokens, {out['pages']} page(s), context {out['context_id']}"
          f"{' (cached)' if out['cached'] else ''} in {out['seconds']:.1f}s")
    return 0


def cmd_ask(args) -> int:
    engine = _engine(args)
    context_id = engine.resolve(args.doc, truncate=args.truncate, progress=_progress(not args.quiet),
                                settings=_settings(args))
    answer = None
    for event in engine.stream(context_id, args.question, args.method, args.sparsity, args.max_new_tokens):
        if isinstance(event, Delta) and not args.json:
            print(event.text, end="", flush=True)
        elif isinstance(event, Answer):
            answer = event
    stats = answer.stats.to_json()
    if args.json:
        print(json.dumps({"answer": answer.text, "context_id": context_id, **stats}))
    else:
        print()
        print(f"[{stats['method']} sparsity={stats['sparsity']} kv_budget={stats['kv_budget']:.3f} "
              f"first token {stats['timings']['first_token_s']:.2f}s, {stats['timings']['tokens_per_s']:.1f} tok/s]",
              file=sys.stderr)
    return 0


def cmd_list(args) -> int:
    from engine.service import Engine  # noqa: PLC0415

    docs = Engine(args.cache_dir, model=args.model, device="cpu").list_documents()
    if args.json:
        print(json.dumps(docs, default=str))
    else:
        for d in docs:
            print(f"{d['id']}  {d.get('status') or '-':8} {d.get('tokens') or 0:>7} tok  {d['pages']:>4} p  {d['name']}")
    return 0


def cmd_delete(args) -> int:
    from engine.service import Engine  # noqa: PLC0415

    doc_id = Engine(args.cache_dir, model=args.model, device="cpu").delete_document(args.doc_id)
    print(f"deleted {doc_id}")
    return 0


def cmd_serve(args) -> int:
    from app.config import AppConfig  # noqa: PLC0415 - gradio loads only for this command
    from app.serve import serve  # noqa: PLC0415

    serve(args.host, args.port, model=args.model, cache_dir=args.cache_dir, device=args.device,
          config=AppConfig(max_upload_mb=args.max_upload_mb), compile=args.compile)
    return 0


def cmd_bench(args) -> int:
    if args.which == "kernels":
        from engine.bench.kernels import main as bench_main  # noqa: PLC0415
    elif args.which == "e2e":
        from engine.bench.e2e import main as bench_main  # noqa: PLC0415
    else:
        from engine.bench.capture import main as bench_main  # noqa: PLC0415
    return bench_main(args.rest)


def _sparsity(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 0.99:
        raise argparse.ArgumentTypeError(f"sparsity must be between 0 and 0.99, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", default=None, help="where contexts are cached (default: $SQUEEZE_CACHE_DIR or ~/.cache/squeeze)")
    common.add_argument("--model", default=EMBEDDED_MODEL, help="transformers model id or local path (default: the embedded Gemma 3 270M)")
    common.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    common.add_argument("--compile", action="store_true",
                        help="torch.compile the model's layers around the engine's attention: faster decode steps on "
                             "a GPU after a one-time compilation at the first calls (README: End to end on a GPU)")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_argument("--quiet", action="store_true", help="no progress on stderr")
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    parser = argparse.ArgumentParser(prog="squeeze", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    index_options = _index_options()
    p = sub.add_parser("ingest", parents=[common, index_options], help="prefill a document and build its indexes")
    p.add_argument("path")
    p.add_argument("--truncate", action="store_true", help="keep the start of a document longer than the context")
    p.set_defaults(func=cmd_ingest)
    p = sub.add_parser("ask", parents=[common, index_options],
                       help="answer a question about a document (index options: use, or build, a context with them)")
    p.add_argument("doc", metavar="DOC_ID_OR_PATH")
    p.add_argument("question")
    p.add_argument("--method", choices=METHODS, default="squeeze")
    p.add_argument("--sparsity", type=_sparsity, default=0.9)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--truncate", action="store_true")
    p.set_defaults(func=cmd_ask)
    p = sub.add_parser("list", parents=[common], help="cached documents")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("delete", parents=[common], help="delete a cached document and its contexts")
    p.add_argument("doc_id")
    p.set_defaults(func=cmd_delete)
    p = sub.add_parser("serve", parents=[common], help="the web app: upload, chat, and what attention retrieved")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--max-upload-mb", type=float, default=50.0, help="largest file accepted, per file")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("bench", help="benchmarks that print JSON: `kernels` (GPU), `capture` (real keys for it), "
                                     "`e2e` (ingest, prefill and decode through the engine, beside transformers)")
    p.add_argument("which", choices=("kernels", "capture", "e2e"))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options (see `squeeze bench kernels --help`)")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one plain line unless --debug
        if args.debug:
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
