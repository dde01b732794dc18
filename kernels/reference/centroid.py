"""Reference of the centroid lookup (kernels/jit/centroid.py): eq. 1 (and eq. 3) of Squeezed Attention, reduced
per row and compared with a threshold."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference._common import CODES, NEG_INF, _grouped, _ungrouped, dequantize, token_mean_and_last
from kernels.reference.compact import expand_groups
from kernels.selection import Fixed, KeyCount, Selection


def quantize_centroids(centroids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Centroids [Hkv, C, D] -> one byte per element: per KV head and dim, offset = the smallest value and step =
    (the largest - offset) / 255; a value's code is round((value - offset) / step). Returns {"centroids": uint8
    [Hkv, C, D], "centroid_offset", "centroid_step": float32 [Hkv, D]}.

    The kernels read the codes as their values: q . C = q . offset + (q * step) . codes, and the first term is the
    same for every centroid of a (head, token), so eq. 1's S from the scaled query (q * step, scaled_queries) over
    the codes is S from q over the dequantized centroids; each element moves by at most step / 2."""
    c = centroids.float()
    offset = c.amin(dim=1)  # [Hkv, D]
    step = ((c.amax(dim=1) - offset) / CODES).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((c - offset[:, None]) / step[:, None]).clamp(0, CODES).to(torch.uint8)
    return {"centroids": codes, "centroid_offset": offset, "centroid_step": step}


def dequantize_centroids(codes: torch.Tensor, offset: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """uint8 codes [Hkv, C, D] with offset, step [Hkv, D] -> float32 centroids [Hkv, C, D] (quantize_centroids)."""
    return dequantize(codes, offset, step)


def scaled_queries(q: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """q [Hq, Lq, D] and the codes' step [Hkv, D] -> q * step [Hq, Lq, D] float32 (each query head scaled by its KV
    head's step): the queries whose scores over one-byte codes give eq. 1's S (quantize_centroids). The kernels
    round them to q's dtype, or to float16 for 16-bit queries (kernels/jit/centroid.py)."""
    per_head = step.float().repeat_interleave(q.shape[0] // step.shape[0], dim=0)[:, None, :]  # [Hq, 1, D]
    return q.float() * per_head


def centroid_log_scores(
    q: torch.Tensor,
    centroids: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None = None,
    *,
    step: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 1 of Squeezed Attention in log space: log S_i = s_i - log sum_j N_j exp(s_j), s = scale * q . C.

    q: [Hq, Lq, D]; centroids: [Hkv, C, D]; counts: [Hkv, C] (keys per cluster, 0 for an empty cluster)
    allowed: optional bool mask broadcastable to [Hq, Lq, C] ([Hq, C] is read as [Hq, 1, C]): only these
             clusters enter the denominator (eq. 3, hierarchical level 2); the others get log S = -inf.
    step: with uint8 codes for centroids, their step [Hkv, D] (quantize_centroids): the codes are scored with
          scaled_queries(q, step), which gives S over the centroids they encode.
    Returns [Hq, Lq, C] float32.
    """
    if step is not None:
        q = scaled_queries(q, step)
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


def reduce_scores(log_scores: torch.Tensor, rows: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """A row's cluster scores for one step: S averaged over the query heads that share the row, then over the
    step's tokens (eq. 1 averaged over the question, as in the paper's prefill), except that the last token's own
    score counts too: the last prompt token is the one that produces the first answer token, so it keeps the
    clusters a decode step would. (A cluster is kept if either score passes the threshold.)

    log_scores: [Hq, Lq, C] -> [rows, C] float32: max(mean over tokens, last token). Lq == 1 is the decode lookup.
    valid: [1] int64 on the scores' device, how many of the Lq tokens are real (the first ones; the padding after
    them, a question padded to a captured length, counts in no score); None: all of them.
    """
    mean, last = token_mean_and_last(row_scores(log_scores, rows), valid)  # [rows, Lq, C] -> [rows, C] twice
    return torch.maximum(mean, last)


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
    *,
    step: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole centroid lookup of one step: eq. 1 (eq. 3 under `allowed`), reduced per row, against T.

    q: [Hq, Lq, D]; centroids: [Hkv, C, D], or uint8 codes with their step [Hkv, D] (centroid_log_scores);
    counts: [Hkv, C]; rows: Hq or Hkv (see Selection)
    allowed: optional [rows, C] bool, the candidate clusters (hierarchical level 2): only they enter the
             denominator, and the others are neither scored nor kept.
    Returns keep [rows, C] bool (S > T, or every non-empty candidate when T <= 0) and score [rows, C] float32
    (reduce_scores: max of the token mean and the last token of S averaged over the row's query heads; 0 where
    not allowed); valid: the real tokens of Lq (reduce_scores).
    """
    hq = q.shape[0]
    allowed_hq = None if allowed is None else allowed.repeat_interleave(hq // rows, dim=0)
    score = reduce_scores(centroid_log_scores(q, centroids, counts, scale, allowed=allowed_hq, step=step), rows,
                          valid)
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
    *,
    step: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    read: tuple[float, float] | None = None,
    keys: KeyCount | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`cluster_keep` restricted to each row's candidate clusters (a Selection over cluster ids, num_keys = C):
    the hierarchical level 2, whose denominator runs over the candidates only (eq. 3). read: (base, per): also the
    index elements the lookup read per KV head (`read_elements` of the candidates), else None third. keys
    (rows == Hkv): instead of `threshold`, the candidates kept are the best ones holding about that many keys in
    all (`binned_cut` over the candidates, as cluster_select's keys; a KeyCount less the elements read takes
    `read`)."""
    allowed = candidates.to_mask()
    keep, score = cluster_keep(q, centroids, counts, scale, threshold if keys is None else 0.0, rows,
                               allowed=allowed, step=step, valid=valid)
    elements = read_elements(candidates.indptr, centroids.shape[0], *read) if read is not None else None
    if keys is not None:
        keep = _kept_at(keep, score, counts * allowed, KeyCount.of(keys).value(elements, score.device, rows))
    return keep, score, elements


def cluster_select_among(q: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor, scale: float,
                         threshold: float, rows: int, candidates: Selection, starts: torch.Tensor, total: int,
                         tail: int = 0, *, step: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                         read: tuple[float, float] | None = None, keys: KeyCount | float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Selection]:
    """`cluster_keep_among`, its kept clusters then expanded into key positions: keep, score, the elements read and
    `expand_groups(keep, starts, total, tail)` (starts [Hkv, C + 1]: where each cluster's keys lie)."""
    keep, score, elements = cluster_keep_among(q, centroids, counts, scale, threshold, rows, candidates, step=step,
                                               valid=valid, read=read, keys=keys)
    return keep, score, elements, expand_groups(keep, starts, total, tail)


def read_elements(indptr: torch.Tensor, hkv: int, base: float, per: float) -> torch.Tensor:
    """[Hkv] float32: base + per x the candidates of each KV head's rows (indptr [rows + 1], rows a multiple of
    Hkv): what a level-2 lookup reads of each head's index, for candidate lists of `per` elements a centroid."""
    counts = (indptr[1:] - indptr[:-1]).reshape(hkv, -1).sum(dim=1)
    return (base + per * counts.double()).float()


def cut_threshold(score: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor | float) -> torch.Tensor:
    """The score threshold at which a lookup's units with score > it hold as close to `keys` keys as whole units
    allow (best first, over every row: a row that scores higher keeps more): what keeps a turn at the budget it asked
    for, whatever its question, where a calibrated threshold keeps what the calibration's queries would.

    score: [rows, U] float32; sizes: [rows, U] keys of each unit (0: never counted); keys: the keys to keep, a float
    or a [] tensor. Returns [] float32 on score's device: +inf where `keys` <= 0 (nothing), -1 where every unit holds
    fewer (everything). No host synchronisation (a captured step's lookup may run it)."""
    flat = score.reshape(-1).float()
    order = torch.argsort(flat, descending=True)
    held = torch.cumsum(sizes.reshape(-1)[order].double(), 0)  # keys of the best 1, 2, ... units
    want = keys.to(torch.float64).reshape(1) if isinstance(keys, torch.Tensor) else \
        torch.full((1,), float(keys), dtype=torch.float64, device=flat.device)  # (a fill: no copy from the host)
    n = torch.searchsorted(held, want)  # the fewest best units that reach `keys`: units 0 .. n
    over = held[n.clamp(max=held.numel() - 1)] - want
    under = want - torch.where(n > 0, held[(n - 1).clamp(min=0)], torch.zeros_like(want))
    last = torch.where(over > under, n - 1, n)  # the nearer of n - 1 and n units past the cut
    ranked = torch.cat([flat[order], flat.new_full((1,), -1.0)])
    threshold = ranked[(last + 1).clamp(min=0, max=flat.numel())]
    return torch.where(want > 0, threshold, torch.full_like(threshold, float("inf"))).reshape(())


# A lookup cut at a number of keys (cluster_select's keys) decides from a histogram of the scores: CUT_PER bins to a
# power of two from 2^CUT_LOW up to 1 (S <= 1; lower scores in the first bin), a bin 2.2% of a score wide
CUT_LOW, CUT_PER, CUT_BINS = -64.0, 32.0, 2048


def score_bins(score: torch.Tensor) -> torch.Tensor:
    """The cut histogram's bin of each score (float32): floor((log2(score) - CUT_LOW) * CUT_PER) within
    [0, CUT_BINS), 0 for a score of 0. Same shape, int64."""
    score = score.float()
    pos = torch.where(score > 0, (torch.log2(torch.where(score > 0, score, 1.0)) - CUT_LOW) * CUT_PER, 0.0)
    return pos.clamp(0, CUT_BINS - 1).to(torch.int64)


def binned_cut(score: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor | float) -> torch.Tensor:
    """The threshold of a cut at about `keys` keys from the scores' histogram: the lower edge of the bin at which
    the keys of the units in the bins above it come nearest to `keys` (ties: more keys), so that units with
    score > it are kept: whole bins, best first, over every row (cut_threshold cuts between whole units instead).

    score: [rows, U] float32; sizes: [rows, U] keys of each unit (0: never counted); keys: a float or a [] tensor.
    Returns [] float32 on score's device: +inf where keys <= 0, -1 where the nearest is every bin."""
    hist = torch.zeros(CUT_BINS, dtype=torch.float64, device=score.device)
    hist.index_add_(0, score_bins(score).reshape(-1), sizes.reshape(-1).to(torch.float64))
    above = hist.sum() - torch.cumsum(hist, 0) + hist  # keys in the bins >= b
    want = keys.to(torch.float64).reshape(()) if isinstance(keys, torch.Tensor) else \
        torch.tensor(float(keys), dtype=torch.float64, device=score.device)
    gap = (above.float() - want.float()).abs()  # (float32, as the kernel compares)
    bins = torch.arange(CUT_BINS, device=score.device)
    best = torch.where(gap == gap.min(), bins, CUT_BINS).min()
    threshold = torch.where(best == 0, torch.tensor(-1.0, device=score.device),
                            torch.exp2(CUT_LOW + best.float() / CUT_PER))
    return torch.where(want > 0, threshold, torch.tensor(float("inf"), device=score.device)).float()


def _kept_at(keep: torch.Tensor, score: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor | float
             ) -> torch.Tensor:
    """keep [rows, U] narrowed to the units above the binned cut of sizes [Hkv, U] at `keys` (one row per KV head)."""
    if score.shape[0] != sizes.shape[0]:
        raise ValueError("a cut at a number of keys needs one row per KV head")
    return keep & (score > binned_cut(score, sizes, keys))


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
    *,
    fixed: Fixed | None = None,
    step: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    keys: KeyCount | float | None = None,
    sync: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Selection]:
    """`cluster_keep`, then the kept clusters' key positions (`kernels.layout.expand_groups(keep, starts, total,
    tail, fixed=fixed)`: starts [Hkv, C + 1] where each cluster's keys lie; fixed: heads whose rows read a fixed
    list instead). keys (rows == Hkv): instead of `threshold`, the clusters kept are the best ones that hold about
    `keys` keys in all (a float or a KeyCount), whole bins of the scores' histogram at a time (`binned_cut`:
    the kernels decide from the histogram their score pass adds up; the clusters of `fixed` heads do not count).
    sync: the kernels' queues of a one-launch decode lookup (kernels/centroid_ops.py), unused here.
    Returns (keep, score, Selection)."""
    keep, score = cluster_keep(q, centroids, counts, scale, threshold if keys is None else 0.0, rows, step=step,
                               valid=valid)
    if keys is not None:
        counted = torch.ones_like(counts[:, 0], dtype=torch.bool) if fixed is None else ~fixed.on  # [Hkv] (a fixed
        # head's clusters: not counted)
        keep = _kept_at(keep, score, counts * counted[:, None],
                        KeyCount.of(keys).value(device=score.device, heads=counted.sum()))
    return keep, score, expand_groups(keep, starts, total, tail, fixed=fixed)


@dataclass(frozen=True)
class SelectCall:
    """One lookup's cluster_select arguments (same names, order and meaning), for a lookup planned now and run later
    with other sequences' (select_later, select_now)."""

    q: torch.Tensor
    centroids: torch.Tensor
    counts: torch.Tensor
    scale: float
    threshold: float
    rows: int
    starts: torch.Tensor
    total: int
    tail: int = 0
    fixed: Fixed | None = None
    step: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    keys: KeyCount | float | None = None
    sync: torch.Tensor | None = None

    def args(self) -> tuple:
        """cluster_select's positional arguments, in its order."""
        return (self.q, self.centroids, self.counts, self.scale, self.threshold, self.rows, self.starts, self.total,
                self.tail)

    def kwargs(self) -> dict:
        """cluster_select's keyword arguments."""
        return dict(fixed=self.fixed, step=self.step, valid=self.valid, keys=self.keys, sync=self.sync)


# int32 counters of a one-launch decode lookup's queues (kernels/centroid_ops.py, centroid_decode_lookup_kernel's sync)
SYNC_SLOTS = 9


def lookup_sync(device: torch.device) -> torch.Tensor:
    """Counters for the kernels' one-launch decode lookups (kernels/centroid_ops.py), zeroed: [SYNC_SLOTS] int32,
    unused here (the same counters either backend makes, so a layer's serve the kernels whichever made them)."""
    return torch.zeros(SYNC_SLOTS, dtype=torch.int32, device=device)


def select_later(call: SelectCall, pending: list) -> tuple[torch.Tensor, torch.Tensor, Selection]:
    """cluster_select's results for `call`, whose kernels may run later (select_now) together with other lookups'
    planned into the same `pending` list: here computed at once (nothing is appended)."""
    return cluster_select(*call.args(), **call.kwargs())


def select_now(pending: list, keep: list | None = None) -> None:
    """Run the lookups select_later planned into `pending` and empty it: here there are none (keep: the GPU
    kernels', kernels/centroid_ops.py)."""
    pending.clear()
