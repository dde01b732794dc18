"""Reference of k-means' assignment step (kernels/jit/assign.py)."""

from __future__ import annotations

import torch

ASSIGN_CHUNK_ELEMENTS = 1 << 26  # nearest_centroid: point x centroid scores computed at once (all heads)


def nearest_centroid(points: torch.Tensor, centroids: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-means assignment. points [H, N, D], centroids [H, K, D], bias [H, K] or None -> (labels [H, N] int64,
    best [H, N] float32): per point the centroid of the largest score, the inner product plus the centroid's bias
    (float32; -|c|^2 / 2 makes it the nearest centroid in Euclidean distance), and that score; the products are
    computed in the points' dtype (centroids cast to it; 16-bit runs on tensor cores), a chunk of points at a time."""
    h, n, _ = points.shape
    k = centroids.shape[1]
    step = max(1, ASSIGN_CHUNK_ELEMENTS // max(1, h * k))
    ct = centroids.to(points.dtype).transpose(1, 2)  # [H, D, K]
    labels, best = [], []
    for start in range(0, n, step):
        sims = torch.matmul(points[:, start : start + step], ct)  # [H, n, K]
        if bias is not None:
            sims = sims.float() + bias.float()[:, None, :]
        b, lab = sims.max(dim=-1)
        labels.append(lab)
        best.append(b.float())
    if not labels:
        return torch.empty(h, 0, dtype=torch.int64, device=points.device), torch.empty(h, 0, device=points.device)
    return torch.cat(labels, dim=1), torch.cat(best, dim=1)
