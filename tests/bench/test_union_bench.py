"""engine.bench.union: the selection it times is a budget of each KV head's keys in sorted runs (CPU); the timing
itself needs CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.bench.union import clustered_selection, main


def test_the_selection_keeps_the_budget_in_sorted_runs():
    sel = clustered_selection(4, 1024, 0.25, 16, torch.Generator().manual_seed(0), torch.device("cpu"))
    counts = sel.counts()
    assert counts.tolist() == [256] * 4
    for r in range(4):
        keys = sel.indices[sel.indptr[r] : sel.indptr[r + 1]].to(torch.int64)
        assert torch.all(keys[1:] > keys[:-1]) and 0 <= int(keys.min()) and int(keys.max()) < 1024
        assert torch.all(keys.reshape(-1, 16).diff(dim=1) == 1)  # runs of 16 consecutive keys


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_refuses_without_a_gpu(capsys):
    assert main([]) == 2
    assert "CUDA" in capsys.readouterr().err
