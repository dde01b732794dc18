"""k-means in PyTorch, vectorised over heads, seeded and deterministic on CPU and GPU: spherical (cosine) k-means,
and Euclidean k-means under a metric (`metric_kmeans`; `query_metric` makes the metric of a layer's queries, under
which a centroid's squared distance to a key is the squared error of the logit it stands in for).

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
# query_metric: the identity's share of the metric (of the unit queries' trace, 1): directions the queries seen do not
# cover still count a little (0.03-0.3 clustered the embedded model's keys equally well; 0 and 1 worse).
QUERY_RIDGE = 0.1


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
    The runs' lengths come from the sorted ids by binary search (torch.bincount would wait for the GPU to size its
    output: a host synchronisation per call, twenty per layer in a k-means).
    """
    order = torch.argsort(segments, stable=True)
    bounds = torch.arange(num_segments + 1, device=segments.device, dtype=segments.dtype)
    lengths = torch.diff(torch.searchsorted(segments[order], bounds))
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


def _kmeans_plus_plus(xn: torch.Tensor, k: int, gen: torch.Generator, euclidean: bool = False) -> torch.Tensor:
    """k-means++ seeding, vectorised over heads: each new centre is drawn with probability proportional to its
    distance to the centres so far: the cosine distance (1 - best similarity) of unit vectors, or with `euclidean`
    the squared Euclidean distance. Deterministic for a seed: the uniform draws come from a CPU generator and are
    turned into picks by a prefix-sum search.

    xn: [H, N, D] points (unit vectors unless `euclidean`) -> [H, k, D] initial centres.
    """
    h, n, d = xn.shape
    draws = torch.rand(h, k, generator=gen, dtype=torch.float64).to(xn.device)  # [H, k]
    first = (draws[:, 0] * n).long().clamp(max=n - 1)
    centres = [xn[torch.arange(h, device=xn.device), first]]  # [H, D] each
    best = torch.full((h, n), float("inf") if euclidean else -1.0, device=xn.device)
    for i in range(1, k):
        if euclidean:
            best = torch.minimum(best, (xn - centres[-1][:, None, :]).square().sum(dim=-1))
            weight = best.clamp(min=0).double()  # [H, N]
        else:
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
        sums, counts = _weighted_sums(xn, w, labels, k)
        cn = torch.nn.functional.normalize(sums, dim=-1)
        cn = _reseed_empty(cn, counts, xn, best)
    labels, _ = assign(xs, cn)
    return _result(xf, w, labels, k, done)


def _weighted_sums(points: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cluster of labels [H, N]: the weighted sum of the points [H, N, D] ([H, K, D]) and of the weights w [H, N]
    ([H, K]), in one segment sum (the weights a last column beside the weighted points: one sort, not two)."""
    h, n, d = points.shape
    both = torch.cat([points * w[..., None], w[..., None].to(points.dtype)], dim=-1).reshape(h * n, d + 1)
    sums = segment_sum(both, _head_segments(labels, k), h * k).reshape(h, k, d + 1)
    return sums[..., :d], sums[..., d]


def _result(xf: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, k: int, done: int) -> KMeansResult:
    """The clusters of labels [H, N]: centroids the weighted means of the points xf [H, N, D] (weights w [H, N])."""
    h = xf.shape[0]
    sums, wsum = _weighted_sums(xf, w, labels, k)
    counts = torch.bincount(_head_segments(labels, k), minlength=h * k).reshape(h, k)
    centroids = sums / wsum.clamp(min=1e-12)[..., None]
    return KMeansResult(labels=labels, centroids=centroids, counts=counts, iterations=done)


def query_moment(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The second moment of unit queries per KV head: queries [Hq, n, D] -> [Hkv, D, D] float32, the mean of q q^T
    over the n tokens and the group's query heads, q the unit query (trace 1). (An ingest sums it over every
    position of the context: engine.attention.function.QueryCapture.moment.)"""
    hq, n, d = queries.shape
    if hq % kv_heads or n == 0:
        raise ValueError(f"expected queries [Hq, n >= 1, D] with Hq a multiple of {kv_heads}; "
                         f"got {tuple(queries.shape)}")
    qn = torch.nn.functional.normalize(queries.float(), dim=-1).reshape(kv_heads, hq // kv_heads * n, d)
    return qn.transpose(1, 2) @ qn / qn.shape[1]


def query_metric(moment: torch.Tensor, ridge: float = QUERY_RIDGE) -> torch.Tensor:
    """The metric of a layer's logit errors: moment [Hkv, D, D] (query_moment: M, the unit queries' second moment)
    -> [Hkv, D, D] float32 W, lower triangular, with W W^T = M + ridge / D * I (its Cholesky factor). For a key k and
    a centroid c, |(k - c) W|^2 = (k - c)(M + ridge / D * I)(k - c)^T is the mean squared error of the logit q . c
    standing in for q . k over those query directions (plus the ridge's share of |k - c|^2, for directions the queries
    seen do not cover): Euclidean k-means of x W clusters keys by what a lookup gets wrong. Any factor gives the same
    distances (two differ by a rotation); the Cholesky factor is one batched factorisation with no wait for the host,
    where a symmetric square root by eigendecomposition took a hundred launches a matrix (engine/bench/README.md,
    "The ingest against the peer's prefill"). ridge > 0 keeps the matrix positive definite."""
    if ridge <= 0:
        raise ValueError(f"query_metric needs a positive ridge (a positive definite metric), got {ridge}")
    d = moment.shape[-1]
    m = moment.double() + ridge / d * torch.eye(d, dtype=torch.float64, device=moment.device)
    factor, _ = torch.linalg.cholesky_ex(m)  # info not read: positive definite by the ridge, and no host sync
    return factor.float()


def metric_kmeans(
    x: torch.Tensor,
    k: int,
    metric: torch.Tensor,
    iters: int = 20,
    seed: int = 0,
    weights: torch.Tensor | None = None,
    assign: Callable | None = None,
) -> KMeansResult:
    """Euclidean k-means of each head's points under a metric: the points y = x W (W = metric[h]) clustered by
    squared Euclidean distance (k-means++ seeding up to KMEANS_PP_MAX_CLUSTERS clusters), the returned centroids
    the (weighted) means of the members in x's space, as the lookup scores them.

    x: [H, N, D] points (any float dtype); k: clusters per head (1 <= k <= N); metric: [H, D, D] (query_metric)
    weights: optional [H, N] non-negative point weights
    assign: the assignment step, `kernels.reference.nearest_centroid`'s signature with a bias (None: the kernel
        backend of x's device). It scores y . c - |c|^2 / 2 (the nearest centroid has the largest), on points scaled
        so that the longest has norm 1 (a common factor: the same clusters), in float16 on a GPU, float32 on the CPU.
    """
    h, n, d = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"k-means needs 1 <= k <= N, got k={k}, N={n}")
    if tuple(metric.shape) != (h, d, d):
        raise ValueError(f"expected a metric [H, D, D] = {(h, d, d)}; got {tuple(metric.shape)}")
    xf = x.float()
    y = xf @ metric.float().to(x.device)
    y = y / y.norm(dim=-1).amax().clamp(min=torch.finfo(torch.float32).tiny)
    ys = y.half() if x.is_cuda else y  # what the assignment reads
    sq = y.square().sum(dim=-1)  # [H, N]
    assign = assign or backend_for(x.device).kernel("assign").nearest_centroid
    w = torch.ones(h, n, device=x.device) if weights is None else weights.float()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    c = _kmeans_plus_plus(y, k, gen, euclidean=True) if k <= KMEANS_PP_MAX_CLUSTERS else _random_centres(y, k, gen)
    labels = torch.full((h, n), -1, dtype=torch.int64, device=x.device)
    done = 0
    for done in range(1, iters + 1):
        new_labels, best = assign(ys, c, -0.5 * c.square().sum(dim=-1))
        if torch.equal(new_labels, labels):
            break
        labels = new_labels
        sums, counts = _weighted_sums(y, w, labels, k)
        c = sums / counts.clamp(min=1e-12)[..., None]
        c = _reseed_empty(c, counts, y, best - 0.5 * sq)  # best - |y|^2 / 2 = -|y - c|^2 / 2: the worst fits first
    labels, _ = assign(ys, c, -0.5 * c.square().sum(dim=-1))
    return _result(xf, w, labels, k, done)
