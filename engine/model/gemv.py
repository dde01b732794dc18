"""One token's projections by the kernels' matrix-vector product (kernels/gemv_ops.py) on a GPU.

At batch 1 a decode step's products are bound by reading their weights. cuBLAS reads the 8B shape's q/k/v and o
weights at 1.3-1.7x their byte bound (splitting o and down over K, with a reduce launch each); the GEMV kernel
streams each weight once in one launch (`python -m engine.bench.gemv --sweep`, 32 layers in a CUDA graph, NVIDIA
H200: q/k/v, o, gate/up and down 3.80 ms with cuBLAS, 3.47 ms with the kernel; engine/bench/README.md).

`use_token_products` swaps, inside each decoder layer, every `nn.Linear` for a `TokenLinear` holding the same
weight (nothing is copied) and points every fused set (engine.model.fused.SharedProduct) at the same
`TokenProduct`: a call over one token goes to the kernel, any other to `F.linear`. The model's own forward is
unchanged. The kernel's call is opaque to torch.compile (engine.model.compiled): a compiled layer's decode step
calls it between inductor's kernels, and the whole step is still captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from engine.model.fused import SharedProduct
from kernels.backend import Backend

Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@torch.compiler.disable  # a Triton launch with host-side checks: called as it is from compiled layers
def _one_token(gemv: Gemv, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gemv(x.reshape(1, -1), weight, bias).reshape(*x.shape[:-1], weight.shape[0])


class TokenProduct:
    """(x [..., K], weight [N, K], bias [N] or None) -> [..., N]: `gemv` ([1, K] -> [1, N], a backend's
    kernels.reference.gemv.gemv) where x holds one token, F.linear otherwise."""

    def __init__(self, gemv: Gemv):
        self.gemv = gemv

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() != x.shape[-1]:
            return F.linear(x, weight, bias)
        return _one_token(self.gemv, x, weight, bias)


class TokenLinear(nn.Module):
    """An nn.Linear (its weight and bias, not copies) whose calls go through a TokenProduct."""

    def __init__(self, linear: nn.Linear, product: TokenProduct):
        super().__init__()
        self.weight = linear.weight
        if linear.bias is not None:
            self.bias = linear.bias
        else:
            self.register_parameter("bias", None)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_token_products(model: nn.Module, backend: Backend) -> int:
    """Route the one-token products of model's decoder layers to `backend`'s GEMV (idempotent; call it after
    engine.model.fused.fuse_projections). Returns how many projections and fused sets it routed now."""
    product = TokenProduct(backend.kernel("gemv").gemv)
    routed = 0
    for layer in model.get_decoder().layers:
        for holder in list(layer.modules()):
            for name, child in list(holder.named_children()):
                if type(child) is nn.Linear:
                    setattr(holder, name, TokenLinear(child, product))
                    routed += 1
                elif isinstance(child, SharedProduct) and not isinstance(child.product, TokenProduct):
                    child.product = product
                    routed += 1
    return routed


def token_products(model: nn.Module) -> int:
    """How many projections and fused sets of model's decoder layers go through a TokenProduct."""
    return sum(isinstance(m, TokenLinear) or (isinstance(m, SharedProduct) and isinstance(m.product, TokenProduct))
               for layer in model.get_decoder().layers for m in layer.modules())
