"""Typed wrappers of the matrix-vector kernel (kernels/jit/gemv.py): a projection of one token, one launch, no
split over K (cuBLAS splits the 8B shape's o and down projections over K and adds a reduce launch).

`gemv` and `gated_gemv` have the signatures and semantics of kernels.reference.gemv's; a call they
were not made for (several tokens, weights without a unit stride in K, mixed dtypes) goes to the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.jit.gemv import gemv_kernel
from kernels.launch import dependent_launch
from kernels.reference import gemv as reference

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GemvConfig:
    """Rows per program, columns per pass, warps and pipeline stages of one launch."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1


def default_config(n: int, k: int, device: torch.device) -> GemvConfig:
    """Tiles from `python -m engine.bench.gemv --sweep` (the 8B shape's products, 32 layers in a CUDA graph, NVIDIA
    H200, 36 configurations each): eight rows a program on 8 warps for up to 6K rows (o and down: 1024 columns a
    pass, 1.28x and 1.05x their byte bound; q/k/v: 512, 1.21x), sixteen on 4 warps over 3 stages for the wide
    gate/up product (1.00x). cuBLAS there: 1.70x, 1.18x, 1.29x and 1.09x."""
    if device.type != "cuda":
        return GemvConfig(block_n=8, block_k=64, num_warps=1)
    if n >= 16384:
        return GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3)
    return GemvConfig(block_n=8, block_k=1024 if n <= 4096 else 512, num_warps=8, num_stages=1)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: GemvConfig | None = None) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    _check_bias(bias, weight.shape[0])
    if not _fits(x, weight, bias):
        return reference.gemv(x, weight, bias)
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x.contiguous(), weight, bias, None, y, config, gated=False)
    return y


def gated_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, *, config: GemvConfig | None = None) -> torch.Tensor:
    n, k = weight.shape
    if gate_up.dim() != 2 or weight.dim() != 2 or gate_up.shape[1] != 2 * k:
        raise ValueError(f"gate_up must be [M, 2K] = [M, {2 * k}] for weight [N, K] = [{n}, {k}]; got "
                         f"{tuple(gate_up.shape)}, {tuple(weight.shape)}")
    _check_bias(bias, n)
    if residual is not None and tuple(residual.shape) != (gate_up.shape[0], n):
        raise ValueError(f"residual must be [{gate_up.shape[0]}, {n}], got {tuple(residual.shape)}")
    if not _fits(gate_up, weight, bias, residual):
        return reference.gated_gemv(gate_up, weight, bias, residual)
    y = torch.empty(1, n, dtype=gate_up.dtype, device=gate_up.device)
    _launch(gate_up.contiguous(), weight, bias, residual.contiguous() if residual is not None else None, y, config,
            gated=True)
    return y


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def _fits(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether the kernel takes the call: one token, a weight of unit stride in K, one float dtype throughout."""
    return (x.shape[0] == 1 and weight.stride(1) == 1 and x.dtype in DTYPES and weight.dtype == x.dtype
            and all(t is None or t.dtype == x.dtype for t in others))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
            y: torch.Tensor, config: GemvConfig | None, gated: bool) -> None:
    """One launch of gemv_kernel (a missing bias or residual is passed as y, never read)."""
    n, k = weight.shape
    cfg = config or default_config(n, k, x.device)
    gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else y, residual if residual is not None else y, y, n, k,
        weight.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0, HAS_BIAS=bias is not None, GATED=gated,
        RESIDUAL=residual is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **dependent_launch(x.device),
    )


__all__ = ["gemv", "gated_gemv", "GemvConfig", "default_config"]
