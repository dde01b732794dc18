"""engine.model.fused: sibling projections fused into one product give the unfused model's logits, one matrix
product per set under torch.compile, and the checkpoint's layout back on request (tiny models of every
architecture, CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model.fused import FUSED_SETS, fuse_projections, fused_sets, unfused_state_dict
from engine.model.load import load_model

# fp32, the same rows of the same weights: a fused product may sum in another order (blocking), ~1e-7 relative
TOL = dict(atol=1e-5, rtol=1e-5)


def plain(path) -> torch.nn.Module:
    """The checkpoint as transformers loads it: separate projections, SDPA."""
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()


def test_load_fuses_every_set_and_keeps_the_logits(tiny_model_path):
    lm = load_model(str(tiny_model_path), device="cpu")
    layers = lm.num_layers
    assert fused_sets(lm.model) == len(FUSED_SETS) * layers
    assert fuse_projections(lm.model) == 0  # idempotent
    ref = plain(tiny_model_path)
    assert sum(p.numel() for p in lm.model.parameters()) == sum(p.numel() for p in ref.parameters())  # no copy
    lm.model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, ref(ids).logits, **TOL)
        attn = lm.model.get_decoder().layers[0].self_attn
        x = torch.randn(1, 5, lm.config.hidden_size)
        # called alone or out of order, a part computes its own rows
        torch.testing.assert_close(attn.v_proj(x), ref.get_decoder().layers[0].self_attn.v_proj(x), **TOL)
        torch.testing.assert_close(attn.k_proj(x), ref.get_decoder().layers[0].self_attn.k_proj(x), **TOL)


def test_unfused_state_dict_is_the_checkpoints(tiny_model_path):
    lm = load_model(str(tiny_model_path), device="cpu")
    ref = plain(tiny_model_path).state_dict()
    ours = unfused_state_dict(lm.model)
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        torch.testing.assert_close(ours[name], tensor, atol=0, rtol=0)


@pytest.mark.parametrize("tiny_model_path", ["llama_gqa"], indirect=True)
def test_a_compiled_layer_runs_one_product_per_set(tiny_model_path, one_thread):
    """Dynamo traces the parts of a set into one matrix product: a Llama layer's seven projections become four."""
    lm = load_model(str(tiny_model_path), device="cpu")
    lm.model.set_attn_implementation("sdpa")
    products = []

    def backend(gm, example_inputs):
        products.extend(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear)
        return gm.forward

    torch._dynamo.reset()
    layer = lm.model.get_decoder().layers[0]
    layer.compile(backend=backend)
    with torch.no_grad():
        lm.model(torch.randint(0, 250, (1, 12)))
    assert len(products) == 4


@pytest.mark.parametrize("tiny_model_path", ["llama_gqa"], indirect=True)
def test_threads_running_the_model_at_once_get_their_own_products(tiny_model_path):
    """An ingest in the background and an answer may run the model at the same time: each thread's parts take
    their rows of that thread's product, whatever the other does between its calls."""
    import threading

    lm = load_model(str(tiny_model_path), device="cpu")
    attn = lm.model.get_decoder().layers[0].self_attn
    ref = plain(tiny_model_path).get_decoder().layers[0].self_attn
    xa, xb = torch.randn(1, 7, lm.config.hidden_size), torch.randn(1, 3, lm.config.hidden_size)
    got = {}
    with torch.no_grad():
        qa = attn.q_proj(xa)  # thread A has begun its set
        worker = threading.Thread(target=lambda: got.update(b=[attn.q_proj(xb), attn.k_proj(xb), attn.v_proj(xb)]))
        worker.start()
        worker.join()
        ka, va = attn.k_proj(xa), attn.v_proj(xa)  # ... and finishes it after B's whole set
        for ours, proj, x in [(qa, ref.q_proj, xa), (ka, ref.k_proj, xa), (va, ref.v_proj, xa),
                              *zip(got["b"], (ref.q_proj, ref.k_proj, ref.v_proj), [xb] * 3)]:
            torch.testing.assert_close(ours, proj(x), **TOL)
    assert not attn.q_proj.shared._per_thread  # every set taken: nothing kept
