"""What a run compiled and allocated while it was timed: the Triton kernels compiled in this process (each with its
time on time.perf_counter's clock), torch.compile's graphs and the CUDA caching allocator's device calls, so that a
slow step of a benchmark can be told apart: a kernel compiled, memory freed and retried, or neither.

    with RunEvents(device) as events:
        ...                                      # the timed work
    events.summary()                             # counts over the run
    events.compiled_between(t0, t1)              # the Triton kernels compiled in [t0, t1)
"""

from __future__ import annotations

import time

import torch

ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free")  # torch.cuda.memory_stats' keys


def _dynamo_graphs() -> int:
    """torch.compile's graphs compiled so far in this process (0 where dynamo keeps no count)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - a torch without dynamo
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


class RunEvents:
    """A context that records, while it is open: each Triton kernel compiled (knobs.runtime.jit_post_compile_hook,
    restored on exit; a Triton without the hook records none) as (perf_counter time, kernel name); torch.compile's
    graphs compiled; on a CUDA device, the allocator's retries, device allocations and frees."""

    def __init__(self, device: torch.device):
        self.device = device
        self.compiled: list[tuple[float, str]] = []
        self._saved = None
        self._runtime = None
        self._start: dict[str, int] = {}
        self._end: dict[str, int] = {}

    def _hook(self, *, fn, **_) -> None:
        self.compiled.append((time.perf_counter(), fn.name))
        if self._saved is not None:
            self._saved(fn=fn, **_)

    def _counts(self) -> dict[str, int]:
        counts = {"dynamo_graphs": _dynamo_graphs()}
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            counts.update({k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS})
        return counts

    def __enter__(self) -> RunEvents:
        try:
            from triton import knobs
            self._runtime = knobs.runtime
        except ImportError:  # a Triton without knobs: no kernel compilations recorded
            self._runtime = None
        if self._runtime is not None:
            self._saved = self._runtime.jit_post_compile_hook
            self._runtime.jit_post_compile_hook = self._hook
        self._start = self._counts()
        return self

    def __exit__(self, *exc) -> None:
        self._end = self._counts()
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._saved
            self._runtime = self._saved = None

    def summary(self) -> dict:
        """Over the run: Triton kernels compiled, and the growth of each count (dynamo graphs, allocator calls)."""
        return {"triton_compiles": len(self.compiled),
                **{k: self._end.get(k, v) - v for k, v in self._start.items()}}

    def compiled_between(self, start: float, end: float) -> list[str]:
        """The Triton kernels compiled in [start, end) on time.perf_counter's clock, in order."""
        return [name for t, name in self.compiled if start <= t < end]
