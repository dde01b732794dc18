"""One token's matrix-vector product (kernels/jit/gemv.py) against its reference (F.linear), and a gated MLP's down
product with its SiLU and residual add against the model's own arithmetic, at every shape class the wrapper takes:
rows and columns that fill the blocks or not, with and without a bias, and the calls it hands to the reference
(several tokens, a weight without a unit stride in K). Without CUDA the kernel runs in the Triton
interpreter (tests/conftest.py): float32 and float16 there; bfloat16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import gemv_ops
from kernels.reference import gemv as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16]
# float32 accumulation over K = 256 products in both: the outputs differ by the rounding to the output dtype and
# the order of the additions
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=6e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias", [(64, 256, False), (40, 256, True), (37, 100, False), (96, 192, True)])
def test_gemv_matches_the_reference(dtype, n, k, bias):
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    got = gemv_ops.gemv(x, w, b)
    want = reference.gemv(x.float(), w.float(), b.float() if b is not None else None)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("config", [gemv_ops.GemvConfig(block_n=16, block_k=64, num_warps=2),
                                    gemv_ops.GemvConfig(block_n=8, block_k=128, num_warps=1, num_stages=2)])
def test_gemv_at_other_tiles(config):
    x = torch.randn(1, 256).to(DEVICE)
    w = torch.randn(48, 256).to(DEVICE)
    torch.testing.assert_close(gemv_ops.gemv(x, w, config=config), reference.gemv(x, w), atol=1e-3, rtol=1e-3)


def test_other_calls_go_to_the_reference():
    x = torch.randn(3, 32).to(DEVICE)
    w = torch.randn(32, 16).to(DEVICE).T  # [16, 32] with stride 1 along N, not K
    torch.testing.assert_close(gemv_ops.gemv(x, w), reference.gemv(x, w))
    torch.testing.assert_close(gemv_ops.gemv(x[:1], w), reference.gemv(x[:1], w))
    with pytest.raises(ValueError, match="weight"):
        gemv_ops.gemv(x, torch.randn(16, 8).to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias,residual", [(64, 256, False, True), (40, 128, True, False), (37, 100, False, True)])
def test_gated_gemv_matches_silu_times_up_then_the_product(dtype, n, k, bias, residual):
    """silu(gate) * up read by the down product (each rounded as the model's eager MLP rounds), plus the residual."""
    g = torch.Generator().manual_seed(n * k + 1)
    gate_up = (2 * torch.randn(1, 2 * k, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    res = torch.randn(1, n, generator=g).to(DEVICE, dtype) if residual else None
    got = gemv_ops.gated_gemv(gate_up, w, b, res)
    want = reference.gated_gemv(gate_up, w, b, res)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_the_gated_product_hands_other_calls_to_the_reference_and_refuses_bad_shapes():
    w = torch.randn(16, 32).to(DEVICE)
    gu = torch.randn(3, 64).to(DEVICE)
    torch.testing.assert_close(gemv_ops.gated_gemv(gu, w), reference.gated_gemv(gu, w))  # several tokens
    with pytest.raises(ValueError, match="gate_up"):
        gemv_ops.gated_gemv(torch.randn(1, 32).to(DEVICE), w)
    with pytest.raises(ValueError, match="residual"):
        gemv_ops.gated_gemv(gu[:1], w, residual=torch.randn(1, 8).to(DEVICE))
