"""engine.serve.writer.ArtifactWriter: every artifact saved through a real store while the caller goes on, in order; host
memory bounded; a failed save raised in the caller's thread; an aborted writer saves nothing more."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.serve.writer import ArtifactWriter
from storage import Store

TEXT = "The harbour wall was rebuilt after the storm."


@pytest.fixture
def store_and_context(tmp_path):
    with Store(tmp_path / "store") as store:
        doc_id, _ = store.documents.add(_document())
        ctx = store.contexts.context_for(doc_id, "model", {"a": 1})
        yield store, ctx["id"]


def _document():
    from storage import load_document_bytes

    return load_document_bytes(TEXT.encode(), "doc.txt")


class SlowSink:
    """An artifacts-repository stand-in that takes `delay` seconds per save and records the queue's bytes at each save."""

    def __init__(self, delay: float = 0.0, fail_at: str | None = None):
        self.delay, self.fail_at = delay, fail_at
        self.saved: list[tuple[str, torch.Tensor]] = []
        self.pending_seen: list[int] = []
        self.writer: ArtifactWriter | None = None
        self.thread: threading.Thread | None = None

    def save(self, context_id: str, name: str, tensor: torch.Tensor) -> None:
        self.thread = threading.current_thread()
        if self.writer is not None:
            self.pending_seen.append(self.writer._pending_bytes)
        time.sleep(self.delay)
        if name == self.fail_at:
            raise OSError("disk full")
        self.saved.append((name, tensor))


def test_saves_every_artifact_through_the_store(store_and_context):
    store, context_id = store_and_context
    tensors = {f"layer{i}.keys": torch.randn(2, 5, 4) for i in range(3)} | {"tokens": torch.arange(7)}
    progress = []
    with ArtifactWriter(store.artifacts, context_id) as writer:
        for name, t in tensors.items():
            writer.put(name, t)
        writer.close(lambda written, handed: progress.append((written, handed)))
    assert progress[-1] == (4, 4) and all(w <= h == 4 for w, h in progress)
    loaded = store.artifacts.load(context_id)
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t)


def test_the_caller_may_change_its_tensor_after_put():
    sink = SlowSink(delay=0.05)
    t = torch.zeros(3)
    with ArtifactWriter(sink, "ctx") as writer:
        writer.put("a", t)
        t += 1  # the writer holds its own copy
    assert torch.equal(sink.saved[0][1], torch.zeros(3))


def test_saves_run_on_another_thread_in_order():
    sink = SlowSink(delay=0.05)
    names = [f"t{i}" for i in range(6)]
    start = time.perf_counter()
    with ArtifactWriter(sink, "ctx") as writer:
        for name in names:
            writer.put(name, torch.ones(4))
        handed_after = time.perf_counter() - start
    assert [n for n, _ in sink.saved] == names
    assert sink.thread is not threading.current_thread()
    assert handed_after < 0.2  # put did not wait for the 300 ms of saves


def test_host_memory_is_bounded():
    """With room for two 4 KB tensors, put waits: the queue never holds more than the bound (but one tensor
    larger than the bound alone still goes through)."""
    sink = SlowSink(delay=0.01)
    size = 1024 * 4  # float32
    with ArtifactWriter(sink, "ctx", max_pending_bytes=2 * size) as writer:
        sink.writer = writer
        for i in range(8):
            writer.put(f"t{i}", torch.ones(1024))
        writer.put("big", torch.ones(4096))
    assert len(sink.saved) == 9
    assert max(sink.pending_seen) <= 4 * size  # the big one alone: 16 KB > the bound, let through an empty queue
    assert max(sink.pending_seen[:8]) <= 2 * size


def test_a_failed_save_is_raised_to_the_caller():
    sink = SlowSink(fail_at="t1")
    writer = ArtifactWriter(sink, "ctx")
    writer.put("t0", torch.ones(2))
    writer.put("t1", torch.ones(2))
    with pytest.raises(RuntimeError, match="disk full"):
        for i in range(2, 100):  # a later put (or close) raises it
            writer.put(f"t{i}", torch.ones(2))
            time.sleep(0.005)
        writer.close()
    with pytest.raises(RuntimeError, match="disk full"):
        writer.close()
    assert [n for n, _ in sink.saved] == ["t0"]


def test_abort_drops_what_is_queued():
    sink = SlowSink(delay=0.05)
    with pytest.raises(KeyError):
        with ArtifactWriter(sink, "ctx") as writer:
            for i in range(5):
                writer.put(f"t{i}", torch.ones(2))
            raise KeyError("the ingest failed")
    assert len(sink.saved) <= 1  # at most the save that was under way
    with pytest.raises(RuntimeError, match="closed"):
        writer.put("late", torch.ones(2))
