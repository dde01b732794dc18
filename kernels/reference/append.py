"""Reference of the new tokens' K/V appended to a layer's buffers at a device-side count (kernels/jit/append.py)."""

from __future__ import annotations

import torch


def append_tokens(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  count: torch.Tensor) -> None:
    """k, v: [Hkv, n, D] a call's new keys and values; k_buf, v_buf: [Hkv, capacity, D]; count: [1] int64 on the
    buffers' device, the slots written so far. Writes token i at slot count + i (in the buffers' dtype), then
    count += n; no host synchronisation. The caller keeps count + n within the capacity."""
    n = k.shape[1]
    slots = torch.arange(n, device=k_buf.device) + count  # [n]
    k_buf.index_copy_(1, slots, k.to(k_buf.dtype))
    v_buf.index_copy_(1, slots, v.to(v_buf.dtype))
    count.add_(n)


def append_tokens_batch(k: torch.Tensor, v: torch.Tensor, k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor],
                        counts: list[torch.Tensor], keep: list | None = None) -> None:
    """A batched decode step's appends: k, v [B, Hkv, n, D], row b written into k_bufs[b] / v_bufs[b] ([Hkv,
    capacity, D] each) at counts[b] ([1] int64), as append_tokens does for each. keep: where a launch that reads
    tables leaves their host copies (kernels/tables.py; unused here)."""
    for b in range(k.shape[0]):
        append_tokens(k[b], v[b], k_bufs[b], v_bufs[b], counts[b])
