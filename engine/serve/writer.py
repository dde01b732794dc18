"""Artifacts to disk while the ingest is still making the rest: one background writer per context.

The ingest hands each tensor over as soon as it is final (engine.context.ingest.ingest_tokens' on_artifact: a global
layer's K/V just before its clustering, its index after, the calibrations at the end); the writer copies it to the
CPU on the caller's thread (so the GPU tensor may change or go as soon as `put` returns) and saves it through the
store on its own thread, so disk writes overlap the clustering instead of following it. Host memory is bounded:
`put` waits while more than `max_pending_bytes` are queued. The first save that fails stops the writer; the next
`put` or `close` raises it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

GiB = 1 << 30
MAX_PENDING_BYTES = 2 * GiB  # CPU copies queued for the disk at most (one larger tensor may exceed it alone)
Progress = Callable[[int, int], None]  # (written, handed over)


class ArtifactSink(Protocol):
    """Where artifacts go: the store's artifacts repository (`store.artifacts`)."""

    def save(self, context_id: str, name: str, tensor: torch.Tensor) -> object: ...


class ArtifactWriter:
    """Saves (name, tensor) pairs of one context in order on a background thread. Use as a context manager (it
    closes, or aborts when the block raised), or call `close()` (wait for every save, raise the first error; again:
    raises that error again) or `abort()` (drop what is queued)."""

    def __init__(self, store: ArtifactSink, context_id: str, max_pending_bytes: int = MAX_PENDING_BYTES):
        self.store, self.context_id, self.max_pending_bytes = store, context_id, max_pending_bytes
        self._queue: deque[tuple[str, torch.Tensor]] = deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closing = False
        self.handed, self.written = 0, 0
        self._thread = threading.Thread(target=self._run, name=f"artifact-writer-{context_id}", daemon=True)
        self._thread.start()

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Queue `tensor` for saving as `name` (copied to the CPU now); waits while the queue is full."""
        cpu = tensor.detach().to("cpu")
        cpu = cpu.clone() if cpu.data_ptr() == tensor.data_ptr() else cpu  # a CPU tensor may change after put
        size = cpu.numel() * cpu.element_size()
        with self._cond:
            if self._closing:
                raise RuntimeError("the artifact writer is closed")
            self._cond.wait_for(lambda: self._error is not None or self._pending_bytes == 0
                                or self._pending_bytes + size <= self.max_pending_bytes)
            self._raise_error()
            self._queue.append((name, cpu))
            self._pending_bytes += size
            self.handed += 1
            self._cond.notify_all()

    def close(self, progress: Progress | None = None) -> None:
        """Wait until everything handed over is saved (reporting (written, handed over) as saves finish), then
        stop the thread. Raises the first save's error."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        while True:
            with self._cond:
                if not self._queue or self._error is not None:
                    break
                written, handed = self.written, self.handed
            if progress is not None:  # outside the lock: the callback may take its time (a database write)
                progress(written, handed)
            with self._cond:
                self._cond.wait_for(lambda: self.written != written or not self._queue or self._error is not None)
        self._thread.join()
        if progress is not None and self._error is None:
            progress(self.written, self.handed)
        self._raise_error()

    def abort(self) -> None:
        """Drop what is queued and stop the thread (after a failed ingest: the context is not saved)."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._pending_bytes = 0
            self._cond.notify_all()
        self._thread.join()

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"saving an artifact of context {self.context_id} failed: {self._error}") \
                from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return  # closing and drained (or aborted)
                name, tensor = self._queue[0]
            try:
                self.store.save(self.context_id, name, tensor)
            except BaseException as exc:  # noqa: BLE001 - handed to the ingest's thread by put/close
                with self._cond:
                    self._error = exc
                    self._queue.clear()
                    self._pending_bytes = 0
                    self._cond.notify_all()
                return
            with self._cond:
                if self._queue and self._queue[0][1] is tensor:  # not dropped by abort meanwhile
                    self._queue.popleft()
                    self._pending_bytes -= tensor.numel() * tensor.element_size()
                    self.written += 1
                self._cond.notify_all()
