"""Spherical (cosine) k-means in PyTorch, vectorised over heads, seeded and deterministic on CPU and GPU.

Determinism: the only reduction is `segment_sum`, which sorts by cluster and sums each cluster's run in float64
with `torch.segment_reduce` (one sequential sum per segment and column on either device, no atomics). The
assignment's similarities are computed in the points' dtype: float32 on the CPU, bfloat16/float16 tensor cores on
a GPU (the labels are then those of the rounded vectors; the centroids are always float32 means). On a GPU the
assignment is a Triton kernel (kernels.assign_ops) that keeps a running best per point instead of writing the
points x centroids similarities (no atomics either).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.dispatch import backend_for

# k-means++ draws its centres one after another: k passes over every point. Past this many clusters (a context
# of ~10K tokens at 5%) the seeding would cost more than the iterations (seconds for a 128K-token layer on a GPU),
# so the centres start as k distinct points drawn uniformly (as faiss does), from the same seeded generator.
KMEANS_PP_MAX_CLUSTERS = 512


@dataclass
class KMeansResult:
    """labels [H, N] int64; centroids [H, K, D] float32 (mean of the unnormalised members); counts [H, K] int64."""

    labels: torch.Tensor
    centroids: torch.Tensor
    counts: torch.Tensor
    iterations: int


def segment_sum(values: torch.Tensor, segments: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Deterministic per-segment sums. values [N, D]; segments [N] int64 in [0, num_segments) -> [num_segments, D].

    Sorted by segment, then each segment's run is summed in float64 (torch.segment_reduce: a plain loop per segment
    and column, no atomics; a prefix sum down dim 0 would run one thread per column on a GPU, seconds at 1M rows).
    """
    order = torch.argsort(segments, stable=True)
    lengths = torch.bincount(segments, minlength=num_segments)
    sums = torch.segment_reduce(values[order].double(), "sum", lengths=lengths, axis=0, unsafe=True)
    return sums.to(values.dtype)


def _head_segments(labels: torch.Tensor, k: int) -> torch.Tensor:
    """labels [H, N] -> flat segment ids [H * N] = head * K + label."""
    h = labels.shape[0]
    return (labels + torch.arange(h, device=labels.device)[:, None] * k).reshape(-1)


def _reseed_empty(cn: torch.Tensor, counts: torch.Tensor, xn: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """Move each empty cluster onto one of the points that fit their centroid worst (vectorised over heads)."""
    h, k, _ = cn.shape
    empty = counts == 0  # [H, K]
    if not bool(empty.any()):
        return cn
    worst = torch.argsort(best, dim=1)[:, :k]  # [H, K] the K worst-fitting points per head
    rank = torch.cumsum(empty.long(), dim=1) - 1  # [H, K] which worst point each empty cluster takes
    pick = torch.gather(worst, 1, rank.clamp(min=0, max=worst.shape[1] - 1))  # [H, K]
    replacement = torch.gather(xn, 1, pick[..., None].expand(-1, -1, xn.shape[2]))  # [H, K, D]
    return torch.where(empty[..., None], replacement, cn)


def _kmeans_plus_plus(xn: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding on unit vectors, vectorised over heads: each new centre is drawn with probability
    proportional to its cosine distance (1 - best similarity) to the centres so far. Deterministic for a seed:
    the uniform draws come from a CPU generator and are turned into picks by a prefix-sum search.

    xn: [H, N, D] unit vectors -> [H, k, D] initial centres.
    """
    h, n, d = xn.shape
    draws = torch.rand(h, k, generator=gen, dtype=torch.float64).to(xn.device)  # [H, k]
    first = (draws[:, 0] * n).long().clamp(max=n - 1)
    centres = [xn[torch.arange(h, device=xn.device), first]]  # [H, D] each
    best = torch.full((h, n), -1.0, device=xn.device)
    for i in range(1, k):
        best = torch.maximum(best, torch.einsum("hnd,hd->hn", xn, centres[-1]))
        weight = (1.0 - best).clamp(min=0).double()  # [H, N]
        cum = torch.cumsum(weight, dim=1)
        total = cum[:, -1:]
        target = draws[:, i : i + 1] * torch.where(total > 0, total, torch.ones_like(total))
        pick = torch.searchsorted(cum, target).clamp(max=n - 1).squeeze(1)  # [H]
        # Where every point already coincides with a centre (total == 0), take the next points in order.
        pick = torch.where(total.squeeze(1) > 0, pick, torch.full_like(pick, i % n))
        centres.append(xn[torch.arange(h, device=xn.device), pick])
    return torch.stack(centres, dim=1)


def _random_centres(xn: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct points per head, uniformly at random (seeded on the CPU). xn: [H, N, D] -> [H, k, D]."""
    h, n, _ = xn.shape
    picks = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(h)]).to(xn.device)  # [H, k]
    return torch.gather(xn, 1, picks[..., None].expand(-1, -1, xn.shape[2]))


def spherical_kmeans(
    x: torch.Tensor,
    k: int,
    iters: int = 20,
    seed: int = 0,
    weights: torch.Tensor | None = None,
    assign: Callable | None = None,
) -> KMeansResult:
    """Cluster each head's points by cosine similarity.

    x: [H, N, D] points (any float dtype); k: clusters per head (1 <= k <= N)
    weights: optional [H, N] non-negative point weights (used when clustering centroids by their counts)
    assign: the assignment step, `kernels.reference.nearest_centroid`'s signature (None: the kernel backend of x's
        device: a Triton kernel on CUDA that never writes the points x centroids similarities)
    Clusters are assigned on L2-normalised points; returned centroids are the (weighted) means of the
    unnormalised members, as Squeezed Attention uses them for the lookup.
    """
    h, n, d = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"k-means needs 1 <= k <= N, got k={k}, N={n}")
    xf = x.float()
    sim_dtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) and x.is_cuda else torch.float32
    xn = torch.nn.functional.normalize(xf, dim=-1)
    xs = xn.to(sim_dtype)  # what the assignment reads
    assign = assign or backend_for(x.device).kernel("assign").nearest_centroid
    w = torch.ones(h, n, device=x.device) if weights is None else weights.float()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cn = _kmeans_plus_plus(xn, k, gen) if k <= KMEANS_PP_MAX_CLUSTERS else _random_centres(xn, k, gen)
    labels = torch.full((h, n), -1, dtype=torch.int64, device=x.device)
    done = 0
    for done in range(1, iters + 1):
        new_labels, best = assign(xs, cn)
        if torch.equal(new_labels, labels):
            break
        labels = new_labels
        seg = _head_segments(labels, k)
        sums = segment_sum((xn * w[..., None]).reshape(h * n, d), seg, h * k).reshape(h, k, d)
        counts = segment_sum(w.reshape(h * n, 1), seg, h * k).reshape(h, k)
        cn = torch.nn.functional.normalize(sums, dim=-1)
        cn = _reseed_empty(cn, counts, xn, best)
    labels, _ = assign(xs, cn)
    seg = _head_segments(labels, k)
    sums = segment_sum((xf * w[..., None]).reshape(h * n, d), seg, h * k).reshape(h, k, d)
    wsum = segment_sum(w.reshape(h * n, 1), seg, h * k).reshape(h, k)
    counts = torch.bincount(seg, minlength=h * k).reshape(h, k)
    centroids = sums / wsum.clamp(min=1e-12)[..., None]
    return KMeansResult(labels=labels, centroids=centroids, counts=counts, iterations=done)
