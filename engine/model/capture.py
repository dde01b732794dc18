"""A CUDA graph's capture on a stream, with or without the work torch.cuda.graph does before every capture: a
device-wide synchronisation and the emptying of the device's memory cache (a cudaFree of every unused block, which
the next eager calls allocate again, each cudaMalloc a wait of its own).

A server captures often: a batch of turns answered together is captured anew each time a turn joins or leaves
(engine.model.batch_graph), and an emptied cache is what the turns' next steps and prefills fill again. Without
SYNC_FIRST the cache is emptied first only where the device has little free memory: a capture's own allocations
(from its memory pool) may not free cached blocks while it runs, so that a capture short of memory would fail. A
stream may hold unfinished work when its capture begins: the capture records only what is queued after. Either way
the pinned host memory's cache is emptied first, as torch.cuda.graph does: torch's capture_begin asserts on its
state otherwise (torch 2.11 on an H100: "use_count > 0 INTERNAL ASSERT FAILED" in CachingHostAllocator.h, in
`squeeze bench serve --no-sync-captures`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# A capture on a device with less free memory than this first empties the caches, as torch.cuda.graph does
MIN_FREE_BYTES = 4 << 30
# Whether every capture synchronises the device and empties its caches first (torch.cuda.graph's way, the default
# until a GPU run of `squeeze bench serve --no-sync-captures` shows the other way's captures cheaper and its answers
# the same: tests/engine/test_capture.py, and test_batch_graph.py's unwarmed batch, captured that way)
SYNC_FIRST = True


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
