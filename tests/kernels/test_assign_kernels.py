"""kernels.assign_ops.nearest_centroid (Triton) against kernels.reference.nearest_centroid, and engine.index.kmeans with
either as its assignment step.

Points and centroids are random; a label may differ from the reference's only where two centroids' inner products
are within the arithmetic's rounding of each other (a near-tie), so labels are compared where the reference's best
beats its second best by more than a margin, and the best product everywhere. Without CUDA the kernel runs in the
Triton interpreter (tests/conftest.py), in fp32 and fp16 (bf16 tl.dot is wrong there).
"""

from __future__ import annotations

import pytest
import torch

from engine.index.kmeans import metric_kmeans, query_metric, query_moment, spherical_kmeans
from kernels import assign_ops
from kernels.reference import assign as reference

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: the same dot products in another order (~1e-6 relative on products of order 1). 16-bit inputs, fp32
# accumulation on both sides, but torch's 16-bit matmul rounds its output to 16 bits before the max: half an ulp of
# the product (2^-11 fp16, 2^-8 bf16 relative) on products of unit vectors (|x.c| <= 1).
BEST_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
# Labels are compared where the reference's winner beats the runner-up by more than what the reference's rounding
# of each product to the points' dtype (half an ulp, on products <= 1) could swap.
MARGIN = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def unit(h: int, n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(h, n, d, generator=g), dim=-1).to(DEVICE)


def check(points: torch.Tensor, centroids: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    labels, best = assign_ops.nearest_centroid(points, centroids, bias)
    want_labels, want_best = reference.nearest_centroid(points, centroids, bias)
    assert labels.dtype == torch.int64 and best.dtype == torch.float32
    assert labels.shape == best.shape == points.shape[:2]
    torch.testing.assert_close(best, want_best, **BEST_TOL[points.dtype])
    # labels agree wherever the reference's winner is clear of the runner-up by more than the rounding
    rounded = centroids.to(points.dtype).float()  # what both sides multiply
    sims = torch.matmul(points.float(), rounded.transpose(1, 2))  # [H, N, K] float32
    if bias is not None:
        sims = sims + bias.float()[:, None, :]
    top2 = sims.topk(min(2, sims.shape[-1]), dim=-1).values
    clear = (top2[..., 0] - top2[..., -1] > MARGIN[points.dtype]) | (sims.shape[-1] == 1)
    assert clear.float().mean() > 0.3  # the comparison is not vacuous
    assert torch.equal(labels[clear], want_labels[clear])
    # every label is a true argmax up to rounding: its product is within tolerance of the best
    got = torch.gather(sims, 2, labels[..., None])[..., 0]
    torch.testing.assert_close(got, top2[..., 0], **BEST_TOL[points.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,n,k,d", [(1, 1, 1, 16), (2, 200, 7, 32), (3, 130, 150, 64), (2, 70, 65, 128),
                                     (1, 65, 33, 256)])
def test_matches_reference(h, n, k, d, dtype):
    """Shapes across the tile edges: one point, one centroid, N and K not multiples of the blocks, head dims 16-256."""
    check(unit(h, n, d, 0).to(dtype), unit(h, k, d, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,n,k,d", [(1, 1, 1, 16), (2, 200, 7, 32), (3, 130, 150, 64), (1, 65, 33, 256)])
def test_matches_reference_with_a_bias(h, n, k, d, dtype):
    """The Euclidean assignment (metric_kmeans'): scores x . c - |c|^2 / 2 with centroids of norms 0.2-1 (so that
    the bias, not only the product, decides), against the reference; and its labels are the nearest centroids."""
    g = torch.Generator().manual_seed(3)
    centroids = unit(h, k, d, 1) * (0.2 + 0.8 * torch.rand(h, k, 1, generator=g)).to(DEVICE)
    bias = -0.5 * centroids.square().sum(dim=-1)
    points = unit(h, n, d, 0).to(dtype)
    check(points, centroids, bias)
    if dtype == torch.float32:
        labels, _ = assign_ops.nearest_centroid(points, centroids, bias)
        dist = torch.cdist(points, centroids)  # [H, N, K]
        top2 = dist.topk(min(2, k), dim=-1, largest=False).values
        clear = (top2[..., -1] - top2[..., 0] > 1e-4) | (k == 1)
        assert torch.equal(labels[clear], dist.argmin(dim=-1)[clear])


def test_first_centroid_wins_a_tie():
    """Duplicate centroids (in different centroid tiles): the first index, as torch's max documents for the CPU.
    Each point sits on a centroid (product ~1); the 80 zero centroids between the copies score 0. The centroids are
    one-hot, so that a point's product with a centroid and with its copy are equal bit for bit however a backend
    orders the sum (with dense ones, numpy's matmul under TRITON_INTERPRET=1 on triton 3.9 rounded the two tiles
    differently)."""
    base = torch.eye(32, device=DEVICE)[:10].expand(2, -1, -1).contiguous()  # [2, 10, 32]
    points = base.repeat(1, 5, 1) + 0.01 * unit(2, 50, 32, 2)
    centroids = torch.cat([base, torch.zeros(2, 80, 32, device=DEVICE), base], dim=1)  # 100: copies at 90..99
    labels, _ = assign_ops.nearest_centroid(points, centroids)
    assert torch.equal(labels, torch.arange(10, device=DEVICE).repeat(5).expand(2, -1))


def test_odd_head_dim_goes_to_the_reference():
    points, centroids = unit(2, 40, 24, 4), unit(2, 5, 24, 5)
    labels, best = assign_ops.nearest_centroid(points, centroids)
    want_labels, want_best = reference.nearest_centroid(points, centroids)
    assert torch.equal(labels, want_labels) and torch.equal(best, want_best)


def test_bad_input():
    with pytest.raises(ValueError, match="expected points"):
        assign_ops.nearest_centroid(unit(2, 4, 16, 0), unit(3, 4, 16, 0))
    with pytest.raises(ValueError, match="at least one centroid"):
        assign_ops.nearest_centroid(unit(2, 4, 16, 0), unit(2, 0, 16, 0))
    with pytest.raises(TypeError, match="points must be"):
        assign_ops.nearest_centroid(unit(2, 4, 16, 0).double(), unit(2, 4, 16, 0))
    with pytest.raises(ValueError, match="expected bias"):
        assign_ops.nearest_centroid(unit(2, 4, 16, 0), unit(2, 3, 16, 0), torch.zeros(2, 4, device=DEVICE))


def test_kmeans_with_the_kernel_matches_the_reference():
    """spherical_kmeans with the kernel as its assignment step: on well-separated clusters (every point far closer
    to its own centre than to any other) the same partition and centroids as with the reference."""
    h, k, per, d = 2, 12, 20, 64
    g = torch.Generator().manual_seed(6)
    centres = torch.nn.functional.normalize(torch.randn(h, k, d, generator=g), dim=-1)
    x = (centres.repeat_interleave(per, dim=1) + 0.05 * torch.randn(h, k * per, d, generator=g)).to(DEVICE)
    with_kernel = spherical_kmeans(x, k, iters=10, seed=0, assign=assign_ops.nearest_centroid)
    with_reference = spherical_kmeans(x, k, iters=10, seed=0, assign=reference.nearest_centroid)
    assert torch.equal(with_kernel.labels, with_reference.labels)
    assert torch.equal(with_kernel.counts, with_reference.counts)
    torch.testing.assert_close(with_kernel.centroids, with_reference.centroids, atol=1e-6, rtol=1e-6)


def test_metric_kmeans_with_the_kernel_matches_the_reference():
    """metric_kmeans with the kernel as its assignment step (a bias: Euclidean distances): on well-separated
    clusters the same partition and centroids as with the reference."""
    h, k, per, d = 2, 12, 20, 64
    g = torch.Generator().manual_seed(6)
    centres = torch.randn(h, k, d, generator=g)
    x = (centres.repeat_interleave(per, dim=1) + 0.05 * torch.randn(h, k * per, d, generator=g)).to(DEVICE)
    metric = query_metric(query_moment(torch.randn(2 * h, 30, d, generator=g).to(DEVICE), h))
    with_kernel = metric_kmeans(x, k, metric, iters=10, seed=0, assign=assign_ops.nearest_centroid)
    with_reference = metric_kmeans(x, k, metric, iters=10, seed=0, assign=reference.nearest_centroid)
    assert torch.equal(with_kernel.labels, with_reference.labels)
    assert torch.equal(with_kernel.counts, with_reference.counts)
    torch.testing.assert_close(with_kernel.centroids, with_reference.centroids, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_realistic():
    """A layer's worth of keys as the ingest clusters them: 8 heads, 8K bf16 points, 5% centroids, head dim 128."""
    check(unit(8, 8192, 128, 7).bfloat16(), unit(8, 410, 128, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp16_realistic_with_a_bias():
    """metric_kmeans' assignment on a GPU: fp16 points of norm <= 1, a bias, 8K points, 5% centroids, d 128."""
    centroids = unit(8, 410, 128, 8) * 0.5
    check(unit(8, 8192, 128, 7).half(), centroids, -0.5 * centroids.square().sum(dim=-1))
