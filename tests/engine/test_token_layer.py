"""engine.model.token_layer: a Llama-style layer's one-token step ending in the gated down product gives the model's
own logits and tokens (a prefix, then one token at a time over the cache), with the same parameters and checkpoint
layout; a layer of another kind (Gemma 3's) is left as it is. On the CPU the kernel runs in the Triton interpreter
(fp32) and, through the reference backend, the step is the model's own arithmetic exactly; on a GPU, bf16 and the
kernel."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model.fused import fuse_projections, unfused_state_dict
from engine.model.gemv import use_token_products
from engine.model.load import load_model
from engine.model.token_layer import TokenStepLayer, token_layers, use_token_layers
from kernels.backend import REFERENCE, TRITON

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 (CPU): the kernel sums the products in another order, ~1e-6 relative; bf16 (GPU): the logits of a tiny
# model whose products and norms round to 8 bits differently in one order or the other
TOL = dict(atol=1e-4, rtol=1e-4) if DEVICE == "cpu" else dict(atol=5e-2, rtol=5e-2)


def _logits(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """The logits of a 5-token prefix, then of each later token fed one at a time over the cache."""
    with torch.no_grad():
        out = model(ids[:, :5], use_cache=True)
        logits, cache = [out.logits[:, -1]], out.past_key_values
        for t in range(5, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            cache = out.past_key_values
    return logits


def _models(path, backend):
    """Two copies of the model with SDPA attention, their projections fused and one token's routed to `backend`'s
    GEMV (as the load does on a GPU), no layer swapped."""
    models = []
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16 if DEVICE == "cuda" else
                                                     torch.float32, attn_implementation="sdpa").to(DEVICE).eval()
        fuse_projections(model)
        use_token_products(model, backend)
        models.append(model)
    return models


@pytest.mark.parametrize("tiny_model_path", ["llama_gqa", "qwen2_mha"], indirect=True)
def test_one_token_steps_keep_the_models_logits(tiny_model_path):
    model, ref = _models(tiny_model_path, TRITON)
    params, keys = sum(p.numel() for p in model.parameters()), set(unfused_state_dict(model))
    layers = len(model.get_decoder().layers)
    assert use_token_layers(model, TRITON) == token_layers(model) == layers
    assert use_token_layers(model, TRITON) == 0  # idempotent
    assert sum(p.numel() for p in model.parameters()) == params  # the same weights, not copies
    assert set(unfused_state_dict(model)) == keys
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    got, want = _logits(model, ids), _logits(ref, ids)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    assert [int(g.argmax()) for g in got] == [int(w.argmax()) for w in want]


@pytest.mark.skipif(DEVICE != "cpu", reason="the reference backend's arithmetic is the model's own on the CPU")
@pytest.mark.parametrize("tiny_model_path", ["llama_gqa"], indirect=True)
def test_the_reference_step_is_the_models_arithmetic(tiny_model_path):
    model, ref = _models(tiny_model_path, REFERENCE)
    assert use_token_layers(model, REFERENCE) == len(model.get_decoder().layers)
    ids = torch.randint(0, 250, (1, 8), generator=torch.Generator().manual_seed(1))
    for g, w in zip(_logits(model, ids), _logits(ref, ids)):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("tiny_model_path", ["gemma3_hybrid"], indirect=True)
def test_other_layers_are_left_as_they_are(tiny_model_path):
    model, _ = _models(tiny_model_path, TRITON)
    assert use_token_layers(model, TRITON) == 0
    assert not any(isinstance(layer, TokenStepLayer) for layer in model.get_decoder().layers)


@pytest.mark.parametrize("tiny_model_path", ["llama_gqa"], indirect=True)
def test_the_load_swaps_the_layers_where_it_routes_the_products(tiny_model_path):
    lm = load_model(str(tiny_model_path), device=DEVICE)
    if DEVICE == "cpu":  # the load routes one token's products to the GEMV kernel on a GPU only
        assert token_layers(lm.model) == 0 and use_token_layers(lm.model, TRITON) == 0
    else:
        assert token_layers(lm.model) == lm.num_layers
