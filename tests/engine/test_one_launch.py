"""engine.attention.one_launch: a backend whose one-token centroid lookups are given a layer's counters runs each in
one launch of both passes and gives what the backend's own cluster_select gives; every other op is the backend's.
On the Triton backend the kernels run in the interpreter without CUDA (tests/conftest.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention.cache import FixedContextLayer
from engine.attention.one_launch import SyncedLookups
from kernels.backend import REFERENCE, TRITON, Backend
from tests.engine.test_later_lookups import DEVICE, _lookup


@pytest.mark.parametrize("backend,mode", [(REFERENCE, "passes"), (TRITON, "passes"), (TRITON, "expand")],
                         ids=["torch", "triton", "triton-whole-lookup"])
def test_lookups_given_counters_give_each_its_own_lookup(monkeypatch, backend: Backend, mode: str):
    """Three lookups over contexts of their own, one after another on one layer's counters: each keep, score and
    selection the backend's cluster_select's without them, bit for bit, and the counters left zeroed (mode: what
    the one launch runs, kernels.centroid_ops.ONE_LAUNCH)."""
    from kernels import centroid_ops

    monkeypatch.setattr(centroid_ops, "ONE_LAUNCH", mode)
    sync = backend.kernel("centroid").lookup_sync(torch.device(DEVICE))
    synced = SyncedLookups.over(backend, sync)
    for args, kwargs in (_lookup(0, 37, 40), _lookup(1, 23, 25), _lookup(2, 51, 70, total=200)):
        keep, score, selection = synced.kernel("centroid").cluster_select(*args, **kwargs)
        want_keep, want_score, want = backend.kernel("centroid").cluster_select(*args, **kwargs)
        assert torch.equal(keep, want_keep) and torch.equal(score, want_score)
        n = int(want.indptr[-1])
        assert torch.equal(selection.indptr, want.indptr) and selection.num_keys == want.num_keys
        assert torch.equal(selection.indices[:n], want.indices[:n])
        assert not sync.any()


@dataclasses.dataclass(frozen=True)
class _Own(Backend):
    """A backend of its own (as a test's checking backend is): its union family is a marker."""

    def kernel(self, family: str):
        return "own union" if family == "union" else super().kernel(family)


def test_every_other_op_is_the_wrapped_backends_own():
    sync = TRITON.kernel("centroid").lookup_sync(torch.device(DEVICE))
    synced = SyncedLookups.over(TRITON, sync)
    assert synced.kernel("union") is TRITON.kernel("union")
    assert synced.kernel("centroid").cluster_keep is TRITON.kernel("centroid").cluster_keep
    assert SyncedLookups.over(_Own("triton"), sync).kernel("union") == "own union"
    assert SyncedLookups.over(TRITON, None).kernel("centroid") is TRITON.kernel("centroid")  # no counters


def test_a_global_layer_holds_counters_made_before_any_capture():
    """A global layer's counters are made, zeroed, with its new-token buffers (a reserve, never during a capture);
    a sliding layer (no lookup) has none."""
    like = torch.zeros(2, 5, 8, device=DEVICE)
    global_layer, sliding = FixedContextLayer(like, like, 5), FixedContextLayer(like, like, 5, sliding_window=4)
    for layer in (global_layer, sliding):
        layer.reserve(like, 3)
    assert sliding.lookup_sync is None
    sync = global_layer.lookup_sync
    assert sync is not None and sync.dtype == torch.int32 and not sync.any()
    global_layer.reserve(like, 300)  # more slots: new buffers, the same counters
    assert global_layer.lookup_sync is sync
