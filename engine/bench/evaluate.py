"""`squeeze eval`: every registered sparse method beside full attention at equal KV budgets, on one model.

    squeeze eval [--parts needles,recall,agreement] [--budgets 0.05,0.1,0.2,0.3] [--lengths 2048,4096]
                 [--depths 0.1,0.3,0.5,0.7,0.9] [--keys 1] [--tasks passkey,paraphrase,multikey,vartrack]
                 [--essays tuning|held-out]
                 [--needle-tokens 64] [--document FILE]
                 [--document-tokens N] [--questions FILE]
                 [--set METHOD.SETTING=VALUE] [--follow SETTING=VALUE] [--no-follow] [--token-lookups]
                 [--out FILE] [--plot FILE] [--table] [--no-save] [--sink N] [--model M] [--device D] [--cache-dir DIR]

Parts (each in its own module):
- needles (engine.bench.needles): passkeys at several depths of haystacks of real essays, and with --tasks the
  needles that matching the question's words does not find (engine.bench.tasks: a paraphrased passkey, one of
  several similar keys, a chain of assignments); success = the key in the answer (as the app gives it: 64 tokens
  at most, cut at the stop strings; the share within the first 12 tokens, the earlier runs' answers, beside it),
  full attention's beside it;
- agreement and recall (engine.bench.fidelity): over one document and a fixed set of questions about it, the
  top-1 next-token agreement and KL divergence with full attention on teacher-forced answers, and the attention
  recall of each method's selections against the oracle top-k at the same budget, per global layer and head.
The oracle top-k (engine.bench.oracle: per KV head and step, the keys with the most weight, no index) answers the
needles and the agreement questions too: the ceiling of any selection at that budget, a row of its own.
A budget is the share of the fixed context's K/V bytes a step reads, index included; every cell records what it
really read. Ends with one JSON document on stdout (or a Markdown table with --table), also written to --out, a
figure to --plot (PNG), and the results recorded in the cache's index (unless --no-save), where the app shows the
latest ones for its model.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from engine.attention.follow import OFF, FollowSettings
from engine.bench.needles import ANSWER_TOKENS as NEEDLE_TOKENS
from engine.bench.needles import SHORT_ANSWER
from engine.bench.oracle import OraclePolicy
from engine.bench.settings import parse_follow, parse_settings
from engine.bench.tasks import TASKS
from engine.context.settings import ContextSettings
from engine.serve.evals import full_attention_found
from engine.text.corpus import ESSAY_SETS

PARTS = ("needles", "recall", "agreement")
BUDGETS = "0.05,0.1,0.2,0.3"


def summarize(doc: dict) -> list[dict]:
    """One row per (method, budget) over the parts that ran: needles (share of cells as good as full attention),
    recall, its unit ceiling and the oracle's (decode steps; engine.bench.fidelity), top-1 agreement, KL, and what
    the cells read in each phase (the mean over the parts that measured it)."""
    rows: dict[tuple[str, float], dict] = {}

    def row(method: str, budget: float) -> dict:
        return rows.setdefault((method, budget), {"method": method, "budget": budget, "needles": None,
                                                  "needles_short": None, "needles_decided": None,
                                                  "recall": None, "units": None,
                                                  "oracle": None, "top1": None, "top1_decided": None, "kl": None,
                                                  "read_prefill": None, "read_decode": None, "tasks": {},
                                                  "_reads": []})

    for r in (doc.get("needles") or {}).get("summary", []):
        task = r.get("task", "passkey")
        if task == "passkey":
            row(r["method"], r["budget"]).update(needles=r["as_good_as_full"],
                                                 needles_short=r.get("as_good_as_full_short"),
                                                 needles_decided=r.get("found_decided"))
        else:  # the tasks lexical matching does not solve (engine.bench.tasks), each in its own entry
            row(r["method"], r["budget"])["tasks"][task] = {"as_good_as_full": r["as_good_as_full"],
                                                            "found_decided": r.get("found_decided")}
        row(r["method"], r["budget"])["_reads"].append((r["read_prefill"], r["read_decode"]))
    for r in (doc.get("recall") or {}).get("rows", []):
        decode = r.get("decode") or r.get("prefill") or {}
        row(r["method"], r["budget"]).update(recall=decode.get("recall"), units=decode.get("units"),
                                             oracle=decode.get("oracle"))
        row(OraclePolicy.name, r["budget"]).update(recall=decode.get("oracle"), oracle=decode.get("oracle"))  # its own row
    for r in (doc.get("agreement") or {}).get("rows", []):
        row(r["method"], r["budget"]).update(top1=r["top1"], top1_decided=r.get("top1_decided"), kl=r["kl"])
        row(r["method"], r["budget"])["_reads"].append((r["read_prefill"], r["read_decode"]))
    out = []
    for key in sorted(rows):
        r = rows[key]
        reads = r.pop("_reads")
        for i, name in enumerate(("read_prefill", "read_decode")):
            values = [x[i] for x in reads if x[i] is not None]
            r[name] = round(sum(values) / len(values), 4) if values else None
        out.append(r)
    return out


def table(doc: dict) -> str:
    """The summary as a Markdown table (a dash where a part did not run; in brackets where the cells say: needles
    within the first engine.bench.needles.SHORT_ANSWER answer tokens, then the share found of the cells where full
    attention found the key with no near-tie on the way; top-1 over the positions full attention is decided on,
    engine.bench.fidelity.DECIDED_MARGIN, in brackets where the rows say)."""
    def cell(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    found = full_attention_found(doc.get("full") or {})
    tasks = sorted({t for r in doc["summary"] for t in r.get("tasks") or {}})
    essays = (doc.get("needles") or {}).get("essays")
    found = "; ".join(x for x in (found, f"needles in the {essays} essays" if essays else "") if x)
    lines = [f"Model {doc['model']} on {doc['device']}, {doc['created']}" + (f"; {found}" if found else ""),
             "",
             f"| method | KV budget | needles as good as full ({SHORT_ANSWER} tokens; found where full is decided) | "
             + "".join(f"{t} (decided) | " for t in tasks)
             + "recall (unit ceiling; oracle) | top-1 (decided) | KL | read (question / answer) |",
             "|---|---|---|" + "---|" * len(tasks) + "---|---|---|---|"]
    for r in doc["summary"]:
        recall = "-" if r["recall"] is None else \
            f"{r['recall']:.3f} ({cell(r.get('units'), '.3f')}; {cell(r['oracle'], '.3f')})"
        short, decided = r.get("needles_short"), r.get("needles_decided")
        brackets = [] if short is None else [format(short, ".0%")]
        if decided is not None:
            brackets = [cell(short, ".0%"), format(decided, ".0%")]
        found = cell(r["needles"], ".0%") + (f" ({'; '.join(brackets)})" if brackets else "")
        top1 = cell(r["top1"], ".1%") + ("" if r.get("top1_decided") is None else f" ({r['top1_decided']:.1%})")
        others = ""
        for t in tasks:
            got = (r.get("tasks") or {}).get(t)
            others += "- | " if got is None else (cell(got["as_good_as_full"], ".0%")
                                                  + ("" if got["found_decided"] is None
                                                     else f" ({got['found_decided']:.0%})") + " | ")
        lines.append(f"| {r['method']} | {r['budget']:.0%} | {found} | {others}{recall} | "
                     f"{top1} | {cell(r['kl'], '.4f')} | "
                     f"{cell(r['read_prefill'], '.3f')} / {cell(r['read_decode'], '.3f')} |")
    return "\n".join(lines)


def run(lm, parts: list[str], methods: list[str], budgets: list[float], lengths: list[int], depths: list[float],
        keys: int, document: Path, questions: list[str], answer_tokens: int, progress=lambda *a: None,
        context: ContextSettings | None = None, prepared: dict | None = None,
        settings: dict[str, dict] | None = None, follow: FollowSettings | None = None,
        needle_tokens: int = NEEDLE_TOKENS, document_tokens: int | None = None, token_lookups: bool = False,
        tasks: tuple[str, ...] = ("passkey",), essays: str = "tuning") -> dict:
    """The parts asked for, on one loaded model. Returns the JSON document (engine.bench.evaluate's module doc).
    context: how the documents become contexts (None: the defaults; e.g. another sink); prepared: method -> its
    model-level artifacts (needed by a method that learns per model: main gets them from the cache's store, training
    them first where they are missing); settings: method -> its settings (the others at their defaults); follow:
    the follow rows every sparse step adds (engine.attention.follow; None: the defaults); needle_tokens: a needle answer's
    most tokens; document_tokens: the document placed in the middle of the essays, this many tokens in all (None:
    the document alone); token_lookups: a question's prefill looks up each of its tokens on its own, as decode steps
    do (engine.context.session.ContextSession; the recall part's closed form keeps one lookup for the question);
    tasks: what the needles hide and ask (engine.bench.tasks); essays: the needles' haystacks, "tuning" or
    "held-out" (engine.text.corpus.essay_files)."""
    from engine.bench import fidelity, needles
    from engine.text.corpus import embedded, essays_dir

    start = time.monotonic()
    doc: dict = {"bench": "eval", "model": lm.model_id, "device": str(lm.device), "methods": methods,
                 "budgets": budgets, "parts": parts, "context": (context or ContextSettings()).as_dict(),
                 "method_settings": settings or {}, "follow": asdict(follow or FollowSettings()),
                 "token_lookups": token_lookups,
                 "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    if "needles" in parts:
        doc["needles"] = needles.run(lm, lengths, depths, budgets, methods, keys, progress, extra=[OraclePolicy()],
                                     context=context, prepared=prepared, settings=settings, follow=follow,
                                     answer_tokens=needle_tokens, token_lookups=token_lookups, tasks=tasks,
                                     essays=essays)
        # full attention's figures: any (method, budget) row's of the first task, the same contexts
        first = next(r for r in doc["needles"]["summary"]
                     if (r["task"], r["method"], r["budget"]) == (tasks[0], methods[0], budgets[0]))
        doc["full"] = {"needles_found": first["full_found"], "needles_cells": first["cells"],
                       "needles_decided": first["decided"]}
    if "recall" in parts or "agreement" in parts:
        text = document.read_text(encoding="utf-8", errors="replace")
        if document_tokens is not None:
            text = embedded(lm.tokenizer, text, document_tokens, essays_dir())
        session = needles.context_session(lm, text, methods, settings, extra=[OraclePolicy()], context=context,
                                          prepared=prepared, follow=follow, token_lookups=token_lookups)
        agreement, recall = fidelity.run(session, methods, budgets, questions, answer_tokens, progress,
                                         recall="recall" in parts, agreement="agreement" in parts,
                                         ceiling=OraclePolicy.name)
        doc["document"] = {"path": str(document), "tokens": session.fixed_len, "questions": len(questions),
                           "in_essays": document_tokens is not None}
        if agreement is not None:
            doc["agreement"] = agreement
        if recall is not None:
            doc["recall"] = recall
    doc["summary"] = summarize(doc)
    doc["seconds"] = round(time.monotonic() - start, 1)
    return doc


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    from engine.bench.fidelity import ANSWER_TOKENS, DOCUMENT, QUESTIONS, load_questions
    from engine.methods import SPARSE_METHODS, build_order
    from engine.text.corpus import essays_dir

    parser = argparse.ArgumentParser(prog="squeeze eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--methods", default=",".join(SPARSE_METHODS))
    parser.add_argument("--budgets", default=BUDGETS, help="KV budgets: shares of the K/V bytes a step reads")
    parser.add_argument("--lengths", default="2048,4096", help="needles: haystack tokens, comma-separated")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needles: where the key goes")
    parser.add_argument("--keys", type=int, default=1, help="needles: passkeys per (length, depth)")
    parser.add_argument("--essays", choices=ESSAY_SETS, default="tuning",
                        help="needles: the haystacks' essays: those every setting was chosen on, or the held-out "
                             "ones (engine.text.corpus.essay_files)")
    parser.add_argument("--tasks", default="passkey",
                        help=f"needles: what each cell hides and asks, comma-separated, of {', '.join(TASKS)} "
                             "(engine.bench.tasks)")
    parser.add_argument("--needle-tokens", type=int, default=NEEDLE_TOKENS,
                        help=f"needles: an answer's most tokens (default {NEEDLE_TOKENS}, the app's; the share found "
                             f"within the first {SHORT_ANSWER} is reported beside it)")
    parser.add_argument("--document", type=Path, default=DOCUMENT, help="recall and agreement: the document")
    parser.add_argument("--document-tokens", type=int, default=None,
                        help="recall and agreement: the document in the middle of the needles' essays, this many "
                             "tokens in all (default: the document alone)")
    parser.add_argument("--questions", type=Path, default=QUESTIONS,
                        help='recall and agreement: a JSON list of {"question": ...} about the document')
    parser.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                        help="recall and agreement: full attention's answer tokens that are teacher-forced")
    parser.add_argument("--model", default=None, help="model id or path (default: the embedded Gemma 3 270M)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--cache-dir", default=None, help="the cache whose index records the results")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON document here")
    parser.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    parser.add_argument("--table", action="store_true", help="print the summary table instead of the JSON")
    parser.add_argument("--no-save", action="store_true", help="do not record the results in the cache's index")
    parser.add_argument("--sink", type=int, default=None,
                        help="first context tokens read densely (ContextSettings.sink; default: its default)")
    parser.add_argument("--dense-tail", type=int, default=None,
                        help="last context tokens read densely (ContextSettings.dense_tail; default: its default)")
    parser.add_argument("--set", action="append", default=[], metavar="METHOD.SETTING=VALUE",
                        help="a method's setting (repeatable), e.g. --set saap.hidden=32")
    parser.add_argument("--follow", action="append", default=[], metavar="SETTING=VALUE",
                        help="a follow rows' setting (repeatable; engine.attention.follow.FollowSettings), e.g. --follow lead=4")
    parser.add_argument("--no-follow", action="store_true",
                        help="steps read no follow rows (engine.attention.follow: the tokens after the document's occurrences "
                             "of the step's own recent tokens)")
    parser.add_argument("--token-lookups", action="store_true",
                        help="a question's prefill looks up each of its tokens' keys on its own, as a decode step "
                             "does (default: one lookup for the question's tokens, the Squeezed Attention paper's)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    methods = [m for m in args.methods.split(",") if m]
    budgets = _floats(args.budgets)
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts: choose from {', '.join(PARTS)}")
    unknown = [m for m in methods if m not in SPARSE_METHODS]
    if unknown or not methods:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(SPARSE_METHODS)}")
    if not budgets or not all(0.0 < b <= 1.0 for b in budgets):
        parser.error("budgets must be in (0, 1]")
    if args.answer_tokens < 1:
        parser.error("--answer-tokens must be at least 1")
    if args.document_tokens is not None and args.document_tokens < 1:
        parser.error("--document-tokens must be at least 1")
    if args.needle_tokens < 1:
        parser.error("--needle-tokens must be at least 1")
    tasks = tuple(t for t in args.tasks.split(",") if t)
    if not tasks or set(tasks) - set(TASKS):
        parser.error(f"--tasks: choose from {', '.join(TASKS)}")
    if args.no_follow and args.follow:
        parser.error("--follow and --no-follow exclude each other")
    if args.sink is not None and args.sink < 0:
        parser.error("--sink must be at least 0")
    if args.dense_tail is not None and args.dense_tail < 1:
        parser.error("--dense-tail must be at least 1")
    context = ContextSettings(**{k: v for k, v in (("sink", args.sink), ("dense_tail", args.dense_tail))
                                 if v is not None})
    questions: list[str] = []
    try:  # clear errors before the model loads
        settings = parse_settings(args.set)
        follow = OFF if args.no_follow else (parse_follow(args.follow) if args.follow else None)
        if "needles" in parts or args.document_tokens is not None:
            essays_dir()
        if "recall" in parts or "agreement" in parts:
            if not args.document.is_file():
                raise ValueError(f"no document at {args.document}")
            questions = load_questions(args.questions)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from engine.serve.service import Engine

    engine = Engine(args.cache_dir, args.model, args.device, methods=settings)
    start = time.monotonic()

    def progress(done: int, total: int, what: str) -> None:
        print(f"[eval {time.monotonic() - start:6.0f}s] {done}/{total} {what}", file=sys.stderr, flush=True)

    def training(stage: str, done: int, total: int) -> None:
        progress(done, total, stage)

    prepared = {name: engine.prepared(name, training) for name in build_order(methods)}
    doc = run(engine.lm, parts, methods, budgets, [int(x) for x in args.lengths.split(",") if x],
              _floats(args.depths), args.keys, args.document, questions, args.answer_tokens, progress, context,
              prepared, settings, follow, args.needle_tokens, args.document_tokens, args.token_lookups, tasks,
              args.essays)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
    if args.plot is not None:
        from engine.bench.eval_plot import save_figure

        save_figure(doc, args.plot)
    if not args.no_save:
        engine.record_eval(doc)
    print(table(doc) if args.table else json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
