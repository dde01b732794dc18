"""Reference of Quest's page scores (kernels/jit/pages.py).

For one query token and head, the upper bound of q . k over a page's keys from the page's element-wise bounds is
sum_i max(q_i min_i, q_i max_i) = q+ . max + q- . min (q+ = max(q, 0), q- = min(q, 0)): two matrix products, which
keep the CPU engine's memory at [Hq, Lq, P] (tests check it against the max form itself). A row sums its query
heads' bounds; a step's score of a page is max(the mean over its tokens, the last token's).
"""

from __future__ import annotations

import torch

from kernels.selection import Selection


def page_scores(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, rows: int) -> torch.Tensor:
    """q: [Hq, Lq, D]; page_min, page_max: [Hkv, P, D]; rows: Hkv or Hq. Returns [rows, P] float32."""
    hq, lq, _ = q.shape
    hkv = page_min.shape[0]
    if hkv == 0 or hq % hkv or rows not in (hq, hkv):
        raise ValueError(f"rows must be Hq={hq} or Hkv={hkv} (Hq a multiple of Hkv), got {rows}")
    group = hq // hkv
    lo = page_min.float().repeat_interleave(group, dim=0)  # [Hq, P, D]
    hi = page_max.float().repeat_interleave(group, dim=0)
    qf = q.float()
    bound = qf.clamp(min=0) @ hi.transpose(1, 2) + qf.clamp(max=0) @ lo.transpose(1, 2)  # [Hq, Lq, P]
    bound = bound.reshape(rows, hq // rows, lq, -1).sum(dim=1)  # [rows, Lq, P]
    return torch.maximum(bound.mean(dim=1), bound[:, -1])


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
