"""Typed wrapper of the position-masked dense attention kernel (kernels/jit/causal.py): check, pick blocks, launch.

`causal_attention(q, k, v, scale, q_pos, k_start, window)` has the signature and semantics of
`kernels.reference.causal.causal_attention` and never synchronises with the host: the query positions are read on the
device (a CUDA graph replays the call with new positions in the same q_pos buffer), and every grid and block size
depends only on shapes. k_start and window are host ints fixed at launch (a graph bakes them in).
"""

from __future__ import annotations

import numbers

import torch
import triton

from kernels.checks import LOG2E, check_qkv
from kernels.jit.causal import causal_attn_fwd_kernel
from kernels.launch import dependent_launch

POSITION_DTYPES = (torch.int32, torch.int64)

# --- Knobs ---------------------------------------------------------------------------------------------------------
# H100, bf16, 32/8 heads, D 128 (median of do_bench, every tile config on the same inputs):
#   decode, 1001 of 4096 slots visible: BLOCK_N 128 18 us, 64 22 us; 4096 visible: 55 us and 67 us
#   prefill 1024 new tokens (1088 slots): 64 x 64 tiles on 4 warps 48 us, 128 x 64 on 8 warps 53, 64 x 32 52, 3 stages
#   (4 stages 56); 1024 queries over 4096 context keys: 64 x 64 192 us, 128 x 64 on 8 warps 186; 4096 new tokens:
#   417 and 421. The 64-row tile is best or within 3%, so it is the only prefill tile.
# Head dim 256 (Gemma 3), 1024 new tokens: 64 x 32 tiles, 3 stages 37 us (2 stages 57; 64 x 64 41); decode BLOCK_N 64.
DECODE_MAX_M = 16  # G * Lq up to this: one 16-row query tile per KV head (tl.dot needs >= 16 rows)
DECODE_BLOCK_N = 128
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
LARGE_HEAD_DIM = 256  # from this head dim: the key blocks below (shared memory: K and V buffers of every stage)
LARGE_DECODE_BLOCK_N = 64
LARGE_PREFILL_BLOCK_N = 32
# The key blocks above are sized for 2-byte inputs; fp32 inputs take blocks of the same bytes (half the keys), or
# the stages' K/V buffers would outgrow an SM's shared memory (BLOCK_N 128, D 128, fp32: 256 KB).
BLOCK_N_ELEMENT_BYTES = 2


def _blocks(num_m: int, head_dim: int, elem_bytes: int) -> tuple[int, int]:
    """(block_m, block_n) for M = G * Lq query rows per KV head and inputs of elem_bytes bytes."""
    large = head_dim >= LARGE_HEAD_DIM
    if num_m <= DECODE_MAX_M:
        block_m, block_n = 16, LARGE_DECODE_BLOCK_N if large else DECODE_BLOCK_N
    else:
        block_m, block_n = PREFILL_BLOCK_M, LARGE_PREFILL_BLOCK_N if large else PREFILL_BLOCK_N
    return block_m, max(16, block_n * BLOCK_N_ELEMENT_BYTES // elem_bytes)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_start: int,
           window: int | None) -> None:
    check_qkv(q, k, v)
    if not isinstance(q_pos, torch.Tensor) or q_pos.dtype not in POSITION_DTYPES:
        kind = q_pos.dtype if isinstance(q_pos, torch.Tensor) else type(q_pos).__name__
        raise TypeError(f"q_pos must be an int32/int64 tensor on the device (never host values); got {kind}")
    if q_pos.dim() != 1 or q_pos.shape[0] != q.shape[1]:
        raise ValueError(f"q_pos must be [Lq] = [{q.shape[1]}]; got {tuple(q_pos.shape)}")
    devices = {t.device for t in (q, k, v, q_pos)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v and q_pos must share one device; got {sorted(map(str, devices))}")
    if isinstance(k_start, bool) or not isinstance(k_start, numbers.Integral):
        raise TypeError(f"k_start must be a Python int (the position of key 0); got {type(k_start).__name__}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral)):
        raise TypeError(f"window must be None or a Python int; got {type(window).__name__}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor,
    k_start: int,
    window: int | None = None,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention over keys at consecutive positions, causal and optionally within a sliding window; see
    kernels.reference.causal.causal_attention. The merge with `prior` and the write into `out` happen in the same
    launch (an engine layer's fixed part and its new tokens: no merge kernel).

    q: [Hq, Lq, D]; k, v: [Hkv, Lk, D] (fp16, bf16 or fp32, any strides; q is cast to k's dtype when it differs);
    q_pos: [Lq] int32/int64 on q's device, any stride; key j sits at position k_start + j. Keys past the newest
    query's position are never read, so a static buffer's unwritten tail may hold anything.
    Returns out [Hq, Lq, D] float32 and lse [Hq, Lq] float32 (natural log; 0 and -inf for a query that sees no key).
    """
    _check(q, k, v, q_pos, k_start, window)
    q = q.to(k.dtype)  # no-op when they match
    hq, lq, d = q.shape
    hkv, lk = k.shape[:2]
    group = hq // hkv
    num_m = group * lq  # query rows per KV head
    if prior is not None and (prior[0].shape != (hq, lq, d) or prior[1].shape != (hq, lq)
                              or prior[0].dtype != torch.float32 or prior[1].dtype != torch.float32):
        raise ValueError(f"prior must be float32 out [{hq}, {lq}, {d}] and lse [{hq}, {lq}]")
    if out is not None and (out.shape != (hq, lq, d) or out.stride(-1) != 1):
        raise ValueError(f"out must be [{hq}, {lq}, {d}] with a unit stride in D; got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    if lk == 0 or d & (d - 1):  # (the kernel's tiles need a power-of-two head dim)
        from kernels.reference import causal as reference  # noqa: PLC0415
        return reference.causal_attention(q, k, v, scale, q_pos, k_start, window, prior, out)
    if out is None:
        out = torch.empty(hq, lq, d, device=q.device, dtype=torch.float32)
    lse = torch.empty(hq, lq, device=q.device, dtype=torch.float32)  # flat: [Hkv, M]
    if out.numel() == 0:
        return out, lse
    prior_out, prior_lse = prior if prior is not None else (out, lse)  # dummies unless HAS_PRIOR
    if prior is not None:
        prior_out = prior_out if prior_out.stride(-1) == 1 else prior_out.contiguous()
        prior_lse = prior_lse.contiguous()
    block_m, block_n = _blocks(num_m, d, k.element_size())
    causal_attn_fwd_kernel[(triton.cdiv(num_m, block_m), hkv)](
        q, k, v, q_pos, out, lse, prior_out, prior_lse,
        *q.stride(), *k.stride(), *v.stride(), q_pos.stride(0),
        out.stride(0), out.stride(1), prior_out.stride(0), prior_out.stride(1),
        group, lq, lk, int(k_start), 0 if window is None else int(window), scale * LOG2E,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, WINDOW=window is not None,
        EXACT_FP32=q.dtype == torch.float32, HAS_PRIOR=prior is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        **dependent_launch(q.device),
    )
    return out, lse


__all__ = ["causal_attention"]
