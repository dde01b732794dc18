"""engine.model.gemv: one token's projections through the GEMV kernel (Triton; the interpreter on the CPU) give the
model's own logits, for one token and for several (which keep F.linear), with the fused sets and the plain
projections routed and nothing copied; the checkpoint's layout is unchanged (tiny models, CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from engine.model.fused import unfused_state_dict
from engine.model.gemv import TokenLinear, token_products, use_token_products
from engine.model.load import load_model
from kernels.backend import TRITON

# fp32 products of the same weights, summed in another order by the kernel: ~1e-6 relative
TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tiny_model_path", ["llama_gqa"], indirect=True)
def test_one_token_products_keep_the_logits(tiny_model_path):
    lm = load_model(str(tiny_model_path), device="cpu")
    ref = load_model(str(tiny_model_path), device="cpu")
    for m in (lm, ref):
        m.model.set_attn_implementation("sdpa")
    params = sum(p.numel() for p in lm.model.parameters())
    routed = use_token_products(lm.model, TRITON)
    # per layer: the fused q/k/v and gate/up sets, and o and down
    assert routed == token_products(lm.model) == 4 * lm.num_layers
    assert use_token_products(lm.model, TRITON) == 0  # idempotent
    assert sum(p.numel() for p in lm.model.parameters()) == params  # the same weights, not copies
    assert any(isinstance(m, TokenLinear) for m in lm.model.modules())
    assert set(unfused_state_dict(lm.model)) == set(unfused_state_dict(ref.model))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length in (1, 7):  # one token: the kernel; several: F.linear
            ids = torch.randint(0, 250, (1, length), generator=g)
            torch.testing.assert_close(lm.model(ids).logits, ref.model(ids).logits, **TOL)
