"""Kept fraction by phase: how much of the fixed context a lookup keeps at each sparsity, decode vs question prefill.

    python -m engine.bench.kept [--capture .bench/keys.safetensors] [--length 16384] [--heads 8/2] [--json]

CPU is enough (the PyTorch reference backend; no attention is run, only the lookups). Keys and queries are the
real ones of `squeeze bench capture`, extended as engine/bench/extend.py says (float32). The index is built as the
engine builds it (squeeze, then hsqueeze over its centroids; the last DENSE_TAIL keys stay dense) and calibrated
on the DENSE_TAIL queries just before the question's tokens, as an ingest calibrates on the document's last tokens.
Then, for each method and sparsity:
- decode: every one of the last `--decode-tokens` query tokens looked up alone (Lq = 1), kept fraction averaged;
- prefillN: questions of N tokens (the last N query tokens, and up to `--windows` disjoint earlier windows of N
  within the longest question), each looked up at once as the question's prefill is, kept fraction averaged;
  once per `--prefill-thresholds` mode (IndexSettings.prefill_threshold: "decode", decode's thresholds, the
  default; "calibrated", the prefill's own).
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

from engine.bench.kernels import DENSE_TAIL, HEAD_DIM
from engine.bench.kernels import build_index as bench_index
from engine.config import IndexSettings
from engine.policies.base import CalibrationSet
from engine.policies.hsqueeze import HierarchicalSqueezePolicy
from engine.policies.squeeze import SqueezePolicy
from kernels.backend import REFERENCE

POLICIES = {"squeeze": SqueezePolicy(), "hsqueeze": HierarchicalSqueezePolicy()}


def build_index(k: torch.Tensor, settings: IndexSettings) -> dict[str, torch.Tensor]:
    """squeeze then hsqueeze over k [Hkv, L, D] without its dense tail, all heads at once (the GPU benchmark's
    builder)."""
    return bench_index(k, settings, heads_per_kmeans=k.shape[0], policies=tuple(POLICIES.values()))[0]


def kept_fraction(policy, q: torch.Tensor, index: dict, thresholds, scale: float, settings: IndexSettings,
                  length: int) -> float:
    """Keys the lookup of q [Hq, Lq, D] selects (kept clusters + dense tail) over `length`, averaged over rows."""
    lookup = policy.lookup(q, index, thresholds, scale, settings, REFERENCE)
    return float(lookup.selection.counts().double().mean()) / length


def windows(lq: int, available: int, count: int) -> list[tuple[int, int]]:
    """Up to `count` disjoint [start, end) windows of lq tokens, the last one ending at `available`."""
    return [(available - (i + 1) * lq, available - i * lq) for i in range(min(count, available // lq))]


def run(capture_path: str, length: int, hq: int, hkv: int, questions: list[int], sparsities: list[float],
        methods: list[str], settings: IndexSettings, decode_tokens: int = 64, n_windows: int = 8,
        modes: tuple[str, ...] = ("decode", "calibrated"), verbose: bool = False) -> dict:
    from safetensors.torch import load_file

    from engine.bench.extend import extend

    captured = load_file(capture_path)
    longest = max(questions + [decode_tokens])
    start = time.perf_counter()
    q_all, k, _ = extend(captured, length, hkv, hq, longest + settings.dense_tail, HEAD_DIM, torch.float32, "cpu")
    settings = replace(settings, prefill_threshold="calibrated")  # calibrate both phases; each mode picks its own
    index = build_index(k, settings)
    build_s = time.perf_counter() - start
    calib = CalibrationSet(index=index, queries=q_all[:, : settings.dense_tail])  # the tokens before the question
    question = q_all[:, settings.dense_tail :]  # [Hq, longest, D]
    scale = HEAD_DIM ** -0.5
    out: dict = {
        "capture": capture_path, "length": length, "hq": hq, "hkv": hkv, "head_dim": HEAD_DIM,
        "settings": settings.as_dict(), "decode_tokens": decode_tokens,
        "windows": n_windows, "index_build_s": round(build_s, 2), "results": [],
    }
    for name in methods:
        policy = POLICIES[name]
        calibration = policy.calibrate([calib], scale, settings)
        for sparsity in sparsities:
            thresholds = policy.thresholds(calibration, sparsity)
            decode = [kept_fraction(policy, question[:, t : t + 1], index, thresholds, scale, settings, length)
                      for t in range(question.shape[1] - decode_tokens, question.shape[1])]
            for mode in modes:
                step_settings = replace(settings, prefill_threshold=mode)
                row: dict = {"method": name, "sparsity": sparsity, "prefill_threshold": mode,
                             "target": round(1 - sparsity, 4), "thresholds": [float(f"{t:.4g}") for t in thresholds],
                             "decode": round(sum(decode) / len(decode), 4)}
                for lq in questions:
                    kept = [kept_fraction(policy, question[:, a:b], index, thresholds, scale, step_settings, length)
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
    parser.add_argument("--methods", default="squeeze,hsqueeze")
    parser.add_argument("--centroid-ratio", type=float, default=0.05)
    parser.add_argument("--level1-prune", type=float, default=0.5)
    parser.add_argument("--kmeans-iters", type=int, default=10)
    parser.add_argument("--decode-tokens", type=int, default=64, help="single-token lookups averaged for decode")
    parser.add_argument("--windows", type=int, default=8, help="questions averaged per prefill length")
    parser.add_argument("--prefill-thresholds", default="decode,calibrated",
                        help="prefill threshold modes to measure (IndexSettings.prefill_threshold)")
    parser.add_argument("--json", action="store_true", help="no per-row progress on stderr")
    args = parser.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    settings = IndexSettings(centroid_ratio=args.centroid_ratio, level1_ratio=min(0.01, args.centroid_ratio),
                             level1_prune=args.level1_prune, dense_tail=DENSE_TAIL, kmeans_iters=args.kmeans_iters)
    result = run(args.capture, args.length, hq, hkv, _ints(args.questions),
                 [float(s) for s in args.sparsities.split(",")], args.methods.split(","), settings,
                 args.decode_tokens, args.windows, tuple(args.prefill_thresholds.split(",")), verbose=not args.json)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
