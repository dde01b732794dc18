"""Typed wrappers of Quest's page kernels (kernels/jit/pages.py): the page scores and the top pages' selection;
reference: kernels/reference/pages.py."""

from __future__ import annotations

import torch
import triton

from kernels.checks import check_valid
from kernels.jit.pages import page_scores_kernel, page_threshold_kernel, page_write_kernel
from kernels.launch import dependent_launch
from kernels.reference._common import token_mean_and_last
from kernels.reference.pages import dequantize_bounds, quantize_bounds  # the one-byte format: torch on both backends
from kernels.selection import Selection

BLOCK_P = 64  # pages per program
MAX_SINGLE = 32768  # pages of a row that the top-K search keeps in registers (32 per thread at 32 warps)
TOP_CHUNK = 8192  # pages per step of the search beyond that (re-read from the cache at each of its steps)
TOP_ITERS = 13  # steps of the search, each a third of the bracket: it ends within (max - min) / 3^13 ~ 2^-20.6
SELECT_CHUNK = 256  # pages per program of the selection's writing kernel (x page keys written)
TOP_ELEMS = 32  # scores per thread of the search (its warps: pages / 32 / TOP_ELEMS, 1 to 32)


def _check(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, rows: int) -> None:
    if q.dim() != 3 or page_min.dim() != 3 or page_min.shape != page_max.shape:
        raise ValueError(f"expected q [Hq, Lq, D] and bounds [Hkv, P, D] of one shape; got {tuple(q.shape)}, "
                         f"{tuple(page_min.shape)}, {tuple(page_max.shape)}")
    hq, lq, d = q.shape
    hkv = page_min.shape[0]
    if page_min.shape[2] != d or d & (d - 1):
        raise ValueError(f"head_dim must match and be a power of 2; got q {d}, bounds {page_min.shape[2]}")
    if lq < 1:
        raise ValueError("need at least one query token")
    if hkv == 0 or hq % hkv or rows not in (hq, hkv):
        raise ValueError(f"rows must be Hq={hq} or Hkv={hkv} (Hq a multiple of Hkv), got {rows}")
    if q.device != page_min.device or q.device != page_max.device:
        raise ValueError(f"q on {q.device}, bounds on {page_min.device} / {page_max.device}")


def reduced_queries(q: torch.Tensor, rows: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Hq, Lq, D] -> [rows, 4, D] float32: per row, the sum over its query heads of q+ and q- averaged over the
    tokens, then of the last token's (the bound is linear in them: kernels/jit/pages.py); valid: the real tokens
    (kernels.reference._common.token_mean_and_last)."""
    hq, _, d = q.shape
    qf = q.float()
    (pos_mean, pos_last), (neg_mean, neg_last) = (token_mean_and_last(x, valid)
                                                  for x in (qf.clamp(min=0), qf.clamp(max=0)))
    parts = torch.stack([pos_mean, neg_mean, pos_last, neg_last], dim=1)  # [Hq, 4, D]
    return parts.view(rows, hq // rows, 4, d).sum(dim=1).contiguous()


def page_scores(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, rows: int,
                offset: torch.Tensor | None = None, step: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Hq, Lq, D]; page_min, page_max: [Hkv, P, D] bounds, or uint8 codes with offset and step [Hkv, D]
    (kernels.reference.pages.quantize_bounds: half the bytes); rows: Hkv (each row sums its query heads' bounds)
    or Hq.

    Returns [rows, P] float32: per page, max(the bound of the tokens' mean, the bound of the last token), where a
    token's bound is sum_i max(q_i min_i, q_i max_i) summed over the row's query heads (kernels.reference.pages).
    A decode step (Lq = 1) is one launch; a question's tokens are first reduced to four vectors per row (a few
    small torch ops), so the kernel reads four vectors per row whatever Lq is. valid: [1] int64, the real tokens of
    Lq (the first ones; None: all).
    """
    _check(q, page_min, page_max, rows)
    check_valid(valid, q.device)
    quant = offset is not None
    if quant != (step is not None) or quant != (page_min.dtype == torch.uint8 == page_max.dtype):
        raise ValueError("uint8 codes need offset and step [Hkv, D]; bounds of the keys' dtype need neither")
    hq, lq, d = q.shape
    hkv, pages, _ = page_min.shape
    out = torch.empty(rows, pages, dtype=torch.float32, device=q.device)
    if rows == 0 or pages == 0:
        return out
    reduced = lq > 1
    pre = reduced_queries(q, rows, valid) if reduced else out  # `out` stands in for the unused pointer
    q = q if q.stride(2) == 1 else q.contiguous()
    page_min, page_max = page_min.contiguous(), page_max.contiguous()
    if quant:
        if offset.shape != (hkv, d) or step.shape != (hkv, d):
            raise ValueError(f"offset and step must be [Hkv, D] = {(hkv, d)}, got {tuple(offset.shape)}, "
                             f"{tuple(step.shape)}")
        offset, step = offset.float().contiguous(), step.float().contiguous()
    else:
        offset = step = out  # unused pointers
    page_scores_kernel[(rows, triton.cdiv(pages, BLOCK_P))](
        q, pre, page_min, page_max, offset, step, out, pages, q.stride(0), page_min.stride(0), page_min.stride(1),
        HEADS_PER_ROW=hq // rows, ROWS_PER_KV=rows // hkv, REDUCED=reduced, QUANT=quant, D=d, BLOCK_P=BLOCK_P,
        **dependent_launch(q.device),
    )
    return out


def select_pages(scores: torch.Tensor, k: int, page: int, num_keys: int) -> tuple[torch.Tensor, Selection]:
    """Quest's selection: scores [rows, P] float32 of full pages of `page` keys covering keys [0, P * page) of
    num_keys -> (keep [rows, P] bool: each row's k best pages, ties with the k-th broken by page order; the
    Selection of their keys, then every key from P * page on (a partial last page, the dense tail), in order).
    Every row reads k * page + num_keys - P * page keys, so indptr is fixed by the shapes: two launches (a search
    per row: a bracket of the k-th score, then a writer per chunk of pages), no host synchronisation. The same pages
    as kernels.reference.pages.select_pages where no score but the k-th lies within (max - min) / 3^TOP_ITERS of
    it (a near-tie is broken by page order, like a tie)."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [rows, P], got {scores.dtype} {tuple(scores.shape)}")
    rows, pages = scores.shape
    if not 0 <= k <= pages or (pages and k < 1):
        raise ValueError(f"k must be in [1, {pages}], got {k}")
    if page < 1 or page & (page - 1) or pages * page > num_keys:
        raise ValueError(f"page must be a power of two and the pages must lie within the {num_keys} keys")
    per_row = k * page + num_keys - pages * page
    keep = torch.empty(rows, pages, dtype=torch.bool, device=scores.device)
    indptr = torch.empty(rows + 1, dtype=torch.int64, device=scores.device)
    indices = torch.empty(max(1, rows * per_row), dtype=torch.int32, device=scores.device)
    if rows == 0:
        indptr.zero_()
        return keep, Selection(indptr=indptr, indices=indices, num_keys=num_keys)
    single = pages <= MAX_SINGLE
    block = max(16, triton.next_power_of_2(pages)) if single else TOP_CHUNK
    chunk = min(SELECT_CHUNK, block)
    nch = triton.cdiv(pages, chunk)
    dev = scores.device
    bracket = torch.empty(rows, 2, dtype=torch.float32, device=dev)
    room = torch.empty(rows, dtype=torch.int32, device=dev)
    above = torch.empty(rows, max(nch, 1), dtype=torch.int32, device=dev)
    cand = torch.empty_like(above)
    scores = scores.contiguous()
    page_threshold_kernel[(rows,)](scores, bracket, room, above, cand, pages, k, nch, BLOCK=block, SINGLE=single,
                                   ITERS=TOP_ITERS, CHUNK=chunk,
                                   num_warps=max(1, min(32, block // (32 * TOP_ELEMS))), **dependent_launch(dev))
    page_write_kernel[(rows, nch + 1)](scores, bracket, room, above, cand, keep, indptr, indices, pages, k, nch,
                                       num_keys, per_row, PAGE=page, CHUNK=chunk,
                                       BLOCK_N=max(16, triton.next_power_of_2(nch)), num_warps=4,
                                       **dependent_launch(dev))
    return keep, Selection(indptr=indptr, indices=indices, num_keys=num_keys)


__all__ = ["dequantize_bounds", "page_scores", "quantize_bounds", "reduced_queries", "select_pages"]
