"""Reference of one token's matrix-vector products (kernels/jit/gemv.py): a projection at batch 1, and a gated
MLP's down product with the elementwise work around it, rounded as transformers' eager modules round (LlamaMLP and
the decoder layer's residual add)."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K] (one token), weight: [N, K], bias: [N] or None -> x @ weight.T + bias: [1, N] in x's dtype,
    accumulated in float32."""
    return F.linear(x, weight, bias)


def gated_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """A gated MLP's down product for one token: gate_up [1, 2K] holds the gate's K values, then the up's; weight
    [N, K]; bias [N] or None; residual [1, N] or None. Returns (silu(gate) * up) @ weight.T + bias (+ residual):
    [1, N] in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.linear(F.silu(gate) * up, weight, bias)
    return y if residual is None else residual + y
