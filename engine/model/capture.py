"""A CUDA graph's capture on a stream, with or without the work torch.cuda.graph does before every capture: a
device-wide synchronisation and the emptying of the device's memory cache (a cudaFree of every unused block, which
the next eager calls allocate again, each cudaMalloc a wait of its own).

A server captures often: a batch of turns answered together is captured anew each time a turn joins or leaves
(engine.model.batch_graph), and an emptied cache is what the turns' next steps and prefills fill again. Without
SYNC_FIRST the cache is emptied first only where the device has little free memory: a capture's own allocations
(from its memory pool) may not free cached blocks while it runs, so that a capture short of memory would fail. A
stream may hold unfinished work when its capture begins: the capture records only what is queued after. Either way
the pinned host memory's cache is emptied first, as torch.cuda.graph does.

Graphs that share a memory pool share it on the host too: the pinned tables a capture allocates (kernels/tables.py)
come from the pool's part of the pinned memory allocator, which counts the graphs holding it. Once the last is
dropped, the count is 0 and that part is freed only when its blocks are, after their copies are done: a capture into
the pool before that (no synchronisation first) made torch's capture_begin assert (torch 2.11 on an H100: "use_count
> 0 INTERNAL ASSERT FAILED" in CachingHostAllocator.h, `squeeze bench serve --no-sync-captures`). A SharedPool holds
a graph of its own that keeps the count above 0 for as long as the pool lives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# A capture on a device with less free memory than this first empties the caches, as torch.cuda.graph does
MIN_FREE_BYTES = 4 << 30
# Whether every capture synchronises the device and empties its caches first (torch.cuda.graph's way). Off: on an
# H100, 8 turns over 8 x 32K answered together and leaving one by one (engine/bench/README.md, "Captures without a
# synchronisation"), the batch's step captured anew at 7 turns took 302 ms with squeeze against 464 (full: 128
# against 204), each turn's answer its answer alone in both
SYNC_FIRST = False


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool=None) -> Iterator[None]:
    """Record what the block queues on `stream` into `graph` (not run). pool: the id of a memory pool shared with
    other graphs (torch.cuda.MemPool.id: graphs never replayed at once may share one); None: the graph's own."""
    if SYNC_FIRST or torch.cuda.mem_get_info(stream.device)[0] < MIN_FREE_BYTES:
        torch.cuda.synchronize(stream.device)
        torch.cuda.empty_cache()
    empty_host = getattr(torch._C, "_host_emptyCache", None)  # (a CUDA build's: what torch.cuda.graph calls)
    if empty_host is not None:
        empty_host()
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)))
        try:
            yield
        finally:
            graph.capture_end()


class SharedPool:
    """A memory pool for CUDA graphs that are captured one after another and never replayed at once (a batch's
    steps as its turns change), with an anchor: a one-kernel graph captured into it first and kept, so that the
    pool's share of the pinned host memory is never released between two of its graphs (see the module's
    docstring). id: what `capturing` takes as its pool."""

    def __init__(self, device: torch.device):
        self.pool = torch.cuda.MemPool()
        self._anchor = torch.cuda.CUDAGraph()
        self._flag = torch.zeros(1, device=device)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with capturing(self._anchor, stream, self.pool.id):
            self._flag.add_(1)  # (a graph of no kernel draws a warning; this one is never replayed)
        torch.cuda.current_stream(device).wait_stream(stream)

    @property
    def id(self):
        return self.pool.id
