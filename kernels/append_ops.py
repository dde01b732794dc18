"""Typed wrapper of the append kernel (kernels/jit/append.py): a decode step's new K/V written and its count
advanced in one launch, where the reference's index copies and add are three (per layer of every replayed step).

`append_tokens` has the signature and semantics of `kernels.reference.append.append_tokens`. One program does it
all, so a call of more than MAX_ROWS (head, token) rows (a long question's prefill, an ingest's chunk: not bound by
launches) goes to the reference."""

from __future__ import annotations

import torch

from kernels.jit.append import append_tokens_kernel
from kernels.launch import dependent_launch
from kernels.reference import append as reference

MAX_ROWS = 1024  # (head, token) rows one program copies; more go to the reference
BLOCK_ROWS = 16


def append_tokens(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  count: torch.Tensor) -> None:
    hkv, n, d = k.shape
    if v.shape != k.shape or k_buf.shape[0] != hkv or v_buf.shape != k_buf.shape or k_buf.shape[2] != d:
        raise ValueError(f"k, v [Hkv, n, D] and buffers [Hkv, capacity, D] disagree: {tuple(k.shape)} "
                         f"{tuple(v.shape)} {tuple(k_buf.shape)} {tuple(v_buf.shape)}")
    if count.numel() != 1 or count.dtype != torch.int64:
        raise ValueError("count must be a [1] int64 tensor")
    rows = hkv * n
    if rows > MAX_ROWS or d & (d - 1) or any(t.stride(-1) != 1 for t in (k, v, k_buf, v_buf)):
        reference.append_tokens(k, v, k_buf, v_buf, count)
        return
    if rows:
        append_tokens_kernel[(1,)](
            k, v, k_buf, v_buf, count, n, rows, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
            HEAD_DIM=d, BLOCK_R=BLOCK_ROWS, num_warps=4, **dependent_launch(k.device),
        )


__all__ = ["append_tokens"]
