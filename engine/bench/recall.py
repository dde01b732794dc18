"""Attention recall of the GQA selection choices: one selection per KV head ("kv") vs per query head ("query").

    python -m engine.bench.recall [--capture .bench/keys.safetensors] [--length 16384] [--heads 8/2] [--json]

CPU is enough (the PyTorch reference backend). Keys, values and queries are the real ones of `squeeze bench
capture`, extended as engine/bench/extend.py says (float32). Each method's index is built as the engine builds it
(engine.context.ingest.build_methods; the last DENSE_TAIL keys stay dense; selections are mapped back from the method's
K/V layout) and calibrated on the DENSE_TAIL queries just before the evaluated ones, once per group mode, each on
its own scores (the methods' `group` setting), as an ingest would. Modes:
- kv:    one selection per KV head, from the mean over its query heads of S (eq. 1); every query head of the group
         attends to it; each selected key is read once per group (the engine's default);
- query: one selection per query head (the paper's MHA form); a kernel that reads each key once per group reads
         the union of the group's selections;
- union: the "query" selections merged per KV head: every query head attends to the union it reads anyway.
For every mode, method and sparsity, over `--decode-tokens` single-token lookups (the query tokens right after the
calibration ones) and, with `--prefill-tokens N`, one N-token question looked up at once (engine's prefill rule):
- recall: the exact attention mass (softmax over ALL fixed-context keys, per query head) on the keys the head
  attends to; mean over (query head, token), its 10th percentile and minimum;
- kept: selected keys / context length, mean over the selection's rows (and tokens);
- bytes: K and V elements read per step (each key once per KV head: the "kv" selection, the group's union for
  "query" and "union") plus the index elements the lookup reads (Lookup.index_elements), over dense K and V: the
  engine's kv_budget (engine/attention/stats.py);
- err: relative L2 error of the attention output over the selected keys vs full attention, mean over (head, token).
`equal_bytes` interpolates the "query" and "union" curves (over all measured sparsities) at each "kv" point's
bytes. Ends with one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

from engine.bench.kept import method_settings
from engine.bench.kernels import DENSE_TAIL, HEAD_DIM, build_indexes
from engine.methods import SPARSE_METHODS, CalibrationSet
from kernels.backend import REFERENCE
from kernels.layout import ClusterLayout

MODES = ("kv", "query", "union")


def full_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact attention probabilities of q [Hq, T, D] over every key of k [Hkv, L, D] (GQA) -> [Hq, T, L] float32."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    s = torch.matmul(q.float().reshape(hkv, (hq // hkv) * t, d), k.float().transpose(1, 2)) * scale
    return torch.softmax(s, dim=-1).reshape(hq, t, -1)


def _apply_v(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [Hq, T, L] (weights over keys) @ v [Hkv, L, D] per GQA group -> [Hq, T, D] float32."""
    hq, t, lk = p.shape
    hkv = v.shape[0]
    return torch.matmul(p.reshape(hkv, (hq // hkv) * t, lk), v.float()).reshape(hq, t, -1)


def recall_and_error(probs: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     full_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention recall and output error of a selection.

    probs: [Hq, T, L] exact softmax over all keys; v: [Hkv, L, D]; mask: [Hq, T, L] bool (or broadcastable), the keys
    each (query head, token) attends to; full_out: [Hq, T, D] full attention output (computed when None).
    Returns recall [Hq, T] (mass of probs on the mask) and err [Hq, T]: ||o_sel - o_full|| / ||o_full||, where o_sel
    is softmax attention restricted to the mask (= the masked probs renormalised; 1 where the mask is empty).
    """
    kept = probs * mask
    recall = kept.sum(dim=-1)
    if full_out is None:
        full_out = _apply_v(probs, v)
    out = _apply_v(kept, v) / recall.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    err = (out - full_out).norm(dim=-1) / full_out.norm(dim=-1).clamp_min(1e-30)
    return recall, torch.where(recall > 0, err, torch.ones_like(err))


def head_masks(mask: torch.Tensor, mode: str, hq: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A lookup's selection masks [rows, ..., L] (rows = Hkv for "kv", Hq otherwise) -> (what each query head
    attends to [Hq, ..., L], what each KV head reads [Hkv, ..., L])."""
    g = hq // hkv
    if mode == "kv":
        return mask.repeat_interleave(g, dim=0), mask
    read = mask.reshape(hkv, g, *mask.shape[1:]).any(dim=1)
    return (mask if mode == "query" else read.repeat_interleave(g, dim=0)), read


def _stats(recall: torch.Tensor, err: torch.Tensor) -> dict:
    r = recall.flatten().double()
    return {"recall": round(float(r.mean()), 4), "recall_p10": round(float(torch.quantile(r, 0.1)), 4),
            "recall_min": round(float(r.min()), 4), "err": round(float(err.double().mean()), 4),
            "err_p90": round(float(torch.quantile(err.flatten().double(), 0.9)), 4)}


def _interp(xs: list[float], ys: list[float], x: float) -> float | None:
    """Linear interpolation of y at x over points sorted by x; None outside their range."""
    pts = sorted(zip(xs, ys))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1] if pts and x == pts[0][0] else None


def equal_bytes(rows: list[dict], phase: str = "decode") -> list[dict]:
    """For every "kv" row: the "query" and "union" recall, p10 and error interpolated at its bytes."""
    out = []
    for row in rows:
        if row["mode"] != "kv" or row["phase"] != phase:
            continue
        entry = {"method": row["method"], "sparsity": row["sparsity"], "bytes": row["bytes"],
                 "kv": {k: row[k] for k in ("recall", "recall_p10", "err")}}
        for mode in ("query", "union"):
            curve = [r for r in rows if r["method"] == row["method"] and r["mode"] == mode and r["phase"] == phase]
            xs = [r["bytes"] for r in curve]
            vals = {k: _interp(xs, [r[k] for r in curve], row["bytes"]) for k in ("recall", "recall_p10", "err")}
            entry[mode] = {k: (None if v is None else round(v, 4)) for k, v in vals.items()}
        out.append(entry)
    return out


def in_original_order(mask: torch.Tensor, layout: ClusterLayout | None, hkv: int) -> torch.Tensor:
    """A selection's mask [rows, ..., L] of positions in a method's layout -> the same keys in original order, on the
    mask's device (the layout may live on the model's GPU while the eval's masks are on the CPU)."""
    if layout is None:
        return mask
    rows = mask.shape[0]
    heads = torch.arange(rows, device=layout.order.device) * hkv // rows
    order = layout.order[heads].to(mask.device)  # [rows, L]: original position of each laid-out one
    order = order.view(rows, *([1] * (mask.dim() - 2)), -1).expand_as(mask)
    return torch.zeros_like(mask).scatter_(-1, order, mask)


def run(capture_path: str, length: int, hq: int, hkv: int, sparsities: list[float], methods: list[str],
        settings: dict[str, dict], decode_tokens: int = 128, prefill_tokens: int = 0, verbose: bool = False) -> dict:
    """settings: method -> its settings (engine.bench.kept.method_settings); each method is measured with one
    selection per KV head ("kv") and per query head ("query", "union") where it has the `group` setting."""
    from safetensors.torch import load_file

    from engine.bench.extend import extend

    captured = load_file(capture_path)
    tail = DENSE_TAIL
    start = time.perf_counter()
    q_all, k, v = extend(captured, length, hkv, hq, tail + max(decode_tokens, prefill_tokens), HEAD_DIM,
                         torch.float32, "cpu")
    calib_q = q_all[:, :tail]  # the tokens before the evaluated ones
    indexes, _, instances, _ = build_indexes(k, calib_q, methods, HEAD_DIM ** -0.5, tail, settings)
    build_s = time.perf_counter() - start
    evaluated = q_all[:, tail:]
    scale = HEAD_DIM ** -0.5
    dense = hkv * length * 2 * HEAD_DIM  # K and V elements of the fixed context
    decode_q = evaluated[:, :decode_tokens]
    probs = full_probs(decode_q, k, scale)  # [Hq, T, L]
    full_out = _apply_v(probs, v)
    out: dict = {"capture": capture_path, "length": length, "hq": hq, "hkv": hkv, "head_dim": HEAD_DIM,
                 "settings": {n: m.settings.as_dict() for n, m in instances.items()}, "dense_tail": tail,
                 "decode_tokens": decode_tokens, "prefill_tokens": prefill_tokens,
                 "index_build_s": round(build_s, 2), "results": []}
    prefill_jobs = []  # (row, head mask [Hq, L]) evaluated after the decode loop, one pass over the heads
    for name in methods:
        index = indexes[name]
        layout = instances[name].layout(index)
        grouped = "group" in instances[name].Settings.__dataclass_fields__  # duo: a row per KV head, always
        for group in ("kv", "query") if grouped else ("kv",):
            policy = type(instances[name])(replace(instances[name].settings, group=group)) if grouped \
                else instances[name]
            calibration = policy.calibrate([CalibrationSet(index=index, queries=calib_q)], scale)
            for sparsity in sparsities:
                plan = policy.plan(calibration, 1.0 - sparsity)
                masks, index_read = [], []
                for t in range(decode_tokens):
                    lookup = policy.lookup(decode_q[:, t : t + 1], index, plan, scale, REFERENCE,
                                           torch.tensor([length + t]))  # captured queries placed after the context
                    masks.append(lookup.selection.to_mask())
                    index_read.append(float(lookup.index_elements.sum()))
                mask = in_original_order(torch.stack(masks, dim=1), layout, hkv)  # [rows, T, L]
                index_elements = sum(index_read) / len(index_read)
                for mode in (("kv",) if group == "kv" else ("query", "union")):
                    attend, read = head_masks(mask, mode, hq, hkv)
                    recall, err = recall_and_error(probs, v, attend, full_out)
                    rows_kept = mask if mode != "union" else read
                    row = {"method": name, "mode": mode, "phase": "decode", "sparsity": sparsity,
                           **_stats(recall, err),
                           "kept": round(float(rows_kept.sum(dim=-1).double().mean()) / length, 4),
                           "bytes": round((float(read.sum(dim=-1).double().sum(dim=0).mean()) * 2 * HEAD_DIM
                                           + index_elements) / dense, 4),
                           "index_bytes": round(index_elements / dense, 4)}
                    out["results"].append(row)
                    if verbose:
                        print(json.dumps(row), file=sys.stderr, flush=True)
                if prefill_tokens:
                    lookup = policy.lookup(evaluated[:, :prefill_tokens], index, plan, scale, REFERENCE,
                                           torch.arange(length, length + prefill_tokens))
                    mask = in_original_order(lookup.selection.to_mask(), layout, hkv)  # [rows, L]
                    for mode in (("kv",) if group == "kv" else ("query", "union")):
                        attend, read = head_masks(mask, mode, hq, hkv)
                        prefill_jobs.append(({"method": name, "mode": mode, "phase": f"prefill{prefill_tokens}",
                                              "sparsity": sparsity,
                                              "kept": round(float((mask if mode != "union" else read).sum(dim=-1)
                                                                  .double().mean()) / length, 4),
                                              "bytes": round((float(read.sum()) * 2 * HEAD_DIM
                                                              + float(lookup.index_elements.sum())) / dense, 4),
                                              "index_bytes": round(float(lookup.index_elements.sum()) / dense, 4)},
                                             attend))
    if prefill_jobs:
        _prefill(evaluated[:, :prefill_tokens], k, v, scale, prefill_jobs)
        for row, _ in prefill_jobs:
            out["results"].append(row)
            if verbose:
                print(json.dumps(row), file=sys.stderr, flush=True)
    out["equal_bytes"] = equal_bytes(out["results"])
    if prefill_tokens:
        out["equal_bytes_prefill"] = equal_bytes(out["results"], f"prefill{prefill_tokens}")
    out["total_s"] = round(time.perf_counter() - start, 1)
    return out


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, jobs: list) -> None:
    """Recall and output error of every job's fixed per-head mask [Hq, L] over the question's tokens q [Hq, P, D],
    one query head at a time (its probabilities [P, L] computed once); fills each job's row."""
    hq, hkv = q.shape[0], k.shape[0]
    recalls = [[] for _ in jobs]
    errs = [[] for _ in jobs]
    for h in range(hq):
        kvh = h * hkv // hq
        p = full_probs(q[h : h + 1], k[kvh : kvh + 1], scale)[0]  # [P, L]
        vh = v[kvh].float()
        full = p @ vh  # [P, D]
        for j, (_, attend) in enumerate(jobs):
            idx = attend[h].nonzero().flatten()
            recall = p[:, idx].sum(dim=1)
            o = (p[:, idx] @ vh[idx]) / recall.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
            recalls[j].append(recall)
            errs[j].append((o - full).norm(dim=-1) / full.norm(dim=-1).clamp_min(1e-30))
    for j, (row, _) in enumerate(jobs):
        stats = _stats(torch.stack(recalls[j]), torch.stack(errs[j]))
        kept, bytes_, index_bytes = row.pop("kept"), row.pop("bytes"), row.pop("index_bytes")
        row.update(stats, kept=kept, bytes=bytes_, index_bytes=index_bytes)


def table(doc: dict) -> str:
    """A Markdown table of the results."""
    lines = ["| method | phase | mode | sparsity | recall | p10 | min | kept | bytes | err |", "|" + "---|" * 10]
    for r in doc["results"]:
        lines.append(f"| {r['method']} | {r['phase']} | {r['mode']} | {r['sparsity']} | {r['recall']:.4f} | "
                     f"{r['recall_p10']:.4f} | {r['recall_min']:.4f} | {r['kept']:.4f} | {r['bytes']:.4f} | "
                     f"{r['err']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.recall", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", default=".bench/keys.safetensors", help="keys captured by `squeeze bench capture`")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--heads", default="8/2", help="query/KV heads")
    parser.add_argument("--sparsities", default="0.7,0.8,0.9,0.95",
                        help="sparsities measured (add points, e.g. 0.97,0.98, to widen the equal-bytes curves)")
    parser.add_argument("--methods", default=",".join(SPARSE_METHODS))
    parser.add_argument("--centroid-ratio", type=float, default=0.05)
    parser.add_argument("--level1-prune", type=float, default=0.5)
    parser.add_argument("--kmeans-iters", type=int, default=10)
    parser.add_argument("--decode-tokens", type=int, default=128, help="single-token lookups (after the calibration)")
    parser.add_argument("--prefill-tokens", type=int, default=0, help="also one question of N tokens (0: none)")
    parser.add_argument("--prefill-threshold", default="decode", choices=("decode", "calibrated"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: the per-token lookups are small; more threads only add syncs)")
    parser.add_argument("--table", action="store_true", help="a Markdown table on stderr too")
    parser.add_argument("--json", action="store_true", help="no per-row progress on stderr")
    args = parser.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    settings = method_settings(args.centroid_ratio, args.level1_prune, args.kmeans_iters)
    for name in ("squeeze", "hsqueeze"):
        settings[name]["prefill_threshold"] = args.prefill_threshold
    result = run(args.capture, args.length, hq, hkv, [float(s) for s in args.sparsities.split(",")],
                 args.methods.split(","), settings, args.decode_tokens, args.prefill_tokens, verbose=not args.json)
    if args.table:
        print(table(result), file=sys.stderr)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
