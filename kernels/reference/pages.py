"""Reference of Quest's page scores (kernels/jit/pages.py).

For one query token and head, the upper bound of q . k over a page's keys from the page's element-wise bounds is
sum_i max(q_i min_i, q_i max_i) = q+ . max + q- . min (q+ = max(q, 0), q- = min(q, 0)): two matrix products, which
keep the CPU engine's memory at [Hq, Lq, P] (tests check it against the max form itself). A row sums its query
heads' bounds; a step's score of a page is max(the mean over its tokens, the last token's).
"""

from __future__ import annotations

import torch

from kernels.reference._common import CODES, dequantize, token_mean_and_last
from kernels.selection import Selection


def quantize_bounds(page_min: torch.Tensor, page_max: torch.Tensor) -> dict[str, torch.Tensor]:
    """Bounds [Hkv, P, D] -> one byte per element, rounded outwards so that they still bound every key: per KV head
    and dim, offset = the smallest minimum and step = (the largest maximum - offset) / 255; a minimum's code is
    floor((min - offset) / step), a maximum's ceil((max - offset) / step). Returns {"page_min", "page_max": uint8
    [Hkv, P, D], "bound_offset", "bound_step": float32 [Hkv, D]}. Each bound moves outwards by less than one step
    (1/255 of the dim's range over the context): half the bytes of bf16 bounds for a slightly looser score."""
    lo, hi = page_min.double(), page_max.double()
    offset = lo.amin(dim=1)  # [Hkv, D]
    step = ((hi.amax(dim=1) - offset) / CODES * (1 + 1e-6)).clamp(min=1e-30)  # code 255 reaches the maximum
    offset32, step32 = offset.float(), step.float()
    # codes from the float32 offset and step the kernels read, and checked in float32 as the kernels dequantize
    code_lo = torch.floor((lo - offset32.double()[:, None]) / step32.double()[:, None]).clamp(0, CODES)
    code_hi = torch.ceil((hi - offset32.double()[:, None]) / step32.double()[:, None]).clamp(0, CODES)
    code_lo = code_lo - (offset32[:, None] + step32[:, None] * code_lo.float() > page_min.float()).double()
    code_hi = code_hi + (offset32[:, None] + step32[:, None] * code_hi.float() < page_max.float()).double()
    return {"page_min": code_lo.clamp(0, CODES).to(torch.uint8), "page_max": code_hi.clamp(0, CODES).to(torch.uint8),
            "bound_offset": offset32, "bound_step": step32}


def dequantize_bounds(codes: torch.Tensor, offset: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """uint8 codes [Hkv, P, D] with offset, step [Hkv, D] -> float32 bounds [Hkv, P, D] (quantize_bounds)."""
    return dequantize(codes, offset, step)


def page_scores(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, rows: int,
                offset: torch.Tensor | None = None, step: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Hq, Lq, D]; page_min, page_max: [Hkv, P, D] bounds, or uint8 codes with offset and step [Hkv, D]
    (quantize_bounds); rows: Hkv or Hq; valid: [1] int64, the real tokens of Lq (the first ones; None: all).
    Returns [rows, P] float32."""
    hq, lq, _ = q.shape
    hkv = page_min.shape[0]
    if hkv == 0 or hq % hkv or rows not in (hq, hkv):
        raise ValueError(f"rows must be Hq={hq} or Hkv={hkv} (Hq a multiple of Hkv), got {rows}")
    if offset is not None:
        page_min, page_max = dequantize_bounds(page_min, offset, step), dequantize_bounds(page_max, offset, step)
    group = hq // hkv
    lo = page_min.float().repeat_interleave(group, dim=0)  # [Hq, P, D]
    hi = page_max.float().repeat_interleave(group, dim=0)
    qf = q.float()
    bound = qf.clamp(min=0) @ hi.transpose(1, 2) + qf.clamp(max=0) @ lo.transpose(1, 2)  # [Hq, Lq, P]
    bound = bound.reshape(rows, hq // rows, lq, -1).sum(dim=1)  # [rows, Lq, P]
    return torch.maximum(*token_mean_and_last(bound, valid))


def _top_pages(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: [rows, P] float32 -> keep [rows, P] bool: each row's k best pages (torch.topk)."""
    if not 1 <= k <= max(scores.shape[1], 1):
        raise ValueError(f"k must be in [1, {scores.shape[1]}], got {k}")
    top = torch.topk(scores, k, dim=1, sorted=False).indices
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, top, True)


def select_pages(scores: torch.Tensor, k: int, page: int, num_keys: int) -> tuple[torch.Tensor, Selection]:
    """Quest's selection: scores [rows, P] of full pages of `page` keys covering keys [0, P * page) of num_keys ->
    (keep [rows, P] bool: each row's k best pages; the Selection of their keys and of every key from P * page on)."""
    rows, pages = scores.shape
    if not 0 <= k <= pages or (pages and k < 1):
        raise ValueError(f"k must be in [1, {pages}], got {k}")
    keep = _top_pages(scores, k) if k else torch.zeros(rows, pages, dtype=torch.bool, device=scores.device)
    mask = torch.cat([keep.repeat_interleave(page, dim=1),
                      torch.ones(rows, num_keys - pages * page, dtype=torch.bool, device=scores.device)], dim=1)
    return keep, Selection.from_mask(mask)
