"""The KV budget: the fraction of the fixed context's K and V bytes a step reads, index metadata included; one
meaning for every method and for both phases (a decode step, a question's prefill).

A method plans from key fractions (`Method.plan_keys`: the share of its indexed keys a step keeps, per phase). At
calibration, `budget_curves` runs the method's own lookups over the context's calibration queries at every key
fraction of KEYS_GRID and measures what they read (`read_fraction`, as engine.stats counts a turn's kv_budget):
single tokens for decode, windows of tokens for a question's prefill (engine.calibrate.prefill_windows). The
base `Method.plan` inverts those curves (`keys_for`), so that a budget of 0.1 reads about 10% of the bytes
whatever the method's index costs (centroids, page bounds) and whatever the phase keeps (a prefill's union of
tokens). A budget below what the index and the dense tail alone cost cannot be met: the plan keeps the fewest
keys the grid has, and the turn's statistics show what was read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.calibrate import prefill_windows

if TYPE_CHECKING:
    from engine.policies.base import CalibrationSet, Lookup, Method, Tensors

# Key fractions measured, from 1 down to 0.01: denser than the thresholds' calibration grid (SPARSITY_GRID), whose
# interpolated thresholds may read less between two of its points than a line between their reads (hsqueeze's two
# levels: 0.46 of the bytes where a line through 0.5 and 0.4 of the keys said 0.5).
KEYS_GRID = (1.0, 0.9, 0.8, 0.7, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3, 0.275, 0.25, 0.225, 0.2, 0.175, 0.15, 0.125,
             0.1, 0.085, 0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01)
DECODE_TOKENS = 16  # calibration tokens measured as decode steps (evenly spaced; all of them when fewer)
PREFILL_WINDOWS = 2  # windows of each question length (engine.calibrate.prefill_windows)
MAX_LAYERS = 4  # global layers measured (evenly spaced; all of them when fewer): a budget is their mean
# Bump when the calibrations change meaning: a build key that lacks it (engine.serve.service.Engine.build_key) is
# stale, so old contexts rebuild their indexes and calibrations on their next question.
CALIBRATION_VERSION = 2


def read_fraction(lookup: Lookup, head_dim: int, num_keys: int) -> float:
    """The share of the fixed K/V bytes one step's lookup reads: each KV head's selected keys once (the union of
    its selection rows), K and V, plus the index elements it read (Lookup.index_elements, [Hkv]); over
    Hkv x num_keys x 2 x head_dim."""
    sel = lookup.selection
    if sel is None:
        return 1.0
    hkv = lookup.index_elements.numel()
    keys = sel.to_mask().reshape(hkv, sel.rows // hkv, -1).any(dim=1).sum()
    return byte_share(float(keys), float(lookup.index_elements.double().sum()), hkv, num_keys, head_dim)


def byte_share(keys: float, index_elements: float, hkv: int, num_keys: int, head_dim: int) -> float:
    """The share of the fixed K/V bytes that `keys` keys (K and V, counted over the KV heads) and `index_elements`
    index elements are: over Hkv x num_keys x 2 x head_dim."""
    return (keys * 2 * head_dim + index_elements) / (hkv * num_keys * 2 * head_dim)


def budget_curves(method: Method, layers: list[CalibrationSet], scale: float, calibration: Tensors) -> Tensors:
    """{"budget_decode", "budget_prefill"}: [len(KEYS_GRID)] float64, the mean share of the K/V bytes read at each
    key fraction of KEYS_GRID over the calibration queries of up to MAX_LAYERS global layers (decode: up to
    DECODE_TOKENS single tokens; prefill: windows of them, each length weighted alike), through `Method.reads`:
    the reference lookups at every key fraction (H100, Llama-3-8B shape at 128K, squeeze and Quest, 8 layers: 15 s;
    the Triton lookups took 32 s, a compilation per question length and a launch per step), or a method's own count
    of the same reads (squeeze scores a step once for all the fractions: 2.8 -> 0.08 s on an H200 at 128K)."""
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


def keys_for(curve: torch.Tensor, budget: float) -> float:
    """The key fraction whose measured read (curve [len(KEYS_GRID)], at KEYS_GRID) is `budget`, interpolated
    linearly between grid points; 1 where the budget covers the whole curve, the grid's fewest keys where it is below
    what the fewest keys read (the index and the dense tail alone may cost more than a small budget)."""
    reads = curve.double().tolist()
    # KEYS_GRID falls; make the reads fall with it (a noisy point never lets more keys read less)
    for i in range(len(reads) - 2, -1, -1):
        reads[i] = max(reads[i], reads[i + 1])
    if budget >= reads[0]:
        return 1.0
    for i in range(len(reads) - 1):
        hi, lo = reads[i], reads[i + 1]
        if lo <= budget <= hi:
            t = 0.0 if hi == lo else (budget - lo) / (hi - lo)
            return KEYS_GRID[i + 1] + t * (KEYS_GRID[i] - KEYS_GRID[i + 1])
    return KEYS_GRID[-1]
