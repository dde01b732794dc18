"""Kept fraction by phase: how much of the fixed context a lookup keeps at each sparsity, decode vs question prefill.

    python -m engine.bench.kept [--capture .bench/keys.safetensors] [--length 16384] [--heads 8/2] [--json]

CPU is enough (the PyTorch reference backend; no attention is run, only the lookups). Keys and queries are the
real ones of `squeeze bench capture`, extended as engine/bench/extend.py says (float32). The index is built as the
engine builds it (each method through engine.context.ingest.build_methods; the last DENSE_TAIL keys stay dense) and calibrated
on the DENSE_TAIL queries just before the question's tokens, as an ingest calibrates on the document's last tokens.
Then, for each method and sparsity:
- decode: every one of the last `--decode-tokens` query tokens looked up alone (Lq = 1), kept fraction averaged;
- prefillN: questions of N tokens (the last N query tokens, and up to `--windows` disjoint earlier windows of N
  within the longest question), each looked up at once as the question's prefill is, kept fraction averaged;
  once per `--prefill-thresholds` mode (the threshold methods' prefill_threshold: "decode", decode's thresholds,
  the default; "calibrated", the prefill's own; a top-K method reads the same in both).
The kept fraction is the selection's keys (the kept clusters and the dense tail) over the context length, averaged
over selection rows, as the kernel benchmark's "kept". Ends with one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

from engine.bench.kernels import DENSE_TAIL, HEAD_DIM, build_indexes
from engine.methods import SPARSE_METHODS, LayerIndex, Method, StepPlan
from kernels.backend import REFERENCE

MODES = ("decode", "calibrated")  # the question prefill's thresholds: decode's, or calibrated on the prefill score


def kept_fraction(method: Method, q: torch.Tensor, index: LayerIndex, plan: StepPlan, scale: float,
                  length: int) -> float:
    """Keys the lookup of q [Hq, Lq, D] selects (kept units + dense tail) over `length`, averaged over rows."""
    at = torch.arange(index.num_keys, index.num_keys + q.shape[1])  # as a question after the context
    lookup = method.lookup(q, index, plan, scale, REFERENCE, at)
    return float(lookup.selection.counts().double().mean()) / length


def with_prefill_mode(plan: StepPlan, mode: str) -> StepPlan:
    """A threshold plan whose question prefill uses decode's thresholds (mode "decode") or its own ("calibrated");
    other plans (top-K) are the same in both phases."""
    return replace(plan, prefill=plan.decode) if mode == "decode" and hasattr(plan, "prefill") else plan


def windows(lq: int, available: int, count: int) -> list[tuple[int, int]]:
    """Up to `count` disjoint [start, end) windows of lq tokens, the last one ending at `available`."""
    return [(available - (i + 1) * lq, available - i * lq) for i in range(min(count, available // lq))]


def method_settings(centroid_ratio: float, level1_prune: float, kmeans_iters: int) -> dict[str, dict]:
    """The threshold methods' settings for the bench: both prefill modes calibrated (each mode picks its own)."""
    return {"squeeze": {"centroid_ratio": centroid_ratio, "kmeans_iters": kmeans_iters,
                        "prefill_threshold": "calibrated"},
            "hsqueeze": {"level1_ratio": min(0.01, centroid_ratio), "level1_prune": level1_prune,
                         "kmeans_iters": kmeans_iters, "prefill_threshold": "calibrated"}}


def run(capture_path: str, length: int, hq: int, hkv: int, questions: list[int], sparsities: list[float],
        methods: list[str], settings: dict[str, dict], decode_tokens: int = 64, n_windows: int = 8,
        modes: tuple[str, ...] = MODES, verbose: bool = False) -> dict:
    from safetensors.torch import load_file

    from engine.bench.extend import extend

    captured = load_file(capture_path)
    longest = max(questions + [decode_tokens])
    start = time.perf_counter()
    q_all, k, _ = extend(captured, length, hkv, hq, longest + DENSE_TAIL, HEAD_DIM, torch.float32, "cpu")
    scale = HEAD_DIM ** -0.5
    calib_q = q_all[:, :DENSE_TAIL]  # the tokens before the question
    indexes, calibrations, instances, _ = build_indexes(k, calib_q, methods, scale, DENSE_TAIL, settings)
    build_s = time.perf_counter() - start
    question = q_all[:, DENSE_TAIL:]  # [Hq, longest, D]
    out: dict = {
        "capture": capture_path, "length": length, "hq": hq, "hkv": hkv, "head_dim": HEAD_DIM,
        "settings": {n: m.settings.as_dict() for n, m in instances.items()}, "decode_tokens": decode_tokens,
        "windows": n_windows, "index_build_s": round(build_s, 2), "results": [],
    }
    for name in methods:
        method, index = instances[name], indexes[name]
        for sparsity in sparsities:
            plan = method.plan(calibrations[name], 1.0 - sparsity)
            decode = [kept_fraction(method, question[:, t : t + 1], index, plan, scale, length)
                      for t in range(question.shape[1] - decode_tokens, question.shape[1])]
            for mode in modes:
                step_plan = with_prefill_mode(plan, mode)
                row: dict = {"method": name, "sparsity": sparsity, "prefill_threshold": mode,
                             "target": round(1 - sparsity, 4), "plan": step_plan.describe(),
                             "decode": round(sum(decode) / len(decode), 4)}
                for lq in questions:
                    kept = [kept_fraction(method, question[:, a:b], index, step_plan, scale, length)
                            for a, b in windows(lq, question.shape[1], n_windows)]
                    row[f"prefill{lq}"] = round(sum(kept) / len(kept), 4)
                out["results"].append(row)
                if verbose:
                    print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.kept", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", default=".bench/keys.safetensors", help="keys captured by `squeeze bench capture`")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--heads", default="8/2", help="query/KV heads")
    parser.add_argument("--questions", default="16,64,256,1024", help="question lengths (prefill tokens)")
    parser.add_argument("--sparsities", default="0.5,0.7,0.8,0.9,0.95")
    parser.add_argument("--methods", default=",".join(SPARSE_METHODS))
    parser.add_argument("--centroid-ratio", type=float, default=0.05)
    parser.add_argument("--level1-prune", type=float, default=0.5)
    parser.add_argument("--kmeans-iters", type=int, default=10)
    parser.add_argument("--decode-tokens", type=int, default=64, help="single-token lookups averaged for decode")
    parser.add_argument("--windows", type=int, default=8, help="questions averaged per prefill length")
    parser.add_argument("--prefill-thresholds", default=",".join(MODES),
                        help="prefill threshold modes to measure (the threshold methods' prefill_threshold)")
    parser.add_argument("--json", action="store_true", help="no per-row progress on stderr")
    args = parser.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    settings = method_settings(args.centroid_ratio, args.level1_prune, args.kmeans_iters)
    result = run(args.capture, args.length, hq, hkv, _ints(args.questions),
                 [float(s) for s in args.sparsities.split(",")], args.methods.split(","), settings,
                 args.decode_tokens, args.windows, tuple(args.prefill_thresholds.split(",")), verbose=not args.json)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
