"""The budget's calibration: what a method's own lookups read at every key fraction of KEYS_GRID, over a
context's calibration queries (single tokens for decode, windows of tokens for a question's prefill:
engine.index.thresholds.prefill_windows). `Method.plan` inverts these curves (engine.attention.budget.keys_for)."""

from __future__ import annotations

import torch

from engine.attention.budget import KEYS_GRID
from engine.attention.method import CalibrationSet, Method, Tensors
from engine.index.thresholds import prefill_windows

DECODE_TOKENS = 16  # calibration tokens measured as decode steps (evenly spaced; all of them when fewer)
PREFILL_WINDOWS = 2  # windows of each question length (engine.index.thresholds.prefill_windows)
MAX_LAYERS = 4  # global layers measured (evenly spaced; all of them when fewer): a budget is their mean


def budget_curves(method: Method, layers: list[CalibrationSet], scale: float, calibration: Tensors) -> Tensors:
    """{"budget_decode", "budget_prefill"}: [len(KEYS_GRID)] float64, the mean share of the K/V bytes read at each
    key fraction of KEYS_GRID over the calibration queries of up to MAX_LAYERS global layers (decode: up to
    DECODE_TOKENS single tokens; prefill: windows of them, each length weighted alike), through `Method.reads`:
    the reference lookups at every key fraction (H100, Llama-3-8B shape at 128K, squeeze and Quest, 8 layers: 15 s;
    the Triton lookups took 32 s, a compilation per question length and a launch per step), or a method's own count
    of the same reads (squeeze, duo-squeeze and saap score a step once for all the fractions, hsqueeze its level 2
    once per level-1 threshold, Quest counts pages: squeeze 2.8 -> 0.08 s on an H200 at 128K)."""
    plans = [method.plan_keys(calibration, keys, keys, keys) for keys in KEYS_GRID]
    d_sum, p_sum = [0.0] * len(plans), [0.0] * len(plans)
    d_n = p_w = 0.0
    with torch.inference_mode():  # ~2,300 small lookups per method: autograd's bookkeeping is 10-20% of them
        for layer in layers[:: max(1, -(-len(layers) // MAX_LAYERS))]:
            q, pos = layer.queries, layer.query_positions()
            n = q.shape[1]
            step = max(1, n // DECODE_TOKENS)
            for t in range(n - 1, -1, -step)[:DECODE_TOKENS]:
                for i, read in enumerate(method.reads(q[:, t : t + 1], layer.index, plans, scale, pos[t : t + 1])):
                    d_sum[i] += read
                d_n += 1
            for a, b, w in prefill_windows(n, PREFILL_WINDOWS):
                for i, read in enumerate(method.reads(q[:, a:b], layer.index, plans, scale, pos[a:b])):
                    p_sum[i] += w * read
                p_w += w
    decode = [s / max(d_n, 1) for s in d_sum]
    prefill = [s / max(p_w, 1e-12) for s in p_sum]
    return {"budget_decode": torch.tensor(decode, dtype=torch.float64),
            "budget_prefill": torch.tensor(prefill, dtype=torch.float64)}
