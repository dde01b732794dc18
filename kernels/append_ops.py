"""Typed wrapper of the append kernel (kernels/jit/append.py): a decode step's new K/V written and its count
advanced in one launch, where the reference's index copies and add are three (per layer of every replayed step).

`append_tokens` and `append_tokens_batch` have the signatures and semantics of `kernels.reference.append`'s. One
program does a sequence's all, so a call of more than MAX_ROWS (head, token) rows a sequence (a long question's
prefill, an ingest's chunk: not bound by launches) goes to the reference. `append_tokens_batch` writes every
sequence of a batched decode step in one launch, its buffers' addresses read from a table (kernels/tables.py)."""

from __future__ import annotations

import torch

from kernels.jit.append import append_tokens_kernel
from kernels.launch import dependent_launch
from kernels.reference import append as reference
from kernels.tables import Keep, batch_tables

MAX_ROWS = 1024  # (head, token) rows one program copies; more go to the reference
BLOCK_ROWS = 16
APPEND_POINTERS = ("k_buf", "v_buf", "count")  # a BATCHED launch's table row, in the kernel's order
APPEND_PARAMS = ("stride_kbh", "stride_kbn", "stride_vbh", "stride_vbn")
APPEND_TILES = ("k_buf", "v_buf")  # the entries taken as 16-byte aligned under ALIGNED (kernels/tables.py)


def _check(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, count: torch.Tensor) -> bool:
    """Whether one sequence's append (k, v [Hkv, n, D]) fits the kernel; raises where the arguments disagree."""
    hkv, n, d = k.shape
    if v.shape != k.shape or k_buf.shape[0] != hkv or v_buf.shape != k_buf.shape or k_buf.shape[2] != d:
        raise ValueError(f"k, v [Hkv, n, D] and buffers [Hkv, capacity, D] disagree: {tuple(k.shape)} "
                         f"{tuple(v.shape)} {tuple(k_buf.shape)} {tuple(v_buf.shape)}")
    if count.numel() != 1 or count.dtype != torch.int64:
        raise ValueError("count must be a [1] int64 tensor")
    return hkv * n <= MAX_ROWS and not d & (d - 1) and all(t.stride(-1) == 1 for t in (k, v, k_buf, v_buf))


def append_tokens(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  count: torch.Tensor) -> None:
    hkv, n, d = k.shape
    if not _check(k, v, k_buf, v_buf, count):
        reference.append_tokens(k, v, k_buf, v_buf, count)
        return
    rows = hkv * n
    if rows:
        append_tokens_kernel[(1,)](
            k, v, k_buf, v_buf, count, n, rows, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
            HEAD_DIM=d, BLOCK_R=BLOCK_ROWS, num_warps=4, **dependent_launch(k.device),
        )


def append_tokens_batch(k: torch.Tensor, v: torch.Tensor, k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor],
                        counts: list[torch.Tensor], keep: Keep = None) -> None:
    batch, hkv, n, d = k.shape
    if v.shape != k.shape or not len(k_bufs) == len(v_bufs) == len(counts) == batch:
        raise ValueError(f"k, v [B, Hkv, n, D] {tuple(k.shape)} {tuple(v.shape)} and {len(k_bufs)}, {len(v_bufs)}, "
                         f"{len(counts)} buffers and counts disagree")
    if batch == 1:  # a lone launch: no tables to upload
        append_tokens(k[0], v[0], k_bufs[0], v_bufs[0], counts[0])
        return
    fits = [_check(k[b], v[b], k_bufs[b], v_bufs[b], counts[b]) for b in range(batch)]
    if not all(fits) or len({(t.dtype, t.device) for t in (*k_bufs, *v_bufs)}) != 1:
        reference.append_tokens_batch(k, v, k_bufs, v_bufs, counts, keep)
        return
    if not hkv * n:
        return
    strides = lambda c: [c[0].stride(0), c[0].stride(1), c[1].stride(0), c[1].stride(1)]  # noqa: E731
    tables = batch_tables(list(zip(k_bufs, v_bufs, counts)), lambda c: c, strides, (APPEND_POINTERS, APPEND_PARAMS),
                          k.device, keep, hinted=strides, tiles=APPEND_TILES)
    append_tokens_kernel[(batch,)](
        k, v, k_bufs[0], v_bufs[0], counts[0], n, hkv * n, k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        k_bufs[0].stride(0), k_bufs[0].stride(1), v_bufs[0].stride(0), v_bufs[0].stride(1), k.stride(0), v.stride(0),
        **tables, HEAD_DIM=d, BLOCK_R=BLOCK_ROWS, num_warps=4, **dependent_launch(k.device),
    )


__all__ = ["append_tokens", "append_tokens_batch"]
