"""Attention recall against the oracle, and agreement with full attention: two parts of `squeeze eval`.

One document (by default the shipped `assets/sample.md`) and a fixed set of questions about it (by default
`assets/sample_facts.json`). Full attention answers each question greedily (up to `answer_tokens` tokens, no stop
strings); that answer is then teacher-forced:

- **agreement**: each (method, budget) reads the question as a turn does (one prefill lookup) and then every answer
  token in turn (a decode step each, its own lookup), and its next-token distribution at each answer position is
  compared with full attention's through the same path: top-1 agreement and KL(full || method), in nats. What each
  phase read (the turn recorder's KV budget) goes beside it. Top-1 is also given over the positions where full
  attention itself is decided (its top two tokens DECIDED_MARGIN nats or more apart in log-probability), with the
  margins of every miss: a near-tie of full attention's own flips under almost any change to what is read.
- **recall**: full attention's queries of the same tokens at every global layer (the reference trajectory, so that
  every method's selection is judged on the same queries) against the fixed context's keys in original order. For a
  (layer, query head, token), recall is the share of full attention's weight over the fixed context that falls on
  the keys the method attends to (engine.bench.recall.recall_and_error). The oracle at a budget b reads b x L keys
  (no index) and keeps, per KV head and step, the keys with the most weight summed over the group's query heads (and
  over the question's tokens for its prefill, which one selection serves): the best any selection that reads b of
  the bytes can do. Decode steps are the answer tokens' single-token lookups; the question's prefill is one lookup
  over its tokens. Means per (layer, query head) are kept for the figure and the app.
- **unit ceiling** (`units`), for a method that selects whole units (clusters, pages, buckets: Method.unit_labels):
  the recall of the best selection of its own units at the keys it read (units_mask: per KV head and step, its
  units ranked by full attention's weight per key, taken best first while they fit in the count of indexed keys
  the method read; the dense rows too). It splits what a method loses against the oracle in two: the partition's
  share (oracle - ceiling: no lookup over these units wins it back at this budget, up to the slack of a greedy fill
  of units of unequal sizes) and the lookup's (ceiling - recall: the ranking's errors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.function import QueryCapture
from engine.bench.recall import full_probs, in_original_order
from engine.model.generate import forward_step, full_logits, generate_tokens
from engine.model.prefill import global_scale
from engine.text.prompt import question_ids
from kernels.backend import REFERENCE

ASSETS = Path(__file__).resolve().parents[2] / "assets"
DOCUMENT = ASSETS / "sample.md"
QUESTIONS = ASSETS / "sample_facts.json"
ANSWER_TOKENS = 16
DECIDED_MARGIN = 0.5  # nats between full attention's top two tokens: a position it is decided on (p1 >= 1.65 p2)


@dataclass
class Case:
    """One question: its prompt ids [Lq] and full attention's greedy answer ids [n] (n >= 1)."""

    question: str
    prompt: torch.Tensor
    answer: torch.Tensor


def load_questions(path: Path = QUESTIONS) -> list[str]:
    """The questions of a JSON list of {"question": ...} objects (or of strings)."""
    items = json.loads(Path(path).read_text(encoding="utf-8"))
    questions = [item["question"] if isinstance(item, dict) else str(item) for item in items]
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


def reference_cases(session, questions: list[str], answer_tokens: int = ANSWER_TOKENS) -> list[Case]:
    """Full attention's greedy answer to each question (raw tokens: an end-of-sequence token ends it and is kept)."""
    lm = session.lm
    cases = []
    for question in questions:
        prompt = question_ids(lm.tokenizer, question)
        tokens = list(generate_tokens(lm, session.step_context("full", 0.0), prompt, answer_tokens))
        session.cache.reset_dynamic()
        cases.append(Case(question, prompt, torch.tensor(tokens, dtype=torch.int64)))
    return cases


def forced_logits(session, method: str, sparsity: float, case: Case):
    """Teacher-forced next-token logits [n, V] float32 of `case.answer` under `method` at `sparsity`, as a turn
    computes them (the question's prefill, then one decode step per answer token but the last), and the turn's
    statistics (engine.attention.stats.TurnStats: what each phase read)."""
    lm = session.lm
    recorder = session.recorder()
    step = session.step_context(method, sparsity, recorder)
    cache = step.cache
    out = []
    with torch.inference_mode():
        cache.reset_dynamic()
        cache.reserve(case.prompt.numel() + case.answer.numel())
        position = cache.get_seq_length()
        out.append(forward_step(lm, step, case.prompt.to(lm.device), position))
        position += case.prompt.numel()
        for token in case.answer[:-1].tolist():
            out.append(forward_step(lm, step, torch.tensor([token], device=lm.device), position))
            position += 1
        logits = torch.cat(out).float().cpu()
    cache.reset_dynamic()
    stats = recorder.finish(method, round(1.0 - step.plan.budget, 6), case.answer.numel(), {})
    return logits, stats


def agreement_stats(full: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: top-1 agreement (bool) and KL(full || other) in nats, of logits [n, V] each."""
    log_p = torch.log_softmax(full.double(), dim=-1)
    log_q = torch.log_softmax(other.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)
    return full.argmax(dim=-1) == other.argmax(dim=-1), kl


def mean_or_none(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def top_margin(logits: torch.Tensor) -> torch.Tensor:
    """Per position of logits [n, V]: the log-probability of the top token minus the runner-up's (nats) [n]."""
    top2 = torch.log_softmax(logits.double(), dim=-1).topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def full_queries(session, case: Case) -> dict[int, torch.Tensor]:
    """Full attention's queries of the question's and the answer's tokens at every global layer:
    layer -> [Hq, Lq + n, D] float32 (as the attention sees them: RoPE applied)."""
    step = session.step_context("full", 0.0)
    step.capture = QueryCapture(start=session.fixed_len, queries={})
    full_logits(session.lm, step, torch.cat([case.prompt, case.answer]))
    return {layer: torch.cat(chunks, dim=1).float().cpu() for layer, chunks in step.capture.queries.items()}


def group_weight(probs: torch.Tensor, hkv: int, pool_tokens: bool) -> torch.Tensor:
    """probs [Hq, T, L] -> [Hkv, T', L]: each KV head's weight on each key, summed over its query heads (and over
    the T tokens when `pool_tokens`: T' = 1, one selection serves them; else T' = T)."""
    hq, t, length = probs.shape
    group = probs.reshape(hkv, hq // hkv, t, length).sum(dim=1)
    return group.sum(dim=1, keepdim=True) if pool_tokens else group


def per_query_head(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A selection per KV head [Hkv, T' (1 or T), L] -> [Hq, T, L] (`shape`): every query head of a group, at every
    token, attends to its KV head's."""
    hq, t, length = shape
    return mask.expand(mask.shape[0], t, length).repeat_interleave(hq // mask.shape[0], dim=0)


def oracle_mask(probs: torch.Tensor, hkv: int, keys: int, pool_tokens: bool) -> torch.Tensor:
    """The oracle's selection: probs [Hq, T, L] -> mask [Hq, T, L] (bool) of the `keys` keys with the most weight
    per KV head, summed over its query heads (and over the T tokens when `pool_tokens`: one selection serves them)."""
    length = probs.shape[-1]
    group = group_weight(probs, hkv, pool_tokens)
    top = group.topk(max(1, min(length, keys)), dim=-1).indices
    mask = torch.zeros_like(group, dtype=torch.bool).scatter_(-1, top, True)
    return per_query_head(mask, probs.shape)


def units_mask(probs: torch.Tensor, labels: torch.Tensor, read: torch.Tensor, pool_tokens: bool) -> torch.Tensor:
    """The best selection of whole units at a given size: probs [Hq, T, L] (stored row order: the indexed rows
    first); labels [Hkv, I] int64, the unit of each indexed row (I <= L; the rows past I are dense, always read);
    read [Hkv, T'] the indexed rows the method read per KV head and step (T' = 1 when `pool_tokens`: one selection
    serves the T tokens, else T). Per KV head and step, the units are ranked by the weight per key that the group's
    query heads (and, pooled, the tokens) put on them, and taken best first while their keys fit in `read`.
    Returns [Hq, T, L] bool."""
    length = probs.shape[-1]
    hkv, indexed = labels.shape
    group = group_weight(probs, hkv, pool_tokens)
    units = int(labels.max()) + 1 if labels.numel() else 1
    steps = group.shape[1]
    index = labels[:, None, :].expand(hkv, steps, indexed)
    mass = torch.zeros(hkv, steps, units, dtype=group.dtype).scatter_add_(-1, index, group[..., :indexed])
    ones = torch.ones_like(labels, dtype=group.dtype)
    sizes = torch.zeros(hkv, units, dtype=group.dtype).scatter_add_(-1, labels, ones)  # [Hkv, U] keys per unit
    density = torch.where(sizes[:, None] > 0, mass / sizes[:, None].clamp_min(1), -1.0)  # [Hkv, T', U]
    order = density.argsort(dim=-1, descending=True)
    fits = torch.gather(sizes[:, None].expand_as(density), -1, order).cumsum(dim=-1) <= read[..., None]
    taken = torch.zeros_like(fits).scatter_(-1, order, fits)  # [Hkv, T', U]
    mask = torch.ones(hkv, steps, length, dtype=torch.bool)
    mask[..., :indexed] = torch.gather(taken, -1, index)
    return per_query_head(mask, probs.shape)


def method_mask(session, method: str, sparsity: float, layer_idx: int, q: torch.Tensor, scale: float,
                pool_tokens: bool, positions: torch.Tensor, turn: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
    """What `method` attends to for queries q [Hq, T, D] at `positions` [T] at a layer, in original key order:
    [Hq, T, L] bool. One lookup over all T tokens when `pool_tokens` (a question's prefill), else one per token
    (decode steps). turn: (the question's prompt [Lq], the answer [n]), whose ids decide the follow rows a turn
    adds (engine.attention.follow) where the session has them; the T queries are those of the turn's tokens from position
    positions[0] - fixed_len on."""
    m = session.method(method)
    layer = session.cache.layers[layer_idx]
    index = layer.indexes[method]
    plan = session.plan(method, sparsity)
    hq, hkv = q.shape[0], layer.fixed_keys.shape[0]
    q = q.to(layer.fixed_keys.dtype)
    blocks = [(q, positions)] if pool_tokens else [(q[:, t : t + 1], positions[t : t + 1]) for t in range(q.shape[1])]
    masks = []
    device = layer.fixed_keys.device
    follow = session.follow if turn is not None and session.follows(m) else None
    added = []
    for block, at in blocks:
        sel = m.lookup(block.to(device), index, plan, scale, REFERENCE, at.to(device)).selection
        mask = torch.ones(hkv, layer.fixed_keys.shape[1], dtype=torch.bool) if sel is None else sel.to_mask().cpu()
        masks.append(mask)  # [rows, L]
        if follow is not None and sel is not None:  # the call's tokens end at the block's last query
            prompt, answer = turn
            answered = int(at[-1]) - session.fixed_len + 1 - prompt.numel()  # the answer's tokens before the call's
            rows, valid = follow.stored_rows(follow.step_positions(prompt, answer[:max(answered, 0)]))
            added.append(rows[valid].cpu())
    mask = in_original_order(torch.stack(masks, dim=1), m.layout(index), hkv)  # [rows, T', L]
    for t, rows in enumerate(added):
        mask[:, t, rows] = True
    return per_query_head(mask, torch.Size((hq, q.shape[1], mask.shape[-1])))  # a KV head's selection serves its group


def run(session, methods: list[str], budgets: list[float], questions: list[str],
        answer_tokens: int = ANSWER_TOKENS, progress=lambda *a: None, recall: bool = True,
        agreement: bool = True, ceiling: str | None = None) -> tuple[dict | None, dict | None]:
    """The agreement and recall parts over one prepared context (`session`, every method in `methods` built).
    Returns (agreement, recall) JSON documents, each with `rows` per (method, budget); None for a part not asked.
    ceiling: a method built in the session whose agreement rows go beside the others' (the oracle top-k:
    engine.bench.oracle), or None."""
    cases = reference_cases(session, questions, answer_tokens)
    answers = [{"question": c.question, "answer": session.lm.tokenizer.decode(c.answer.tolist(), skip_special_tokens=True),
                "tokens": int(c.answer.numel())} for c in cases]
    agreed = None
    if agreement:
        agreed = {"answer_tokens": answer_tokens, "answers": answers,
                  "rows": agreement_rows(session, cases, methods + ([ceiling] if ceiling else []), budgets, progress)}
    recalled = recall_rows(session, cases, methods, budgets, global_scale(session.lm), progress) if recall else None
    return agreed, recalled


def agreement_rows(session, cases: list[Case], methods: list[str], budgets: list[float],
                   progress=lambda *a: None) -> list[dict]:
    """Per (method, budget): top-1 agreement and KL (mean, 90th percentile) over every answer position of every
    case, top-1 over the positions full attention is decided on (top_margin >= DECIDED_MARGIN) and full attention's
    margin at each miss, and the mean KV budget each phase read."""
    total = len(cases) * (1 + len(methods) * len(budgets))
    done = 0
    full_runs = []
    for case in cases:
        full_runs.append(forced_logits(session, "full", 0.0, case)[0])
        done += 1
        progress(done, total, "agreement: full attention")
    margin = torch.cat([top_margin(full) for full in full_runs])  # [positions]
    decided = margin >= DECIDED_MARGIN
    rows = []
    for method in methods:
        for budget in budgets:
            agree, kl, reads_p, reads_d = [], [], [], []
            for case, full in zip(cases, full_runs):
                logits, stats = forced_logits(session, method, 1.0 - budget, case)
                a, k = agreement_stats(full, logits)
                agree.append(a)
                kl.append(k)
                reads_p.append(stats.kv_budget_prefill)
                if case.answer.numel() > 1:
                    reads_d.append(stats.kv_budget_decode)
                done += 1
                progress(done, total, f"agreement: {method} at {budget:.0%}")
            agree_all, kl_all = torch.cat(agree), torch.cat(kl)
            rows.append({"method": method, "budget": budget, "positions": int(agree_all.numel()),
                         "top1": round(float(agree_all.double().mean()), 4),
                         "kl": round(float(kl_all.mean()), 5),
                         "kl_p90": round(float(torch.quantile(kl_all, 0.9)), 5),
                         "decided": int(decided.sum()),
                         "top1_decided": round(float(agree_all[decided].double().mean()), 4) if bool(decided.any())
                         else None,
                         "miss_margins": sorted(round(float(m), 3) for m in margin[~agree_all]),
                         "read_prefill": mean_or_none(reads_p), "read_decode": mean_or_none(reads_d)})
    return rows


def recall_rows(session, cases: list[Case], methods: list[str], budgets: list[float], scale: float,
                progress=lambda *a: None) -> dict:
    """The recall part: per (method, budget) and phase, the mean recall over (global layer, query head, token),
    its 10th percentile, the oracle's at the same budget, and both per (layer, query head)."""
    lm = session.lm
    queries = [full_queries(session, case) for case in cases]
    session.arrange(None)  # keys in original order; the masks are mapped back to it
    layers = list(lm.global_layers)
    sums: dict[tuple, list] = {}  # (method or "oracle", budget, phase) -> [per layer: [Hq] sums], tokens, all values
    for i, layer_idx in enumerate(layers):
        layer = session.cache.layers[layer_idx]
        keys = layer.fixed_keys.float().cpu()
        hkv, length = keys.shape[:2]
        labels = {m: session.method(m).unit_labels(layer.indexes[m]) for m in methods}
        labels = {m: None if x is None else x.cpu() for m, x in labels.items()}
        for case, q_all in zip(cases, queries):
            lq = case.prompt.numel()
            q_all_l = q_all[layer_idx]
            phases = {"prefill": q_all_l[:, :lq], "decode": q_all_l[:, lq : lq + case.answer.numel() - 1]}
            starts = {"prefill": session.fixed_len, "decode": session.fixed_len + lq}  # the captured tokens' places
            for phase, q in phases.items():
                if q.shape[1] == 0:
                    continue
                pool = phase == "prefill"
                probs = full_probs(q, keys, scale)  # [Hq, T, L]
                for budget in budgets:
                    masks = {"oracle": oracle_mask(probs, hkv, round(budget * length), pool)}
                    for method in methods:
                        at = torch.arange(starts[phase], starts[phase] + q.shape[1])
                        masks[method] = method_mask(session, method, 1.0 - budget, layer_idx, q, scale, pool, at,
                                                    (case.prompt, case.answer))
                        if labels[method] is not None:
                            indexed = labels[method].shape[1]
                            read = masks[method].reshape(hkv, -1, *masks[method].shape[1:]).any(dim=1)
                            read = read[:, : 1 if pool else None, :indexed].sum(dim=-1)  # [Hkv, T']
                            masks[(method, "units")] = units_mask(probs, labels[method], read, pool)
                    for name, mask in masks.items():
                        r = (probs * mask).sum(dim=-1)  # [Hq, T]
                        entry = sums.setdefault((name, budget, phase), [torch.zeros(len(layers), q.shape[0]), 0, []])
                        entry[0][i] += r.sum(dim=1)
                        if i == 0:
                            entry[1] += q.shape[1]
                        entry[2].append(r.flatten())
        progress(i + 1, len(layers), f"recall: layer {layer_idx}")
    rows = []
    for method in methods:
        for budget in budgets:
            row = {"method": method, "budget": budget}
            for phase in ("decode", "prefill"):
                mine, oracle = sums.get((method, budget, phase)), sums.get(("oracle", budget, phase))
                if mine is None:
                    continue
                values = torch.cat(mine[2]).double()
                units = sums.get(((method, "units"), budget, phase))
                row[phase] = {"recall": round(float(values.mean()), 4),
                              "units": None if units is None else round(float(torch.cat(units[2]).double().mean()), 4),
                              "recall_p10": round(float(torch.quantile(values, 0.1)), 4),
                              "oracle": round(float(torch.cat(oracle[2]).double().mean()), 4),
                              "by_layer_head": (mine[0] / mine[1]).round(decimals=4).tolist(),
                              "oracle_by_layer_head": (oracle[0] / oracle[1]).round(decimals=4).tolist()}
            rows.append(row)
    return {"global_layers": layers, "heads": lm.num_heads, "kv_heads": lm.num_kv_heads, "rows": rows,
            "oracle": "per KV head and step, the b x L keys with the most weight summed over its query heads",
            "units": "the unit ceiling: per KV head and step, the method's own units with the most weight per key, "
                     "as many keys as it read"}
