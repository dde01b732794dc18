"""engine.attention.later: a backend whose centroid lookups are planned and launched later, together, gives each
lookup what the backend's own cluster_select gives; every other op is the backend's. On the Triton backend the
kernels run in the interpreter without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.later import LaterLookups
from kernels.backend import REFERENCE, TRITON, Backend
from kernels.layout import group_starts
from kernels.selection import KeyCount

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HKV, D = 4, 2, 16


def _lookup(seed: int, c: int, keys: int, total: int = 120, tail: int = 3):
    """cluster_select's arguments over a context of its own: c centroids a head partitioning `total` keys, a cut
    at `keys` keys (positional and keyword, as the methods pass them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(HQ, 1, D, generator=g).to(DEVICE)
    centroids = torch.randn(HKV, c, D, generator=g).to(DEVICE)
    labels = torch.randint(0, c, (HKV, total), generator=g)
    starts = group_starts(labels, c)
    counts = (starts[:, 1:] - starts[:, :-1]).to(DEVICE)
    args = (q, centroids, counts, D ** -0.5, 0.5, HKV, starts.to(DEVICE), total, tail)
    return args, dict(keys=KeyCount.of(float(keys)))


@pytest.mark.parametrize("backend", [REFERENCE, TRITON], ids=["torch", "triton"])
def test_lookups_planned_together_give_each_its_own_lookup(backend: Backend):
    """Three lookups over contexts of their own planned into one LaterLookups, then run: each keep, score and
    selection equal to the backend's cluster_select of the same arguments (on the Triton backend the three share one
    launch of each lookup kernel)."""
    lookups = [_lookup(0, 37, 40), _lookup(1, 23, 25), _lookup(2, 51, 70, total=200)]
    later = LaterLookups(backend.name)
    planned = [later.kernel("centroid").cluster_select(*args, **kwargs) for args, kwargs in lookups]
    assert len(later.pending) == (len(lookups) if backend is TRITON else 0)  # the reference computes at once
    later.run()
    assert later.pending == []
    for (args, kwargs), (keep, score, selection) in zip(lookups, planned):
        want_keep, want_score, want = backend.kernel("centroid").cluster_select(*args, **kwargs)
        assert torch.equal(keep, want_keep) and torch.equal(score, want_score)
        n = int(want.indptr[-1])
        assert torch.equal(selection.indptr, want.indptr) and selection.num_keys == want.num_keys
        assert torch.equal(selection.indices[:n], want.indices[:n])
    # the contexts' lookups differ (nothing was mixed up)
    assert len({int(p[2].indptr[-1]) for p in planned}) > 1


def test_every_other_op_is_the_backends_own():
    later = LaterLookups(TRITON.name)
    assert later.kernel("union") is TRITON.kernel("union")
    assert later.kernel("centroid").cluster_keep is TRITON.kernel("centroid").cluster_keep
