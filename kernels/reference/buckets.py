"""Reference of Saap's lookup kernels (kernels/jit/buckets.py): the queries' bucket scores (RoPE undone, each KV
head's classifier, softmax over the buckets, summed over the group) and the best-buckets pick (a score threshold
that reaches a number of keys). `derope` and `classify` are the engine's one implementation of both steps (its
training and its index use them too: engine.index.rope, engine.methods.saap.partitions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference._common import token_mean_and_last
from kernels.reference.compact import expand_groups
from kernels.selection import Selection


def derope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [..., L, D] rotated by rotate-half RoPE at `positions` [L] (int64, on x's device), one angle per position
    and plane in inv_freq [D / 2] -> x rotated back, float32 (the same shape). No host synchronisation."""
    half = x.shape[-1] // 2
    if inv_freq.numel() != half:
        raise ValueError(f"inv_freq has {inv_freq.numel()} planes; vectors of {x.shape[-1]} dims have {half}")
    # float64 angles: float32's are off by up to position x 6e-8 radians (0.008 at 128K), which the model's own
    # float32 rotation already is; undoing it adds no more
    angle = positions.to(torch.float64)[:, None] * inv_freq.to(device=x.device, dtype=torch.float64)[None, :]
    cos, sin = torch.cos(angle).float(), torch.sin(angle).float()  # [L, D / 2]
    xf = x.float()
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat([a * cos + b * sin, b * cos - a * sin], dim=-1)


def classify(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """x [U, N, D] unit de-RoPE'd queries -> logits [U, N, C] of each unit's classifier, a 2-layer MLP with an
    exact GELU: weights w1 [U, D, H], b1 [U, H], w2 [U, H, C], b2 [U, C]."""
    hidden = F.gelu(torch.baddbmm(weights["b1"][:, None, :], x, weights["w1"]))
    return torch.baddbmm(weights["b2"][:, None, :], hidden, weights["w2"])


def bucket_scores(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, w1: torch.Tensor,
                  b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                  valid: torch.Tensor | None = None) -> torch.Tensor:
    """q [Hq, Lq, D] at positions [Lq] (int64), inv_freq [D / 2], one classifier per KV head (w1 [Hkv, D, H],
    b1 [Hkv, H], w2 [Hkv, H, C], b2 [Hkv, C]) -> [Hkv, C] float32: each query head's softmax over its KV head's
    buckets (of its query de-RoPE'd and normalised), summed over the KV head's query heads, averaged over the
    tokens (valid: [1] int64, the real ones, the first of Lq; None: all)."""
    hkv = w1.shape[0]
    hq, lq, d = q.shape
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not share {hkv} KV heads evenly")
    x = F.normalize(derope(q, positions.to(q.device), inv_freq), dim=-1)
    x = x.reshape(hkv, (hq // hkv) * lq, d)
    weights = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    probs = torch.softmax(classify(x, {n: t.to(device=q.device, dtype=torch.float32) for n, t in weights.items()}),
                          dim=-1)  # [Hkv, G * Lq, C]
    return token_mean_and_last(probs.reshape(hkv, hq // hkv, lq, -1).sum(1), valid)[0]


def best_buckets(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, w1: torch.Tensor,
                 b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, sizes: torch.Tensor | None,
                 budget: float, per_key: bool = False,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A lookup's two steps at once: (bucket_scores [Hkv, C] of the arguments as bucket_scores', take_best with
    sizes [Hkv, C] int64 and `budget` [Hkv, C] bool of the scores, or with `per_key` of the scores per key
    (`ranking`); None where sizes is None)."""
    score = bucket_scores(q, positions, inv_freq, w1, b1, w2, b2, valid)
    return score, None if sizes is None else take_best(ranking(score, sizes, per_key), sizes, budget)


def select_buckets(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, w1: torch.Tensor,
                   b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, sizes: torch.Tensor, budget: float,
                   starts: torch.Tensor, total: int, tail: int = 0, per_key: bool = False,
                   valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, Selection]:
    """best_buckets (score [Hkv, C], keep [Hkv, C]) and the Selection of the kept buckets' positions: bucket c of
    head h at starts[h, c] .. starts[h, c + 1] - 1 ([Hkv, C + 1] int64), then every row's `tail` positions from
    `total` on (kernels.reference.compact.expand_groups)."""
    score, keep = best_buckets(q, positions, inv_freq, w1, b1, w2, b2, sizes, budget, per_key, valid)
    return score, keep, expand_groups(keep, starts, total, tail)


def ranking(score: torch.Tensor, sizes: torch.Tensor, per_key: bool) -> torch.Tensor:
    """What buckets are taken best first by: score [H, C] float32 itself, or with `per_key` the score per key the
    bucket holds (score / max(size, 1), sizes [H, C] int64): under a budget of keys, the buckets that give the
    most of the predicted weight for the keys they cost."""
    return score / sizes.clamp(min=1).to(score.dtype) if per_key else score


def take_best(score: torch.Tensor, sizes: torch.Tensor, budget: float) -> torch.Tensor:
    """score [H, C] float32, sizes [H, C] int64 keys per bucket -> keep [H, C] bool: the buckets scoring at least
    tau, where tau is the highest bucket score whose buckets at or above it hold at least `budget` keys (every
    bucket where none does). The buckets best first until the budget, the one that reaches it included; buckets
    tied at tau all kept. O(C^2) per row, no sort."""
    return take_best_held(score, held_keys(score, sizes), budget)


def held_keys(score: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """score [H, C] float32, sizes [H, C] int64 -> [H, C] float32: the keys of the buckets scoring at least each
    bucket's score (take_best's count, which no budget changes: one count serves every budget)."""
    if score.shape != sizes.shape or score.dim() != 2:
        raise ValueError(f"score and sizes must be [H, C] alike, got {tuple(score.shape)}, {tuple(sizes.shape)}")
    return ((score[:, None, :] >= score[:, :, None]) * sizes[:, None, :].to(torch.float32)).sum(-1)


def take_best_held(score: torch.Tensor, held: torch.Tensor, budget: float) -> torch.Tensor:
    """take_best from score [H, C] and its held_keys [H, C]: keep [H, C] bool."""
    reach = torch.where(held >= budget, score, torch.full_like(score, float("-inf"))).amax(-1)
    tau = torch.maximum(reach, score.amin(-1))
    return score >= tau[:, None]
