"""engine.model.capture: a capture that neither synchronises the device nor empties its caches, and graphs that
share one memory pool one after another (a batch's captures), the next captured while the last one's pinned tables
may still be in use (SharedPool)."""

import pytest
import torch

from engine.model import capture
from engine.model.capture import SharedPool, capturing
from kernels.tables import table

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _captured(x: torch.Tensor, out: torch.Tensor, factor: float, stream: torch.cuda.Stream, pool=None):
    """A graph of out = x * factor + 1, its temporary allocated during the capture."""
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with capturing(graph, stream, pool):
        out.copy_(x * factor + 1)
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def test_a_capture_keeps_the_cached_blocks_and_replays_what_it_recorded(monkeypatch):
    """Without SYNC_FIRST and with the device's free memory above MIN_FREE_BYTES the cache keeps a block freed before
    the capture (torch.cuda.graph would return it to the device); the replay computes what was recorded, from the
    inputs as they are at the replay; below the threshold the cache is emptied first."""
    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    out = torch.zeros_like(x)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    freed = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    del freed  # a cached, unused block
    reserved = torch.cuda.memory_reserved()
    monkeypatch.setattr(capture, "SYNC_FIRST", False)
    monkeypatch.setattr(capture, "MIN_FREE_BYTES", 0)
    graph = _captured(x, out, 2.0, stream)
    assert torch.cuda.memory_reserved() >= reserved
    assert torch.count_nonzero(out) == 0  # recorded, not run
    x.fill_(3.0)
    graph.replay()
    torch.testing.assert_close(out, torch.full_like(x, 7.0), rtol=0, atol=0)
    monkeypatch.setattr(capture, "MIN_FREE_BYTES", torch.cuda.get_device_properties(0).total_memory)
    freed = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    del freed
    cached = torch.cuda.memory_reserved()
    _captured(x, out, 3.0, stream)
    assert torch.cuda.memory_reserved() < cached


def test_graphs_of_one_pool_one_after_another_replay_their_own_steps():
    """A second graph captured into the pool of a first that is dropped (as a batch's captures are) replays its own
    computation; the first, replayed before the second's capture, gave its own."""
    pool = torch.cuda.MemPool()
    stream = torch.cuda.Stream()
    x = torch.randn(1 << 16, device="cuda")
    a, b = torch.zeros_like(x), torch.zeros_like(x)
    first = _captured(x, a, 2.0, stream, pool.id)
    first.replay()
    second = _captured(x, b, -1.0, stream, pool.id)
    torch.cuda.synchronize()
    del first
    second.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(a, x * 2 + 1)
    torch.testing.assert_close(b, -x + 1)


def _busy(products: int = 40) -> None:
    """Queue some milliseconds of matrix products on the current stream."""
    m = torch.randn(4096, 4096, device="cuda")
    for _ in range(products):
        m = m @ m
        m = m / m.norm()


def test_a_shared_pool_captures_again_while_a_dropped_graph_s_tables_are_in_flight(monkeypatch):
    """A graph uploads a pinned table made under its capture (kernels.tables.table, kept as a batch graph keeps its
    shared launches' tables), is replayed behind a long GPU job and dropped with its table before the job ends; a
    capture into the same SharedPool right after, without synchronising (SYNC_FIRST off), records and replays its
    own step (into a bare torch.cuda.MemPool, torch 2.11's capture_begin asserted on the pinned pool's count)."""
    monkeypatch.setattr(capture, "SYNC_FIRST", False)
    monkeypatch.setattr(capture, "MIN_FREE_BYTES", 0)
    pool = SharedPool(torch.device("cuda"))
    stream = torch.cuda.Stream()
    x = torch.randn(1 << 16, device="cuda")
    a, b = torch.zeros_like(x), torch.zeros_like(x)
    for round_ in range(3):
        keep: list = []
        first = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with capturing(first, stream, pool.id):
            factor = table([[2 + round_]], x.device, keep).float()  # [1, 1]
            a.copy_(x * factor[0, 0] + 1)
        torch.cuda.current_stream().wait_stream(stream)
        _busy()
        first.replay()
        del first
        keep.clear()  # the table's pinned block freed while its copy waits behind the job
        second = _captured(x, b, -1.0 - round_, stream, pool.id)
        second.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(a, x * (2 + round_) + 1)
        torch.testing.assert_close(b, -x * (1 + round_) + 1)
        del second
