"""The best-buckets pick (Saap's lookup): one program per row finds the threshold tau, the highest bucket score
whose buckets at or above it hold at least `budget` keys, without sorting: each candidate score's held keys are a
masked sum over the row ([BLOCK_T candidates x C] per step, the row's scores and sizes in registers)."""

import triton
import triton.language as tl


@triton.jit
def take_best_kernel(
    score_ptr,  # [H, C] float32
    sizes_ptr,  # [H, C] int64
    keep_ptr,  # [H, C] bool out
    C,
    budget,  # float: keys to reach
    BLOCK_C: tl.constexpr,  # >= C, a power of two
    BLOCK_T: tl.constexpr,  # candidates per step
):
    h = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    valid = cc < C
    s = tl.load(score_ptr + h * C + cc, mask=valid, other=float("-inf"))
    n = tl.load(sizes_ptr + h * C + cc, mask=valid, other=0).to(tl.float32)
    tau = tl.min(tl.where(valid, s, float("inf")), axis=0)  # where no score reaches the budget: every bucket
    for t0 in range(0, C, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        cand = tl.load(score_ptr + h * C + tt, mask=tt < C, other=float("-inf"))  # [BLOCK_T]
        held = tl.sum(tl.where(s[None, :] >= cand[:, None], n[None, :], 0.0), axis=1)  # [BLOCK_T]
        tau = tl.maximum(tau, tl.max(tl.where((held >= budget) & (tt < C), cand, float("-inf")), axis=0))
    tl.store(keep_ptr + h * C + cc, s >= tau, mask=valid)
