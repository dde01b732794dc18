"""Typed wrappers of the centroid-lookup kernels (kernels/jit/centroid.py): check, pick block sizes, launch.

Both functions have the semantics of `kernels.reference.centroid.cluster_keep` and never synchronise with the host: grids
depend only on shapes, the candidate lists' lengths are read on the device.

    cluster_keep       every centroid of the row's KV head (optionally under a dense `allowed` mask)
    cluster_keep_list  only the row's candidates (hierarchical level 2), from a packed CSR list; the work grows with
                       the number of candidates, not with C

Passes (see the kernels' docstrings):
    1. denominator, grid (unit, query-row block, split): partial (max, sum) of N_j exp(s_j) per (head, token), in
       base 2; the centroids are split over `split` programs so that one decode token still fills the GPU. Decode
       (Lq == 1) also stores s2 = log2(e) * scale * q . C in a float32 cache [Hq, W] so that pass 2 never reads the
       centroids again.
    2. score, grid (unit, centroid block): log D from the partials, S = exp(s - log D) summed per row over heads and
       tokens, max(mean, last token), compared with T; deterministic (no atomics). A dense lookup over Lq > 1 tokens
       (the question's prefill) runs the centroid-major form (centroid_score_prefill_kernel): each program holds its
       centroids and streams the query rows past them on the tensor cores.
A unit is a KV head with its G query heads stacked as rows (dense), or one row of the selection (lists).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import triton

from kernels.checks import LOG2E, check_valid
from kernels.compact_ops import expand_block_sums
from kernels.jit.centroid import (
    centroid_cut_kernel,
    centroid_denominator_kernel,
    centroid_score_kernel,
    centroid_score_prefill_kernel,
)
from kernels.launch import dependent_launch

# no kernels of their own (the calibration and the explanations use them): the backend's op names, from the reference
from kernels.reference.centroid import (  # noqa: F401
    CUT_BINS,
    CUT_LOW,
    CUT_PER,
    binned_cut,
    centroid_log_scores,
    cut_threshold,
    dequantize_centroids,
    quantize_centroids,
    read_elements,
    reduce_scores,
    row_scores,
    scaled_queries,
    score_bins,
    select_clusters,
)
from kernels.selection import Fixed, KeyCount, Selection

# The cut's histogram in CUT_COPIES copies, the score pass's programs spread over them round robin: the bins around
# the scores' mode take an atomic from every program, and one copy queues them (`python -m engine.bench.lookup`, H100,
# 128K: the cut's lookup 26.9 us a layer with one copy of 4,096 bins, 21.0 with four of 2,048; engine/bench/README.md)
CUT_COPIES = 4
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MIN_DOT_DIM = 16  # tl.dot needs every block dimension >= 16
PROGRAMS_PER_SM = 4  # the denominator pass splits the centroids until it has about this many programs per SM
CPU_PROGRAMS = 4  # the same target in Triton's interpreter (programs run one after the other there)
CUT_BLOCK = 256  # centroids per program of a list's cut (no block sums to match the score pass's tiles)
LARGE_DECODE_CENTROIDS = 16384  # decode lookups over at least this many centroids per head take the long-context tiles


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class LookupConfig:
    """Launch parameters of one lookup; every field is a knob to tune on the GPU.

    block_m: query rows (heads x tokens) per tile of the dot products; padded rows are masked.
    block_c: centroids per tile; also the work unit of the score pass (one program per block).
    target_programs: programs the denominator pass aims for; it splits the centroid blocks of a unit over up to
                     max_splits programs to reach it (1 split when the query-row blocks already fill the GPU).
    score_block_m / score_block_c / score_warps / score_stages: the score pass's tiles, warps and pipeline stages
                     (0: those of the denominator pass). In prefill the score pass loops over every query row for
                     its centroids, so it wants wide centroid blocks, the denominator pass tall query blocks; in
                     decode its query loop runs once, and buffers for a pipeline only cost occupancy.
    read_ahead: a dense lookup's denominator pass reads its first block of centroids before it waits (PDL) for the
                kernel that wrote the queries.
    """

    block_m: int = 64
    block_c: int = 64
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 528
    max_splits: int = 128
    score_block_m: int = 0
    score_block_c: int = 0
    score_warps: int = 0
    score_stages: int = 0
    read_ahead: bool = True

    @property
    def score_tiles(self) -> tuple[int, int, int, int]:
        """(block_m, block_c, num_warps, num_stages) of the score pass."""
        return (self.score_block_m or self.block_m, self.score_block_c or self.block_c,
                self.score_warps or self.num_warps, self.score_stages or self.num_stages)

    def __post_init__(self):
        for name in ("block_m", "block_c", "score_block_m", "score_block_c"):
            value = getattr(self, name)
            if name.startswith("score") and value == 0:
                continue
            if not _is_pow2(value) or value < MIN_DOT_DIM:
                raise ValueError(f"{name} must be a power of two >= {MIN_DOT_DIM}, got {value}")
        if not _is_pow2(self.num_warps) or (self.score_warps and not _is_pow2(self.score_warps)):
            raise ValueError(f"num_warps and score_warps must be powers of two, got {self.num_warps}, "
                             f"{self.score_warps}")
        if self.num_stages < 1 or self.target_programs < 1 or self.max_splits < 1 or self.score_stages < 0:
            raise ValueError("num_stages, target_programs and max_splits must be >= 1 (score_stages >= 0)")


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:  # a host-side property query, not a synchronisation
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def default_config(device: torch.device, lq: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                   num_centroids: int = 0, units: int = 1) -> LookupConfig:
    """Launch parameters: bfloat16 / float16 at head_dim <= 128 tuned on an H200 (engine/bench/tune.py, figures
    below); the rest chosen from ptxas register counts for sm_90, not from timings.

    Decode has at most G (<= 8) query rows per unit: the smallest row block; num_centroids (per head) picks the
    long-context tiles. Prefill: the score pass's centroid blocks are as wide as the GPU allows while its
    units x blocks programs still cover every SM. At D = 256: 64 x 32 tiles on 8 warps (~100-200 registers per
    thread, no spills).
    float32 runs its dots in IEEE mode on the FMA units: 32-wide tiles on 8 warps, or ptxas spills.
    """
    if device.type != "cuda":
        return LookupConfig(block_m=32, block_c=16, num_warps=1, num_stages=1, target_programs=CPU_PROGRAMS)
    target = PROGRAMS_PER_SM * _sm_count(device)
    if dtype == torch.float32:
        block_m = 16 if lq == 1 else 32
        return LookupConfig(block_m=block_m, block_c=32, num_warps=8, num_stages=2, target_programs=target)
    if lq == 1 and head_dim <= 128 and num_centroids >= LARGE_DECODE_CENTROIDS:
        # cluster_select tuned on an H200 at 512K tokens (26K centroids), 32/8 heads (engine/bench/tune.py): 57.2 us
        # with 64-wide centroid blocks over 3 stages and 256-wide score blocks, 66.7 us with the 128K setting below
        return LookupConfig(block_m=16, block_c=64, num_warps=4, num_stages=3, target_programs=target,
                            score_block_c=256, score_stages=1)
    if lq == 1:  # cluster_select tuned as above at 128K tokens (6.5K centroids): 15.8 us (17.4 us with 256-wide
        # score blocks, 17.8 us with 3 stages)
        return LookupConfig(block_m=16, block_c=256 if head_dim <= 128 else 128, num_warps=4, num_stages=2,
                            target_programs=target, score_block_c=128, score_stages=1)
    # Prefill: the score pass (centroid_score_prefill_kernel) holds score_block_c centroids per program and streams
    # the question's query rows past them, score_block_m at a time; units x centroid blocks programs must fill the GPU.
    if head_dim > 128:
        score_c = 64 if units * triton.cdiv(num_centroids, 64) >= _sm_count(device) else 32
        return LookupConfig(block_m=64, block_c=32, num_warps=8, num_stages=2, target_programs=target,
                            score_block_m=32, score_block_c=score_c, score_warps=8, score_stages=2)
    # H200, 128K tokens (6.5K centroids), 32/8 heads, 1024 tokens (engine/bench/tune.py), whole lookup:
    # score pass 128 centroids x 128 query rows on 4 warps, 2 stages 0.48 ms, 128 x 64 0.53, 64 x 32 0.54;
    # denominator pass 64 query rows x 128 centroids, 3 stages 0.48 ms, 128 x 64 0.53.
    score_c = 128 if units * triton.cdiv(num_centroids, 128) >= _sm_count(device) else 64
    return LookupConfig(block_m=64, block_c=128, num_warps=4, num_stages=3, target_programs=target,
                        score_block_m=128, score_block_c=score_c, score_warps=4, score_stages=2)

def _check_common(q, centroids, counts, rows, step=None, valid=None):
    if q.dim() != 3 or centroids.dim() != 3:
        raise ValueError(
            f"q must be [Hq, Lq, D] and centroids [Hkv, C, D]; got {tuple(q.shape)}, {tuple(centroids.shape)}"
        )
    hq, lq, d = q.shape
    hkv, c, dc = centroids.shape
    if dc != d:
        raise ValueError(f"head_dim mismatch: q has {d}, centroids {dc}")
    if q.dtype not in FLOAT_DTYPES or centroids.dtype not in (q.dtype, torch.uint8):
        raise TypeError(f"q must be float16/bfloat16/float32 and centroids of its dtype or uint8 codes (read as their "
                        f"values: kernels.reference.centroid.quantize_centroids): {q.dtype}, {centroids.dtype}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if rows not in (hq, hkv):
        raise ValueError(f"rows must be Hq={hq} or Hkv={hkv}, got {rows}")
    if lq == 0:
        raise ValueError("the lookup needs at least one query token")
    if tuple(counts.shape) != (hkv, c) or counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError(f"counts must be an integer [Hkv, C] = [{hkv}, {c}] tensor: {counts.dtype} {counts.shape}")
    for name, t in (("centroids", centroids), ("counts", counts)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    check_valid(valid, q.device)
    if step is not None and (centroids.dtype != torch.uint8 or tuple(step.shape) != (hkv, d)
                             or step.dtype != torch.float32 or step.device != q.device):
        raise ValueError(f"step goes with uint8 centroids and must be a float32 [Hkv, D] = [{hkv}, {d}] tensor on "
                         f"{q.device}")


def _check_scalars(scale, threshold):
    """Python numbers only: reading a GPU tensor's value would synchronise with the host."""
    for name, value in (("scale", scale), ("threshold", threshold)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension with stride 1."""
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass(frozen=True)
class _Cut:
    """A lookup cut at a number of keys: hist [CUT_COPIES * CUT_BINS + 1] int32 (the score pass's histograms and
    ticket, zeroed by the denominator pass), out [1] float32 (the threshold its last program writes), the keys asked,
    and off: [Hkv] bool KV heads whose clusters stay out of the histogram (their rows read fixed lists), or None."""

    hist: torch.Tensor
    out: torch.Tensor
    keys: KeyCount
    off: torch.Tensor | None = None

    @staticmethod
    def new(keys: KeyCount | float, device: torch.device, off: torch.Tensor | None = None) -> "_Cut":
        keys = KeyCount.of(keys)
        if keys.listed is not None and (keys.listed.device != device or keys.listed.dtype != torch.int64
                                        or keys.listed.dim() != 1):
            raise ValueError(f"the keys' listed positions must be a 1-D int64 tensor on {device}")
        return _Cut(torch.empty(CUT_COPIES * CUT_BINS + 1, dtype=torch.int32, device=device),
                    torch.empty(1, dtype=torch.float32, device=device), keys, off)

    def score_args(self, dummy: torch.Tensor, read: bool) -> tuple[tuple, dict]:
        """The score passes' pointers (hist, on, cut, listed) and their constants; read: the pass writes the
        elements its units read (the keys less per_read of them)."""
        keys, listed = self.keys, self.keys.listed
        if keys.per_read and not read:
            raise ValueError("a count less the elements read needs a candidate-list lookup that reports them "
                             "(out_read, one row per KV head)")
        pointers = (self.hist, self.off.view(torch.uint8) if self.off is not None else dummy, self.out,
                    listed.contiguous() if listed is not None else dummy)
        constants = dict(HAS_HIST=True, HIST_FIXED=self.off is not None, CUT_LOW=CUT_LOW, CUT_PER=CUT_PER,
                         CUT_BINS=CUT_BINS, CUT_COPIES=CUT_COPIES, HAS_LISTED=listed is not None,
                         M=listed.numel() if listed is not None else 0, lo=int(keys.lo), hi=int(keys.hi),
                         key_base=float(keys.base), key_least=float(keys.least), per_listed=float(keys.per_listed),
                         PER_HEAD=keys.per_head)
        if read:
            constants.update(per_read=float(keys.per_read), READ_KEYS=bool(keys.per_read))
        return pointers, constants


def _launch(q, centroids, counts, scale, threshold, rows, allowed, indptr, idx, keep, score, config,
            starts=None, block_sums=None, step=None, valid=None, zero=False, elements=None, cut=None):
    """Both passes. allowed: [rows, C] bool or None; indptr/idx: CSR candidates or None (dense); keep/score: the
    [rows, C] outputs (for lists the score pass writes the candidates' entries only: the others are zeroed by the
    denominator pass with `zero`); starts / block_sums: the
    clusters' key ranges [Hkv, C + 1] and the kept keys per (row, score block) [rows, NB] out (dense only); step:
    the one-byte centroids' step [Hkv, D] (the kernels scale q by it as they load it), or None; valid: [1] int64, the
    real tokens of Lq (the first ones), or None (all). elements (lists whose rows are the KV heads): (out [rows]
    float32, base, per), out set to base + per x each row's candidates by the score pass. cut: a _Cut, or None:
    the score pass writes the scores, marks in keep the clusters it scored, adds each cluster's keys into its
    score's bin of the histogram, and its last program writes the threshold, for centroid_cut_kernel to decide keep
    (and the block sums) after it. Returns whether the
    passes ran (not for lists of no capacity)."""
    hq, lq, d = q.shape
    hkv, c, _ = centroids.shape
    use_list = indptr is not None
    g, hpr = hq // hkv, hq // rows
    gh = hpr if use_list else g  # query heads per unit
    units = hq // gh
    capacity = idx.numel() if use_list else 0
    width = min(c, capacity) if use_list else c  # the most positions one unit can have
    if width == 0:
        return False
    cfg = config or default_config(q.device, lq, d, q.dtype, c, units)

    q, centroids, counts = _row_major(q), _row_major(centroids), _row_major(counts)
    m_blocks = triton.cdiv(gh * lq, cfg.block_m)
    c_blocks = triton.cdiv(width, cfg.block_c)
    nsplit = max(1, min(c_blocks, cfg.max_splits, triton.cdiv(cfg.target_programs, units * m_blocks)))
    score_m, score_c, score_warps, score_stages = cfg.score_tiles
    if lq == 1:  # the score pass reads s, no tl.dot: its row tile need only cover the unit's query rows (G in decode)
        score_m = min(score_m, max(2, triton.next_power_of_2(gh * lq)))
    score_blocks = triton.cdiv(width, score_c)
    cache_s = lq == 1
    f32 = dict(dtype=torch.float32, device=q.device)
    part_max = torch.empty(hq * lq, nsplit, **f32)
    part_sum = torch.empty(hq * lq, nsplit, **f32)
    s_cache = torch.empty(hq * lq, capacity if use_list else c, **f32) if cache_s else part_max  # dummy if unused
    allowed_u8 = _row_major(allowed).view(torch.uint8) if allowed is not None else keep.view(torch.uint8)  # dummy
    indptr = indptr if use_list else counts  # dummies: never read unless USE_LIST
    idx = idx if use_list else counts
    step_arg = step.contiguous() if step is not None else part_max  # dummy unless SCALED
    valid_arg = valid if valid is not None else counts  # dummy unless HAS_VALID

    common = dict(
        D=d,
        BLOCK_D=max(MIN_DOT_DIM, triton.next_power_of_2(d)),
        HAS_ALLOWED=allowed is not None,
        USE_LIST=use_list,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 must not round through tf32;
        # "tf32" is Triton's default and means nothing for 16-bit inputs
        SCALED=step is not None,
        CODES16=step is not None and q.dtype != torch.float32,  # float16 dots over 1024 + code (no conversion)
        **dependent_launch(q.device),
    )
    strides = (
        q.stride(0), q.stride(1), centroids.stride(0), centroids.stride(1), counts.stride(0),
        allowed_u8.stride(0), s_cache.stride(0),
    )
    inputs = (q, centroids, counts, allowed_u8, indptr, idx, step_arg)
    centroid_denominator_kernel[(units, m_blocks, nsplit)](
        *inputs, part_max, part_sum, s_cache, valid_arg, keep.view(torch.uint8), score,
        cut.hist if cut is not None else counts,
        float(scale) * LOG2E, lq, c, capacity, g, gh, hpr, nsplit, *strides, keep.stride(0), score.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_C=cfg.block_c, STORE_S=cache_s, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, HAS_VALID=valid is not None, AHEAD=cfg.read_ahead and not use_list and valid is None,
        ZERO=zero and use_list, ZERO_HIST=cut is not None,
        CUT_BINS=CUT_BINS, CUT_COPIES=CUT_COPIES, **common,
    )
    out_elements, read_base, read_per = elements if elements is not None else (score, 0.0, 0.0)  # dummy unless given
    cut_ptrs, cut_args = cut.score_args(counts, elements is not None and use_list) if cut is not None else \
        ((counts, counts, score, counts), {})
    keep_threshold = float(threshold) if threshold > 0 else -1.0  # S >= 0, so "> -1" keeps every cluster
    has_starts = starts is not None
    if not use_list and lq > 1:  # dense prefill: the centroid-major score pass
        centroid_score_prefill_kernel[(units, score_blocks)](
            q, centroids, counts, allowed_u8, step_arg, part_max, part_sum, keep.view(torch.uint8), score,
            starts if has_starts else counts, block_sums if has_starts else counts,  # dummies unless HAS_STARTS
            valid_arg, *cut_ptrs, float(scale) * LOG2E, keep_threshold, lq, c, g, hpr, nsplit, score_blocks,
            q.stride(0), q.stride(1), centroids.stride(0), centroids.stride(1), counts.stride(0),
            allowed_u8.stride(0), keep.stride(0), score.stride(0),
            D=d, BLOCK_D=common["BLOCK_D"], BLOCK_M=score_m, BLOCK_C=score_c,
            BLOCK_H=max(MIN_DOT_DIM, triton.next_power_of_2(hpr)), BLOCK_SPLIT=max(2, triton.next_power_of_2(nsplit)),
            HAS_ALLOWED=allowed is not None, HAS_STARTS=has_starts, DOT_PRECISION=common["DOT_PRECISION"],
            SCALED=common["SCALED"], CODES16=common["CODES16"], HAS_VALID=valid is not None, num_warps=score_warps,
            num_stages=score_stages, **cut_args, **dependent_launch(q.device),
        )
        return True
    centroid_score_kernel[(units, score_blocks)](
        *inputs, part_max, part_sum, s_cache, keep.view(torch.uint8), score,
        starts if has_starts else counts, block_sums if has_starts else counts,  # dummies unless HAS_STARTS
        valid_arg, out_elements, *cut_ptrs, float(scale) * LOG2E, keep_threshold, lq, c, capacity, g, gh, hpr, nsplit,
        score_blocks, score_blocks, *strides, keep.stride(0), score.stride(0),
        BLOCK_M=score_m, BLOCK_C=score_c, BLOCK_SPLIT=max(2, triton.next_power_of_2(nsplit)), LOAD_S=cache_s,
        HAS_STARTS=has_starts, HAS_VALID=valid is not None, num_warps=score_warps, num_stages=score_stages,
        read_base=float(read_base), read_per=float(read_per), HAS_ELEMENTS=elements is not None and use_list,
        **cut_args, **common,
    )
    return True


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
    config: LookupConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The centroid lookup of one step over every centroid: `kernels.reference.centroid.cluster_keep` on the GPU.

    q: [Hq, Lq, D] float16/bfloat16/float32; centroids: [Hkv, C, D] same dtype, or uint8 codes (read as their
       values) with step: their step [Hkv, D] float32 (q is scaled by it as it is loaded:
       kernels.reference.centroid.quantize_centroids); counts: [Hkv, C] int (0 = empty)
    rows: Hq or Hkv; row r reads KV head r * Hkv // rows and averages S over its Hq // rows query heads
    allowed: optional [rows, C] bool; only allowed clusters enter the denominator, are scored and kept
    valid: optional [1] int64 on q's device: only the first valid[0] of the Lq tokens count (a padded question)
    config: launch parameters (default: default_config)
    Returns keep [rows, C] bool (score > T, or every cluster when T <= 0; and count > 0 and allowed) and
    score [rows, C] float32: max(mean over tokens, last token) of S averaged over the row's heads, 0 where not
    allowed; +inf where a row's denominator is empty (every allowed cluster empty), as in the reference.
    """
    _check_common(q, centroids, counts, rows, step, valid)
    _check_scalars(scale, threshold)
    c = centroids.shape[1]
    if allowed is not None:
        if tuple(allowed.shape) != (rows, c) or allowed.dtype != torch.bool or allowed.device != q.device:
            raise ValueError(f"allowed must be a bool [rows, C] = [{rows}, {c}] tensor on {q.device}")
    keep = torch.empty(rows, c, dtype=torch.bool, device=q.device)
    score = torch.empty(rows, c, dtype=torch.float32, device=q.device)
    _launch(q, centroids, counts, scale, threshold, rows, allowed, None, None, keep, score, config, step=step,
            valid=valid)
    return keep, score


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
    config: LookupConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Selection]:
    """The lookup and the expansion of its kept clusters into key positions, in three launches: the denominator
    pass, the score pass (which also sums the kept keys per block of centroids), the expansion. keys (rows == Hkv):
    instead of `threshold`, a cut at about that many keys in all (a float, or a KeyCount worked out on the device by
    the score pass: no host synchronisation), in one more launch: the score pass adds each cluster's keys into a
    histogram of the scores (CUT_BINS bins of 1 / CUT_PER of a power of two from 2^CUT_LOW; zeroed by the
    denominator pass) and its last program takes the bin edge whose keys above come nearest; the cut
    (centroid_cut_kernel) keeps the clusters above it: the reference's `binned_cut`; the clusters of `fixed` heads
    stay out of the histogram.

    q, centroids, counts, scale, threshold, rows, step, valid: as cluster_keep; starts: [Hkv, C + 1] int64, cluster c of
    head h holds positions [starts[h, c], starts[h, c + 1]); total: starts[h, C] (the same for every head); tail: dense
    positions total .. total + tail - 1 that every row keeps; fixed: the rows of the heads it marks read its lists
    instead of their clusters and the tail (written by the expansion: no extra launch).
    Returns keep, score (as cluster_keep) and the Selection of `kernels.layout.expand_groups(keep, starts, total,
    tail)`; no host synchronisation.
    """
    _check_common(q, centroids, counts, rows, step, valid)
    _check_scalars(scale, threshold)
    hkv, c = counts.shape
    if tuple(starts.shape) != (hkv, c + 1) or starts.dtype != torch.int64 or starts.device != q.device:
        raise ValueError(f"starts must be an int64 [Hkv, C + 1] = [{hkv}, {c + 1}] tensor on {q.device}")
    cfg = config or default_config(q.device, q.shape[1], q.shape[2], q.dtype, c, hkv)
    score_c = cfg.score_tiles[1]
    keep = torch.empty(rows, c, dtype=torch.bool, device=q.device)
    score = torch.empty(rows, c, dtype=torch.float32, device=q.device)
    nb = max(1, triton.cdiv(c, score_c))
    block_sums = torch.empty(rows, nb, dtype=torch.int64, device=q.device)  # all written
    starts = starts.contiguous()
    if keys is None:
        _launch(q, centroids, counts, scale, threshold, rows, None, None, None, keep, score, cfg, starts, block_sums,
                step, valid)
    else:
        if rows != hkv:
            raise ValueError("a cut at a number of keys needs one row per KV head")
        cut = _Cut.new(keys, q.device, fixed.on.contiguous() if fixed is not None else None)
        _launch(q, centroids, counts, scale, 1.0, rows, None, None, None, keep, score, cfg, starts, block_sums,
                step, valid, cut=cut)
        _cut(score, counts, cut, keep, score_c, starts, block_sums)
    return keep, score, expand_block_sums(keep, starts, block_sums, score_c, total, tail, fixed=fixed)


def _cut(score: torch.Tensor, counts: torch.Tensor, cut: _Cut, keep: torch.Tensor, block_c: int,
         starts: torch.Tensor | None = None, block_sums: torch.Tensor | None = None, among: bool = False) -> None:
    """centroid_cut_kernel over score [rows, C] at the threshold the score pass wrote (cut.out): keep [rows, C]
    written (among: only where the score pass marked it, a list's candidates), and with starts the kept keys per
    block of block_c centroids into block_sums."""
    rows, c = score.shape
    counts = _row_major(counts)
    nb = max(1, triton.cdiv(c, block_c))
    has_starts = starts is not None
    centroid_cut_kernel[(rows, nb)](
        score, counts, cut.out, keep.view(torch.uint8), starts if has_starts else counts,
        block_sums if has_starts else counts, c, nb, rows // counts.shape[0], counts.stride(0), keep.stride(0),
        score.stride(0), BLOCK_C=block_c, HAS_STARTS=has_starts, AMONG=among, num_warps=4,
        **dependent_launch(score.device),
    )


def cluster_keep_list(
    q: torch.Tensor,
    centroids: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    threshold: float,
    rows: int,
    cand_indptr: torch.Tensor,
    cand_idx: torch.Tensor,
    out_keep: torch.Tensor | None = None,
    out_score: torch.Tensor | None = None,
    *,
    step: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    out_read: tuple[torch.Tensor, float, float] | None = None,
    keys: KeyCount | float | None = None,
    config: LookupConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The level-2 lookup over each row's candidate clusters only: `reference.cluster_keep(..., allowed=A)` with
    A[r, c] = (c is among row r's candidates), at a cost that grows with the number of candidates.

    cand_indptr: [rows + 1] int32/int64 on the device, CSR offsets (cand_indptr[0] == 0, non-decreasing)
    cand_idx: [capacity] int32/int64 centroid ids, sorted and distinct within a row; entries at positions
              >= cand_indptr[-1] are ignored, and so are ids outside [0, C)
    out_keep / out_score: optional [rows, C] bool / float32 outputs to reuse; they are zeroed by the denominator
              pass (no launch of their own)
    step, valid: as cluster_keep
    out_read: (out [Hkv] float32, base, per): out set to the index elements the lookup read per KV head, base + per x
              the candidates of the head's rows (reference.read_elements), by the score pass where rows == Hkv
    keys (rows == Hkv): instead of `threshold`, the candidates kept are the best ones holding about that many keys
              in all: the score pass's histogram and centroid_cut_kernel, as cluster_select's keys (a KeyCount
              less per_read of the elements read takes out_read).
    Returns keep [rows, C] bool and score [rows, C] float32 as cluster_keep (0 / False off the candidates).
    No host synchronisation: the grid depends on (Hq, Lq, C, capacity) only.
    """
    _check_common(q, centroids, counts, rows, step, valid)
    _check_scalars(scale, threshold)
    c, hkv = centroids.shape[1], centroids.shape[0]
    if cand_indptr.shape != (rows + 1,) or cand_idx.dim() != 1:
        raise ValueError(f"cand_indptr must be [rows + 1] = [{rows + 1}] and cand_idx 1-D; got "
                         f"{tuple(cand_indptr.shape)}, {tuple(cand_idx.shape)}")
    for name, t in (("cand_indptr", cand_indptr), ("cand_idx", cand_idx)):
        if t.dtype not in INDEX_DTYPES or t.device != q.device:
            raise TypeError(f"{name} must be int32/int64 on {q.device}; got {t.dtype} on {t.device}")
    if out_read is not None and (tuple(out_read[0].shape) != (hkv,) or out_read[0].dtype != torch.float32
                                 or out_read[0].device != q.device):
        raise ValueError(f"out_read's tensor must be float32 [{hkv}] on {q.device}")
    keep = _output(out_keep, "out_keep", (rows, c), torch.bool, q.device)
    score = _output(out_score, "out_score", (rows, c), torch.float32, q.device)
    in_kernel = out_read is not None and rows == hkv
    if keys is not None and rows != hkv:
        raise ValueError("a cut at a number of keys needs one row per KV head")
    cut = _Cut.new(keys, q.device) if keys is not None else None
    ran = _launch(q, centroids, counts, scale, 1.0 if keys is not None else threshold, rows, None,
                  cand_indptr.contiguous(), cand_idx.contiguous(), keep, score, config, step=step, valid=valid,
                  zero=True, elements=out_read if in_kernel else None, cut=cut)
    if not ran:  # no candidate can be listed: nothing kept, nothing scored
        keep.zero_()
        score.zero_()
    elif keys is not None:
        _cut(score, counts, cut, keep, CUT_BLOCK, among=True)
    if out_read is not None and (not in_kernel or not ran):
        out_read[0].copy_(read_elements(cand_indptr, hkv, out_read[1], out_read[2]))
    return keep, score


def _output(out, name, shape, dtype, device) -> torch.Tensor:
    """`out` checked, or a new tensor (not zeroed: the kernels write every entry)."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device or out.stride(-1) != 1:
        raise ValueError(f"{name} must be a {dtype} {list(shape)} tensor on {device} with unit last stride")
    return out


__all__ = ["LookupConfig", "cluster_keep", "cluster_keep_list", "cluster_select", "default_config"]


def cluster_keep_among(q: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor, scale: float, threshold: float,
                       rows: int, candidates: Selection, *, step: torch.Tensor | None = None,
                       valid: torch.Tensor | None = None, read: tuple[float, float] | None = None,
                       keys: torch.Tensor | float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`kernels.reference.centroid.cluster_keep_among` on the GPU: `cluster_keep_list` over the candidates' lists."""
    elements = torch.empty(centroids.shape[0], dtype=torch.float32, device=q.device) if read is not None else None
    keep, score = cluster_keep_list(q, centroids, counts, scale, threshold, rows, candidates.indptr,
                                    candidates.indices, step=step, valid=valid,
                                    out_read=(elements, *read) if read is not None else None, keys=keys)
    return keep, score, elements
