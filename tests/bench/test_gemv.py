"""engine.bench.gemv: the weights it times are the fused rows and their separate views (CPU, the tiny shape); the
timing itself needs CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.bench.e2e.models import SHAPES
from engine.bench.gemv import layer_weights, main


def test_separate_projections_are_rows_of_the_fused_ones():
    shape = SHAPES["tiny"]
    layers = layer_weights(shape, torch.device("cpu"), torch.float32)
    assert len(layers) == shape["num_hidden_layers"]
    w = layers[0]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    assert w["qkv"].shape == (shape["num_attention_heads"] * shape["head_dim"] + 2 * kv, hidden)
    assert w["gate_up"].shape == (2 * inter, hidden) and w["down"].shape == (hidden, inter)
    x = torch.randn(1, hidden)
    torch.testing.assert_close(torch.cat([x @ w[n].T for n in ("q", "k", "v")], dim=1), x @ w["qkv"].T)
    torch.testing.assert_close(torch.cat([x @ w[n].T for n in ("gate", "up")], dim=1), x @ w["gate_up"].T)
    assert not torch.equal(layers[0]["qkv"], layers[1]["qkv"])  # a copy per layer: nothing served from a cache


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_refuses_without_a_gpu(capsys):
    assert main([]) == 2
    assert "CUDA" in capsys.readouterr().err
