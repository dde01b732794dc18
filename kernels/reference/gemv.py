"""Reference of one token's matrix-vector product (kernels/jit/gemv.py): a projection at batch 1."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K] (one token), weight: [N, K], bias: [N] or None -> x @ weight.T + bias: [1, N] in x's dtype,
    accumulated in float32."""
    return F.linear(x, weight, bias)
