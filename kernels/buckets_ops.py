"""Typed wrappers of Saap's lookup kernels (kernels/jit/buckets.py), with the signatures and semantics of
kernels.reference.buckets. A decode step's `best_buckets` in two launches (the logits spread over programs; then per
KV head their softmax summed and the best buckets; `select_buckets` also has the second sum the kept buckets'
positions per block of buckets, so that their expansion takes one launch more, not two), `take_best` in one (a sort
in registers, no host synchronisation, where torch's would be a sort, a gather, a prefix sum and a scatter). A
prefill's scores (thousands of query rows) are the reference's batched products (cuBLAS), the pick this module's.
`held_keys` and `take_best_held` (a calibration's counts of every budget at once, off the step's path) are the
reference's."""

from __future__ import annotations

import torch
import triton

from kernels import compact_ops
from kernels.checks import check_valid
from kernels.jit.buckets import logits_kernel, pick_kernel, take_best_kernel
from kernels.launch import dependent_launch
from kernels.reference import buckets as reference
from kernels.reference.buckets import classify, derope, held_keys, ranking, take_best_held
from kernels.selection import Selection

DECODE_BLOCK_C = 64  # buckets per program of the logits (decode)
DECODE_ROWS = 16  # the most query rows (query heads of a group x tokens) a step's scores take the kernels for
WARPS = 8


def precision(device: torch.device) -> str:
    """tl.dot's for float32 inputs: 3xTF32 on a GPU (float32's accuracy on the tensor cores), IEEE in the
    interpreter (where both are the same)."""
    return "tf32x3" if device.type == "cuda" else "ieee"


def bucket_scores(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, w1: torch.Tensor,
                  b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                  valid: torch.Tensor | None = None) -> torch.Tensor:
    return best_buckets(q, positions, inv_freq, w1, b1, w2, b2, None, 0.0, valid=valid)[0]


def best_buckets(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, w1: torch.Tensor,
                 b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, sizes: torch.Tensor | None,
                 budget: float, per_key: bool = False,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    score, keep, _ = _best(q, positions, inv_freq, w1, b1, w2, b2, sizes, budget, per_key, valid)
    return score, keep


def select_buckets(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, w1: torch.Tensor,
                   b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, sizes: torch.Tensor, budget: float,
                   starts: torch.Tensor, total: int, tail: int = 0, per_key: bool = False,
                   valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, Selection]:
    """best_buckets and the expansion of the kept buckets into positions; in a decode step the pick kernel also sums
    the kept positions per block of buckets, the expansion's first step (one launch fewer)."""
    if tuple(starts.shape) != (sizes.shape[0], sizes.shape[1] + 1) or starts.dtype != torch.int64:
        raise ValueError(f"starts must be int64 [H, C + 1] for sizes {tuple(sizes.shape)}, got {starts.dtype} "
                         f"{tuple(starts.shape)}")
    block_g, sub, block_k = compact_ops.write_tiles(total, sizes.shape[1])
    score, keep, block_sums = _best(q, positions, inv_freq, w1, b1, w2, b2, sizes, budget, per_key, valid,
                                    starts=starts, block_g=block_g)
    if block_sums is None:
        return score, keep, compact_ops.expand_groups(keep, starts, total, tail)
    return score, keep, compact_ops.expand_block_sums(keep, starts, block_sums, block_g, total, tail, sub=sub,
                                                      block_k=block_k)


def _best(q, positions, inv_freq, w1, b1, w2, b2, sizes, budget, per_key, valid, starts=None, block_g=0):
    """best_buckets', and with `starts` in a decode step the kept positions per block of block_g buckets
    [Hkv, cdiv(C, block_g)] int64 (else None)."""
    check_valid(valid, q.device)
    hq, lq, d = q.shape
    hkv, _, hidden = w1.shape
    c = w2.shape[-1]
    if hq % hkv or d % 2 or w1.shape[1] != d or inv_freq.numel() != d // 2 or w2.shape[:2] != (hkv, hidden):
        raise ValueError(f"q {tuple(q.shape)}, inv_freq {tuple(inv_freq.shape)}, w1 {tuple(w1.shape)}, "
                         f"w2 {tuple(w2.shape)} do not fit together")
    rows = (hq // hkv) * lq
    # a prefill's scores (a padded question's too): torch's batched products (cuBLAS) beat a kernel here
    if rows > DECODE_ROWS or not c or valid is not None:
        score = reference.bucket_scores(q, positions, inv_freq, w1, b1, w2, b2, valid)
        return score, None if sizes is None else take_best(ranking(score, sizes, per_key), sizes, budget), None
    params = [t.to(device=q.device, dtype=torch.float32).contiguous() for t in (inv_freq, w1, b1, w2, b2)]
    if q.stride(-1) != 1:
        q = q.contiguous()
    positions = positions.to(device=q.device, dtype=torch.int64).contiguous()
    logits = torch.empty(hkv, rows, c, dtype=torch.float32, device=q.device)
    logits_kernel[(hkv, triton.cdiv(c, DECODE_BLOCK_C))](
        q, positions, *params, logits, q.stride(0), q.stride(1), lq, rows, c, d // 2, hidden, GROUP=hq // hkv,
        BLOCK_R=DECODE_ROWS, BLOCK_D=max(16, triton.next_power_of_2(d // 2)),
        BLOCK_H=max(16, triton.next_power_of_2(hidden)), BLOCK_C=DECODE_BLOCK_C, PRECISION=precision(q.device),
        num_warps=WARPS, **dependent_launch(q.device))
    score = torch.empty(hkv, c, dtype=torch.float32, device=q.device)
    keep = torch.empty(hkv, c, dtype=torch.bool, device=q.device)
    if sizes is not None:
        _check_sizes(score, sizes)
    block_c = max(16, triton.next_power_of_2(c))
    blocks = None
    if starts is not None and sizes is not None and block_g <= block_c:
        blocks = torch.empty(hkv, triton.cdiv(c, block_g), dtype=torch.int64, device=q.device)  # every one written
    pick_kernel[(hkv,)](logits, score if sizes is None else sizes.contiguous(), score, keep, rows, c, 1.0 / lq,
                        float(budget), HAS_SIZES=sizes is not None, PER_KEY=per_key, BLOCK_C=block_c,
                        starts_ptr=starts.contiguous() if blocks is not None else None,
                        block_sums_ptr=blocks, NB=blocks.shape[1] if blocks is not None else 1,
                        BLOCKS=blocks is not None, BLOCK_G=block_g if blocks is not None else 16, num_warps=WARPS,
                        **dependent_launch(logits.device))
    return score, None if sizes is None else keep, blocks


def _check_sizes(score: torch.Tensor, sizes: torch.Tensor) -> None:
    if score.shape != sizes.shape or score.dim() != 2:
        raise ValueError(f"score and sizes must be [H, C] alike, got {tuple(score.shape)}, {tuple(sizes.shape)}")
    if sizes.dtype != torch.int64:
        raise TypeError(f"sizes must be int64, got {sizes.dtype}")


def take_best(score: torch.Tensor, sizes: torch.Tensor, budget: float) -> torch.Tensor:
    _check_sizes(score, sizes)
    if score.dtype != torch.float32:
        raise TypeError(f"score must be float32, got {score.dtype}")
    h, c = score.shape
    keep = torch.empty(h, c, dtype=torch.bool, device=score.device)
    if h and c:
        take_best_kernel[(h,)](score.contiguous(), sizes.contiguous(), keep, c, float(budget),
                               BLOCK_C=max(16, triton.next_power_of_2(c)), num_warps=WARPS,
                               **dependent_launch(score.device))
    return keep


__all__ = ["best_buckets", "bucket_scores", "select_buckets", "take_best", "classify", "derope", "held_keys", "ranking",
           "reference", "take_best_held"]
