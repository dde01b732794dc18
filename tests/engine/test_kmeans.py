"""engine.index.kmeans: segment_sum against index_add_, spherical and metric k-means against hand-computed means and known
partitions, query_metric against its definition."""

from __future__ import annotations

import pytest
import torch

from engine.index.kmeans import QUERY_RIDGE, metric_kmeans, query_metric, query_moment, segment_sum, spherical_kmeans

# Centroids are float64 segment sums cast to float32 and divided by the (exact, integer-valued or float64) weight: a
# couple of float32 roundings of values of magnitude ~1, i.e. ~1e-7 relative. 1e-5 leaves margin and still catches any
# wrong member, weight or head (those move a mean by >= 1e-3 with the data below).
MEAN_ATOL, MEAN_RTOL = 1e-5, 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def separated(heads=3, groups=4, per=30, d=16, noise=0.05, seed=0):
    """Points along `groups` orthonormal directions per head, with random positive lengths and small noise.

    Returns x [heads, groups * per, d] float32 and truth [groups * per] int64 (the same shuffled grouping per head).
    """
    g = _gen(seed)
    dirs = torch.linalg.qr(torch.randn(heads, d, groups, generator=g, dtype=torch.float64))[0].transpose(1, 2)
    truth = torch.arange(groups).repeat_interleave(per)
    truth = truth[torch.randperm(truth.numel(), generator=g)]
    length = 0.5 + 1.5 * torch.rand(heads, truth.numel(), 1, generator=g, dtype=torch.float64)
    x = dirs[:, truth] * length + noise * torch.randn(heads, truth.numel(), d, generator=g, dtype=torch.float64)
    return x.float(), truth


def members_mean(x, labels, k, weights=None):
    """float64 loop: per head and label, the (weighted) mean of the unnormalised members; None for empty labels."""
    h = x.shape[0]
    out = []
    for head in range(h):
        row = []
        for c in range(k):
            sel = labels[head] == c
            if not sel.any():
                row.append(None)
                continue
            w = torch.ones(int(sel.sum())) if weights is None else weights[head, sel]
            row.append((x[head, sel].double() * w.double()[:, None]).sum(0) / w.double().sum())
        out.append(row)
    return out


def assert_centroids_are_member_means(result, x, k, weights=None):
    want = members_mean(x, result.labels, k, weights)
    for head, row in enumerate(want):
        for c, mean in enumerate(row):
            if mean is not None:
                torch.testing.assert_close(result.centroids[head, c].double(), mean, atol=MEAN_ATOL, rtol=MEAN_RTOL)


# ---------------------------------------------------------------- segment_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segment_sum_matches_index_add(dtype):
    g = _gen(1)
    n, d, segments = 500, 5, 23
    values = (torch.randn(n, d, generator=g) * 10).to(dtype)
    seg = torch.randint(0, segments - 3, (n,), generator=g)  # the last 3 segments are empty
    seg[:7] = 0
    got = segment_sum(values, seg, segments)
    want = torch.zeros(segments, d, dtype=torch.float64).index_add_(0, seg, values.double())
    assert got.dtype == dtype and got.shape == (segments, d)
    # float64 prefix sums: the only visible rounding is the final cast to `dtype` (values up to ~500 here).
    atol = 1e-4 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=1e-6)
    assert torch.equal(got[-3:], torch.zeros(3, d, dtype=dtype))


def test_segment_sum_is_independent_of_input_order():
    g = _gen(2)
    values = torch.randn(300, 4, generator=g)
    seg = torch.randint(0, 10, (300,), generator=g)
    perm = torch.randperm(300, generator=g)
    a = segment_sum(values, seg, 10)
    b = segment_sum(values[perm], seg[perm], 10)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # same sums, different float64 summation order


# ---------------------------------------------------------------- spherical_kmeans


def group_to_labels(labels_row, truth, groups):
    return [set(labels_row[truth == t].tolist()) for t in range(groups)]


def test_recovers_well_separated_clusters_when_over_clustered():
    """With 3 centroids per true direction, every cluster lies inside one true group and every group is covered."""
    x, truth = separated(seed=0)
    k = 12
    for seed in range(3):
        result = spherical_kmeans(x, k, seed=seed)
        for head in range(x.shape[0]):
            for c in range(k):
                members = truth[result.labels[head] == c]
                assert members.unique().numel() <= 1, f"seed {seed} head {head}: cluster {c} mixes true groups"
            assert all(len(s) >= 1 for s in group_to_labels(result.labels[head], truth, 4))


def test_recovers_exact_partition_for_every_seed():
    """k == number of true directions: every true group maps to exactly one label, distinct across groups."""
    x, truth = separated(seed=0)
    failures = []
    for seed in range(10):
        result = spherical_kmeans(x, 4, seed=seed)
        for head in range(x.shape[0]):
            labs = group_to_labels(result.labels[head], truth, 4)
            if not (all(len(s) == 1 for s in labs) and len(set.union(*labs)) == 4):
                failures.append((seed, head))
    assert not failures, f"(seed, head) pairs that did not recover the partition: {failures}"


def test_empty_clusters_are_reseeded_on_identical_points():
    """Groups of identical points: two initial centroids on copies of one point tie, one cluster empties, and the
    reseeding moves it onto a worst-fitting point, i.e. the group that has no centroid; so every seed recovers."""
    g = _gen(10)
    dirs = torch.linalg.qr(torch.randn(2, 8, 3, generator=g))[0].transpose(1, 2)  # [2, 3, 8] orthonormal
    truth = torch.arange(3).repeat_interleave(10)
    x = dirs[:, truth] * 2.0
    for seed in range(10):
        result = spherical_kmeans(x, 3, seed=seed)
        for head in range(2):
            labs = group_to_labels(result.labels[head], truth, 3)
            assert all(len(s) == 1 for s in labs) and len(set.union(*labs)) == 3, (seed, head, labs)


def test_more_clusters_than_distinct_points_leaves_empty_clusters_finite():
    g = _gen(11)
    dirs = torch.nn.functional.normalize(torch.randn(2, 3, 8, generator=g), dim=-1)
    x = dirs[:, torch.arange(3).repeat_interleave(10)]  # 3 distinct points per head, 10 copies each
    result = spherical_kmeans(x, 5, seed=0)
    assert torch.equal(result.counts.sum(dim=1), torch.full((2,), 30))
    assert ((result.counts == 0) | (result.counts == 10)).all()
    assert torch.isfinite(result.centroids).all()
    assert_centroids_are_member_means(result, x, 5)


def test_deterministic_for_a_seed():
    x, _ = separated(seed=3, noise=0.3)
    a = spherical_kmeans(x, 7, seed=5)
    b = spherical_kmeans(x, 7, seed=5)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.centroids, b.centroids)  # bit-exact
    assert torch.equal(a.counts, b.counts) and a.iterations == b.iterations


@pytest.mark.parametrize("k", [3, 10])
def test_centroids_are_means_of_unnormalised_members_and_counts_match(k):
    g = _gen(4)
    x = torch.randn(2, 80, 8, generator=g) * torch.rand(2, 80, 1, generator=g) * 3  # varied lengths
    result = spherical_kmeans(x, k, seed=1)
    assert result.labels.shape == (2, 80) and result.labels.dtype == torch.int64
    assert result.centroids.shape == (2, k, 8) and result.centroids.dtype == torch.float32
    assert result.counts.dtype == torch.int64
    assert ((result.labels >= 0) & (result.labels < k)).all()
    for head in range(2):
        assert torch.equal(result.counts[head], torch.bincount(result.labels[head], minlength=k))
    assert_centroids_are_member_means(result, x, k)


def test_k_equals_n_gives_one_point_per_cluster():
    g = _gen(6)
    x = torch.randn(2, 12, 8, generator=g)
    result = spherical_kmeans(x, 12, seed=0)
    assert torch.equal(result.counts, torch.ones(2, 12, dtype=torch.int64))
    for head in range(2):
        assert torch.equal(result.labels[head].sort().values, torch.arange(12))
        # each centroid is its single (unnormalised) point; a float64 sum of one value cast back: exact to ~1 ulp
        torch.testing.assert_close(result.centroids[head, result.labels[head]], x[head], atol=1e-6, rtol=1e-6)


def test_k_equals_one_is_the_mean():
    g = _gen(7)
    x = torch.randn(3, 40, 8, generator=g)
    result = spherical_kmeans(x, 1, seed=0)
    assert torch.equal(result.labels, torch.zeros(3, 40, dtype=torch.int64))
    assert torch.equal(result.counts, torch.full((3, 1), 40))
    torch.testing.assert_close(result.centroids[:, 0].double(), x.double().mean(dim=1), atol=MEAN_ATOL, rtol=MEAN_RTOL)


@pytest.mark.parametrize("k", [0, -1, 21])
def test_invalid_k_raises(k):
    with pytest.raises(ValueError):
        spherical_kmeans(torch.randn(2, 20, 4), k)


def test_weights_give_the_weighted_mean():
    x, truth = separated(seed=8, noise=0.1)
    g = _gen(9)
    weights = torch.randint(0, 20, x.shape[:2], generator=g).float()
    weights[weights == 0] = 0.5  # positive, varied weights
    # k == 1: the centroid is the weighted mean of all the points, and differs from the plain mean.
    one = spherical_kmeans(x, 1, seed=0, weights=weights)
    want = (x.double() * weights.double()[..., None]).sum(1) / weights.double().sum(1, keepdim=True)
    torch.testing.assert_close(one.centroids[:, 0].double(), want, atol=MEAN_ATOL, rtol=MEAN_RTOL)
    assert (one.centroids[:, 0] - x.mean(dim=1)).abs().max() > 1e-2
    assert torch.equal(one.counts, torch.full((3, 1), x.shape[1]))  # counts are members, not weight
    # Several clusters: each centroid is the weighted mean of its members; counts still count members.
    many = spherical_kmeans(x, 8, seed=0, weights=weights)
    assert_centroids_are_member_means(many, x, 8, weights)
    for head in range(3):
        assert torch.equal(many.counts[head], torch.bincount(many.labels[head], minlength=8))


def test_many_clusters_start_from_random_points_deterministically():
    """Past KMEANS_PP_MAX_CLUSTERS the seeding draws distinct points (k-means++ would be k passes over the data):
    still seeded, still a valid clustering."""
    from engine.index.kmeans import KMEANS_PP_MAX_CLUSTERS

    k = KMEANS_PP_MAX_CLUSTERS + 88
    x = torch.randn(2, 3000, 8, generator=torch.Generator().manual_seed(3))
    a = spherical_kmeans(x, k, iters=3, seed=5)
    b = spherical_kmeans(x, k, iters=3, seed=5)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.centroids, b.centroids)
    assert torch.equal(a.counts.sum(dim=1), torch.full((2,), 3000))
    for h in range(2):
        assert torch.equal(a.counts[h], torch.bincount(a.labels[h], minlength=k))
    assert not torch.equal(spherical_kmeans(x, k, iters=3, seed=6).labels, a.labels)


# ---------------------------------------------------------------- query_metric and metric_kmeans


def test_query_metric_factors_the_queries_second_moment():
    """query_moment is the mean outer product of the group's unit queries; W is lower triangular and W W^T = that +
    ridge / D * I, per KV head: |x W|^2 = x (M + ridge / D * I) x^T, the squared logit error a metric k-means
    weighs."""
    g = _gen(11)
    q = torch.randn(6, 40, 8, generator=g) * torch.linspace(0.1, 3, 8)  # anisotropic, 3 query heads per KV head
    w = query_metric(query_moment(q, kv_heads=2))
    assert w.shape == (2, 8, 8) and w.dtype == torch.float32
    assert torch.equal(w, w.tril())
    x = torch.randn(5, 8, generator=g, dtype=torch.float64)
    for head in range(2):
        qn = torch.nn.functional.normalize(q[3 * head : 3 * head + 3].double(), dim=-1).reshape(-1, 8)
        want = qn.T @ qn / qn.shape[0] + QUERY_RIDGE / 8 * torch.eye(8, dtype=torch.float64)
        torch.testing.assert_close((w[head] @ w[head].T).double(), want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close((x @ w[head].double()).square().sum(-1), ((x @ want) * x).sum(-1),
                                   atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of 4"):
        query_moment(q, kv_heads=4)
    with pytest.raises(ValueError, match="positive ridge"):
        query_metric(query_moment(q, kv_heads=2), ridge=0.0)


def test_metric_kmeans_under_the_identity_recovers_separated_clusters():
    """With the identity as metric it is Euclidean k-means: blobs far apart are found exactly for every seed, each
    centroid the mean of its members, the counts its members."""
    g = _gen(12)
    h, k, per, d = 2, 5, 25, 6
    centres = 10 * torch.randn(h, k, d, generator=g)
    x = centres.repeat_interleave(per, dim=1) + 0.1 * torch.randn(h, k * per, d, generator=g)
    truth = torch.arange(k).repeat_interleave(per)
    eye = torch.eye(d).expand(h, d, d)
    for seed in range(4):
        result = metric_kmeans(x, k, eye, seed=seed)
        for head in range(h):
            labs = group_to_labels(result.labels[head], truth, k)
            assert all(len(s) == 1 for s in labs) and len(set.union(*labs)) == k, (seed, head)
            assert torch.equal(result.counts[head], torch.bincount(result.labels[head], minlength=k))
        assert_centroids_are_member_means(result, x, k)


def test_metric_kmeans_clusters_by_the_queries_logit_error():
    """Keys spread widely along a direction no query reads (dim 0) and in two tight groups along the one every query
    reads (dim 1). Cosine k-means splits them along dim 0; under the queries' metric they are split by dim 1, and the
    logit error the centroids make for those queries (the lookup's error) is far smaller."""
    g = _gen(13)
    n, d = 200, 4
    x = torch.zeros(1, n, d)
    x[0, :, 0] = torch.linspace(-10, 10, n)[torch.randperm(n, generator=g)]
    side = (torch.arange(n) % 2).float() * 2 - 1  # the two groups, interleaved along dim 0
    x[0, :, 1] = side + 0.05 * torch.randn(n, generator=g)
    x[0, :, 2:] = 0.05 * torch.randn(n, d - 2, generator=g)
    q = torch.zeros(4, 30, d)
    q[..., 1] = 1.0
    q += 0.01 * torch.randn(4, 30, d, generator=g)

    def logit_error(result):
        c = result.centroids[0][result.labels[0]]  # [n, D] each key's centroid
        return float(((q.reshape(-1, d) @ (x[0] - c).T) ** 2).mean())

    metric = metric_kmeans(x, 2, query_metric(query_moment(q, 1)), seed=0)
    assert torch.equal(metric.labels[0] == metric.labels[0, 1], side > 0)  # the two groups exactly
    cosine = spherical_kmeans(x, 2, seed=0)
    assert logit_error(metric) < 0.05 * logit_error(cosine)


def test_metric_kmeans_weights_and_determinism():
    """k == 1 gives the weighted mean (counts are members); a seed gives the same clusters twice; past
    KMEANS_PP_MAX_CLUSTERS (random seeding) too."""
    from engine.index.kmeans import KMEANS_PP_MAX_CLUSTERS

    x, _ = separated(seed=14, noise=0.1)
    metric = query_metric(query_moment(torch.randn(3, 20, 16, generator=_gen(15)), 3))
    weights = torch.rand(x.shape[:2], generator=_gen(16)) + 0.1
    one = metric_kmeans(x, 1, metric, weights=weights)
    want = (x.double() * weights.double()[..., None]).sum(1) / weights.double().sum(1, keepdim=True)
    torch.testing.assert_close(one.centroids[:, 0].double(), want, atol=MEAN_ATOL, rtol=MEAN_RTOL)
    assert torch.equal(one.counts, torch.full((3, 1), x.shape[1]))
    a, b = metric_kmeans(x, 7, metric, seed=3), metric_kmeans(x, 7, metric, seed=3)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.centroids, b.centroids)
    assert_centroids_are_member_means(a, x, 7)
    big = torch.randn(2, 3000, 8, generator=_gen(17))
    eye = torch.eye(8).expand(2, 8, 8)
    k = KMEANS_PP_MAX_CLUSTERS + 20
    c, e = metric_kmeans(big, k, eye, iters=3, seed=5), metric_kmeans(big, k, eye, iters=3, seed=5)
    assert torch.equal(c.labels, e.labels) and torch.equal(c.counts.sum(dim=1), torch.full((2,), 3000))


def test_metric_kmeans_bad_input():
    x = torch.randn(2, 20, 4)
    with pytest.raises(ValueError, match="1 <= k <= N"):
        metric_kmeans(x, 21, torch.eye(4).expand(2, 4, 4))
    with pytest.raises(ValueError, match="expected a metric"):
        metric_kmeans(x, 3, torch.eye(4))
