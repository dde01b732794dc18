"""PyTorch references of every kernel: written for clarity, they define the semantics the Triton kernels must match.

Conventions (batch 1, no batch dimension):
    q: [Hq, Lq, D]      queries (already rotated), any float dtype
    k, v: [Hkv, Lk, D]  keys and values; Hq is a multiple of Hkv (GQA) and query head h reads KV head h // (Hq // Hkv)
Outputs are float32: out [Hq, Lq, D], lse [Hq, Lq] (natural-log log-sum-exp of the scaled scores; -inf where a
query attends to nothing, with out = 0 there).
"""

from __future__ import annotations

import torch

from kernels.layout import expand_groups
from kernels.selection import Selection

NEG_INF = float("-inf")
ASSIGN_CHUNK_ELEMENTS = 1 << 26  # nearest_centroid: point x centroid scores computed at once (all heads)


def _grouped(q: torch.Tensor, rows: int) -> torch.Tensor:
    """[Hq, Lq, D] -> [rows, (Hq // rows) * Lq, D]: the query heads that share a row, stacked along the tokens."""
    hq, lq, d = q.shape
    return q.reshape(rows, (hq // rows) * lq, d)


def _ungrouped(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[rows, G * Lq, ...] -> [Hq, Lq, ...]."""
    rows, glq = x.shape[:2]
    return x.reshape(hq, (rows * glq) // hq, *x.shape[2:])


def _softmax_out(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: [R, M, N] float32 with -inf where masked; v: [R, N, D] -> out [R, M, D], lse [R, M]."""
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.matmul(probs, v.float())
    return out, lse


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of every query over every key, with an optional boolean mask.

    mask: [Lq, Lk] or [Hq, Lq, Lk] bool, True where the query may attend.
    Returns out [Hq, Lq, D] float32, lse [Hq, Lq] float32.
    """
    hq, lq, _ = q.shape
    hkv, lk, _ = k.shape
    if lk == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full((hq, lq), NEG_INF, dtype=torch.float32)
    qg = _grouped(q.float(), hkv)  # [Hkv, G*Lq, D]
    scores = torch.matmul(qg, k.float().transpose(1, 2)) * scale  # [Hkv, G*Lq, Lk]
    if mask is not None:
        full = mask.expand(hq, lq, lk)
        scores = scores.masked_fill(~_grouped(full, hkv), NEG_INF)
    out, lse = _softmax_out(scores, v)
    return _ungrouped(out, hq), _ungrouped(lse, hq)


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]],
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions over disjoint key sets by log-sum-exp.

    parts: [(out [H, L, D], lse [H, L])]; out: optional [H, L, D] tensor the result is written into (any dtype and
    strides: the caller's layout). Returns (out, lse) over the union of the key sets (out float32 when not given).
    """
    lses = torch.stack([lse for _, lse in parts])  # [P, H, L]
    total = torch.logsumexp(lses, dim=0)  # [H, L]
    safe_total = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    weights = torch.exp(lses - safe_total[None])  # [P, H, L]; exp(-inf) = 0 for empty parts
    merged = sum(w[..., None] * o for w, (o, _) in zip(weights, parts))
    if out is None:
        return merged, total
    out.copy_(merged)
    return out, total


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over only the keys its row selects (reads just those keys).

    Every query token of a row uses the same selection. Rows are query heads or KV heads (see Selection).
    Returns out [Hq, Lq, D] float32, lse [Hq, Lq] float32.
    """
    hq, lq, _ = q.shape
    hkv = k.shape[0]
    rows = selection.rows
    if rows not in (hq, hkv) or hq % rows:
        raise ValueError(f"selection has {rows} rows; expected Hq={hq} or Hkv={hkv}")
    idx, valid = selection.padded()  # [R, W]
    kv_head = torch.arange(rows, device=q.device) * hkv // rows  # [R]
    ks = k[kv_head[:, None], idx].float()  # [R, W, D]
    vs = v[kv_head[:, None], idx].float()
    qg = _grouped(q.float(), rows)  # [R, G*Lq, D]
    scores = torch.matmul(qg, ks.transpose(1, 2)) * scale  # [R, G*Lq, W]
    scores = scores.masked_fill(~valid[:, None, :], NEG_INF)
    if idx.shape[1] == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full((hq, lq), NEG_INF, dtype=torch.float32)
    out, lse = _softmax_out(scores, vs)
    return _ungrouped(out, hq), _ungrouped(lse, hq)


def centroid_log_scores(
    q: torch.Tensor,
    centroids: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 1 of Squeezed Attention in log space: log S_i = s_i - log sum_j N_j exp(s_j), s = scale * q . C.

    q: [Hq, Lq, D]; centroids: [Hkv, C, D]; counts: [Hkv, C] (keys per cluster, 0 for an empty cluster)
    allowed: optional bool mask broadcastable to [Hq, Lq, C] ([Hq, C] is read as [Hq, 1, C]): only these
             clusters enter the denominator (eq. 3, hierarchical level 2); the others get log S = -inf.
    Returns [Hq, Lq, C] float32.
    """
    hq, lq, _ = q.shape
    hkv = centroids.shape[0]
    s = torch.matmul(_grouped(q.float(), hkv), centroids.float().transpose(1, 2)) * scale  # [Hkv, G*Lq, C]
    s = _ungrouped(s, hq)  # [Hq, Lq, C]
    log_n = torch.log(counts.float()).repeat_interleave(hq // hkv, dim=0)[:, None, :]  # [Hq, 1, C]
    if allowed is not None:
        allowed = allowed[:, None, :] if allowed.dim() == 2 else allowed
        log_n = log_n.masked_fill(~allowed, NEG_INF)
    out = s - torch.logsumexp(s + log_n, dim=-1, keepdim=True)  # [Hq, Lq, C]
    if allowed is not None:
        out = out.masked_fill(~allowed, NEG_INF)
    return out


def row_scores(log_scores: torch.Tensor, rows: int) -> torch.Tensor:
    """S per token averaged over the query heads that share a row. [Hq, Lq, C] log S -> [rows, Lq, C] S."""
    hq, lq, c = log_scores.shape
    return torch.exp(log_scores).reshape(rows, hq // rows, lq, c).mean(dim=1)


def reduce_scores(log_scores: torch.Tensor, rows: int) -> torch.Tensor:
    """A row's cluster scores for one step: S averaged over the query heads that share the row, then over the
    step's tokens (eq. 1 averaged over the question, as in the paper's prefill), except that the last token's own
    score counts too: the last prompt token is the one that produces the first answer token, so it keeps the
    clusters a decode step would. (A cluster is kept if either score passes the threshold.)

    log_scores: [Hq, Lq, C] -> [rows, C] float32: max(mean over tokens, last token). Lq == 1 is the decode lookup.
    """
    per_token = row_scores(log_scores, rows)  # [rows, Lq, C]
    return torch.maximum(per_token.mean(dim=1), per_token[:, -1])


def select_clusters(mean_scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """mean S [rows, C] -> kept clusters [rows, C] bool: S > T (T <= 0 keeps every cluster, empty ones too;
    the policies drop empty clusters by their counts)."""
    return mean_scores > threshold if threshold > 0 else mean_scores >= 0


def cluster_keep(
    q: torch.Tensor,
    centroids: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    threshold: float,
    rows: int,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole centroid lookup of one step: eq. 1 (eq. 3 under `allowed`), reduced per row, against T.

    q: [Hq, Lq, D]; centroids: [Hkv, C, D]; counts: [Hkv, C]; rows: Hq or Hkv (see Selection)
    allowed: optional [rows, C] bool, the candidate clusters (hierarchical level 2): only they enter the
             denominator, and the others are neither scored nor kept.
    Returns keep [rows, C] bool (S > T, or every non-empty candidate when T <= 0) and score [rows, C] float32
    (reduce_scores: max of the token mean and the last token of S averaged over the row's query heads; 0 where
    not allowed).
    """
    hq = q.shape[0]
    allowed_hq = None if allowed is None else allowed.repeat_interleave(hq // rows, dim=0)
    score = reduce_scores(centroid_log_scores(q, centroids, counts, scale, allowed=allowed_hq), rows)
    keep = select_clusters(score, threshold) & (counts.repeat_interleave(rows // counts.shape[0], dim=0) > 0)
    if allowed is not None:
        keep &= allowed
    return keep, score


def cluster_keep_among(
    q: torch.Tensor,
    centroids: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    threshold: float,
    rows: int,
    candidates: Selection,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cluster_keep` restricted to each row's candidate clusters (a Selection over cluster ids, num_keys = C):
    the hierarchical level 2, whose denominator runs over the candidates only (eq. 3)."""
    return cluster_keep(q, centroids, counts, scale, threshold, rows, allowed=candidates.to_mask())


def cluster_select(
    q: torch.Tensor,
    centroids: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    threshold: float,
    rows: int,
    starts: torch.Tensor,
    total: int,
    tail: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, Selection]:
    """`cluster_keep`, then the kept clusters' key positions (`kernels.layout.expand_groups(keep, starts, total,
    tail)`: starts [Hkv, C + 1] where each cluster's keys lie). Returns (keep, score, Selection)."""
    keep, score = cluster_keep(q, centroids, counts, scale, threshold, rows)
    return keep, score, expand_groups(keep, starts, total, tail)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor,
    k_start: int,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention over keys at consecutive positions, causal and optionally within a sliding window.

    q: [Hq, Lq, D]; k, v: [Hkv, Lk, D]; q_pos: [Lq] int64 on q's device, the absolute position of each query;
    key j sits at position k_start + j. Query i attends key j iff k_pos <= q_pos[i] and, with a window,
    k_pos > q_pos[i] - window.
    Returns out [Hq, Lq, D] float32, lse [Hq, Lq] float32 (out 0, lse -inf for a query that sees no key).
    Masked values still enter the product with probability 0, so k and v must be finite everywhere here.
    """
    k_pos = k_start + torch.arange(k.shape[1], device=q.device)  # [Lk]
    mask = k_pos[None, :] <= q_pos[:, None]  # [Lq, Lk]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return attention_with_lse(q, k, v, scale, mask)


def nearest_centroid(points: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-means assignment. points [H, N, D], centroids [H, K, D] -> (labels [H, N] int64, best [H, N] float32):
    per point the centroid of the largest inner product and that product, computed in the points' dtype (centroids
    cast to it; 16-bit runs on tensor cores), a chunk of points at a time."""
    h, n, _ = points.shape
    k = centroids.shape[1]
    step = max(1, ASSIGN_CHUNK_ELEMENTS // max(1, h * k))
    ct = centroids.to(points.dtype).transpose(1, 2)  # [H, D, K]
    labels, best = [], []
    for start in range(0, n, step):
        sims = torch.matmul(points[:, start : start + step], ct)  # [H, n, K]
        b, lab = sims.max(dim=-1)
        labels.append(lab)
        best.append(b.float())
    if not labels:
        return torch.empty(h, 0, dtype=torch.int64, device=points.device), torch.empty(h, 0, device=points.device)
    return torch.cat(labels, dim=1), torch.cat(best, dim=1)
