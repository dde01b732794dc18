"""Input checks shared by the wrappers (kernels/sparse_ops.py, kernels/causal_ops.py, the lookups' `valid` counts)."""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634  # the kernels work in base 2: scale * LOG2E folds the softmax scale into one multiply
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q [Hq, Lq, D], k and v [Hkv, Lk, D] of one supported dtype (q any of them) and head dim, Hq a multiple of
    Hkv (GQA). Raises ValueError / TypeError saying what is wrong."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected q [Hq, Lq, D], k/v [Hkv, Lk, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.dtype not in SUPPORTED_DTYPES or v.dtype != k.dtype or q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"k and v must share one of {SUPPORTED_DTYPES} (q any of them); got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if q.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {q.shape[2]} not supported; expected one of {SUPPORTED_HEAD_DIMS}")
    hq, hkv = q.shape[0], k.shape[0]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")


def check_valid(valid: torch.Tensor | None, device: torch.device) -> None:
    """A pooled lookup's count of real tokens: None (every token), or an int64 [1] tensor on `device` (the first
    valid[0] tokens are real, the rest padding; its value is never read on the host)."""
    if valid is not None and (not isinstance(valid, torch.Tensor) or valid.shape != (1,) or valid.dtype != torch.int64
                              or valid.device != device):
        got = (valid.dtype, tuple(valid.shape), valid.device) if isinstance(valid, torch.Tensor) else valid
        raise ValueError(f"valid must be an int64 [1] tensor on {device} (the real tokens), got {got}")
