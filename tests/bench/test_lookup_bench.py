"""engine.bench.lookup: the index it builds for each layer is a consistent clustering whose cut keeps the budget
(CPU, through the interpreter); the timing itself needs CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.bench.lookup import TAIL, asked_keys, layer_index, main
from kernels import centroid_ops


def test_a_layers_index_holds_every_key_once_and_its_cut_keeps_the_budget():
    hkv, n, d = 2, 4096, 128
    ix = layer_index(hkv, n, d, torch.Generator().manual_seed(0), torch.device("cpu"))
    c = ix["counts"].shape[1]
    assert c == round(n * 0.05) and ix["centroids"].shape == (hkv, c, d) and ix["centroids"].dtype == torch.uint8
    assert ix["counts"].sum(dim=1).tolist() == [n - TAIL] * hkv
    assert torch.equal(ix["starts"][:, 1:] - ix["starts"][:, :-1], ix["counts"].long())
    assert ix["counts"][:, : c // 2].sum() > ix["counts"][:, c // 2 :].sum()  # skewed: low labels hold more keys
    q = (torch.randn(8, 1, d, generator=torch.Generator().manual_seed(1)) * 2).half()
    keys = asked_keys(0.1, hkv, n, torch.device("cpu"))
    keep, _, _ = centroid_ops.cluster_select(q, ix["centroids"], ix["counts"], d ** -0.5, 0.05, hkv, ix["starts"],
                                             n - TAIL, TAIL, step=ix["step"], keys=keys)
    held = float((ix["counts"] * keep).sum()) / (hkv * n)
    assert held == pytest.approx(0.1, abs=0.01)  # within a few clusters of 64 keys at most


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_refuses_without_a_gpu(capsys):
    assert main([]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_the_tiles_to_time_are_read_as_three_integers_each():
    from engine.bench.lookup import parse_tiles

    assert parse_tiles("") == []
    assert parse_tiles("128/2/64,64/3/256") == [(128, 2, 64), (64, 3, 256)]
    with pytest.raises(ValueError, match="C/S/SC"):
        parse_tiles("128/2")
