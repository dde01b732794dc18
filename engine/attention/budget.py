"""The KV budget: the fraction of the fixed context's K and V bytes a step reads, index metadata included; one
meaning for every method and for both phases (a decode step, a question's prefill).

A method plans from key fractions (`Method.plan_keys`: the share of its indexed keys a step keeps, per phase). At
calibration, engine.attention.curves measures what the method's own lookups read at every key fraction of
KEYS_GRID (`read_fraction`, as engine.attention.stats counts a turn's kv_budget); the base `Method.plan` inverts
those curves (`keys_for`), so that a budget of 0.1 reads about 10% of the bytes whatever the method's index costs
(centroids, page bounds) and whatever the phase keeps (a prefill's union of tokens). A budget below what the index
and the dense tail alone cost cannot be met: the plan keeps the fewest keys the grid has, and the turn's
statistics show what was read. On the CPU a lookup also cuts its own scores at the budget (`exact_room`,
`cut_threshold`), so that a turn reads what it asked on any question, not what the calibration's queries would; the
centroid lookups do on a GPU too, inside their kernels (`cut_room`, `less_follow`).
"""

from __future__ import annotations

import torch

from kernels.reference.centroid import cut_threshold  # noqa: F401 (the lookups' exact cut, by its name here)
from kernels.selection import FollowRows, KeyCount, Selection

# Key fractions measured, from 1 down to 0.01: denser than the thresholds' calibration grid (SPARSITY_GRID), whose
# interpolated thresholds may read less between two of its points than a line between their reads (hsqueeze's two
# levels: 0.46 of the bytes where a line through 0.5 and 0.4 of the keys said 0.5).
KEYS_GRID = (1.0, 0.9, 0.8, 0.7, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3, 0.275, 0.25, 0.225, 0.2, 0.175, 0.15, 0.125,
             0.1, 0.085, 0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01)
# Bump when every method's calibration changes meaning: a build key that lacks it (engine.serve.service.Engine.build_key)
# is stale, so old contexts rebuild their indexes and calibrations on their next question (one method's: its
# Method.revision).
CALIBRATION_VERSION = 2
# Rounds of fitting a CPU cut that keeps a number of units (Quest's pages) to the follow rows its units hold: each
# round keeps that many more keys, and more units hold more of the rows (exact_room takes every one out)
HELD_ROUNDS = 2


def read_fraction(selection: Selection | None, index_elements: torch.Tensor, head_dim: int, num_keys: int) -> float:
    """The share of the fixed K/V bytes one step reads: each KV head's selected keys once (the union of its
    selection rows; None: every key), K and V, plus the index elements it read ([Hkv]); over
    Hkv x num_keys x 2 x head_dim."""
    if selection is None:
        return 1.0
    hkv = index_elements.numel()
    keys = selection.to_mask().reshape(hkv, selection.rows // hkv, -1).any(dim=1).sum()
    return byte_share(float(keys), float(index_elements.double().sum()), hkv, num_keys, head_dim)


def byte_share(keys: float, index_elements: float, hkv: int, num_keys: int, head_dim: int) -> float:
    """The share of the fixed K/V bytes that `keys` keys (K and V, counted over the KV heads) and `index_elements`
    index elements are: over Hkv x num_keys x 2 x head_dim."""
    return (keys * 2 * head_dim + index_elements) / (hkv * num_keys * 2 * head_dim)


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


def less_follow(keys: float, hkv: int, follow: FollowRows | None) -> KeyCount:
    """`keys` less each of the step's follow rows among the indexed keys, once per KV head, counted where the lookup
    runs (a GPU's inside its kernels). A row already inside a kept unit is not read twice: the CPU's exact cuts count
    each unit's keys less the rows it holds (KeyCount.held, with the follow rows' order); a GPU's, inside its
    kernels, counts whole units (a few keys under)."""
    if follow is None:
        return KeyCount(keys)
    return KeyCount(keys, listed=follow.positions, lo=follow.first, hi=follow.first + follow.indexed,
                    per_listed=float(hkv), order=follow.order)


def cut_room(plan, q: torch.Tensor, follow: FollowRows | None) -> tuple[float, FollowRows | None] | None:
    """exact_room for a lookup that cuts at a number of keys inside its kernels (squeeze's, hsqueeze's and
    duo-squeeze's: the centroid ops' keys, whole bins of a histogram of the scores, as near as the exact cut on a
    real model's thousands of clusters), on any device: (room, the follow rows its count takes out: less_follow);
    None where the plan keeps what its calibration keeps."""
    if getattr(plan, "room", None) is None:
        return None
    if follow is None:
        return (plan.room[0] if q.shape[1] == 1 else plan.room[1]), None
    return plan.budget, follow


def exact_room(plan, q: torch.Tensor, follow: FollowRows | None, hkv: int) -> tuple[float, torch.Tensor | float] | None:
    """(room, keys read besides): the share of the fixed K/V bytes a lookup cuts its scores to read (cut_threshold,
    or a number of units) and the keys the step reads besides its units and the dense rows; None where it keeps what
    its plan's calibration keeps. With the step's follow rows: the budget, and each indexed follow row once per KV
    head (those a row already keeps are not read twice: a few keys under); without them, the plan's room (its
    reserve for them left out). On the CPU every lookup cuts (its sort is nothing beside the model's step); on a GPU
    these lookups keep their plan, since a torch sort and gathers cost more than the lookup's own launches (with
    them, a short question's prefill of hsqueeze was slower than full attention's on an H200; the centroid lookups
    cut inside their kernels instead: cut_room)."""
    if getattr(plan, "room", None) is None or q.device.type != "cpu":
        return None
    if follow is None:
        return (plan.room[0] if q.shape[1] == 1 else plan.room[1]), 0.0
    p = follow.positions
    return plan.budget, hkv * ((p >= follow.first) & (p < follow.first + follow.indexed)).sum()
