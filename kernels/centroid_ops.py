"""Typed wrappers of the centroid-lookup kernels (kernels/jit/centroid.py): check, pick block sizes, launch.

The lookups have the semantics of `kernels.reference.centroid`'s and never synchronise with the host: grids
depend only on shapes, the candidate lists' lengths are read on the device.

    cluster_keep       every centroid of the row's KV head (optionally under a dense `allowed` mask)
    cluster_keep_list  only the row's candidates (hierarchical level 2), from a packed CSR list; the work grows with
                       the number of candidates, not with C
    cluster_select     cluster_keep and the expansion of the kept clusters into key positions; select_later plans
                       one (its outputs allocated) and select_now launches those planned, the decode lookups of
                       several sequences of one kind in one launch of each kernel (BATCHED, tables of their tensors
                       and values); given `sync` (lookup_sync), a lone decode lookup runs both passes in one launch

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
from kernels.compact_ops import BLOCK_T as EXPAND_BLOCK_T
from kernels.compact_ops import (
    Expansion,
    batch_tables,
    expand_block_sums,
    expand_groups,
    launch_expansions,
    plan_expansion,
    sum_tiles,
    write_tiles,
)
from kernels.jit.centroid import (
    centroid_cut_kernel,
    centroid_decode_lookup_kernel,
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
    SYNC_SLOTS,
    SelectCall,
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
from kernels.tables import Keep

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
# Partials per step of the score pass's merge of the denominator's splits (kernels/jit/centroid.py
# _log2_denominator) in a lookup of the kind that batches (a dense decode lookup, _Passes.kind): one tile for any split
# count, so that lookups of different splits batch with the sums of their own (a decode lookup's splits: up to 66 at 4
# programs per SM of an H100). Other lookups (a list's, hsqueeze's level 2 of a question) never batch and take their
# own split count's tile: their score pass merges the partials again for every block of centroids, and a question's
# splits are few (2 for a 1K-token one at 128K on an H100), so a 32-wide tile would load 16 times what it uses
SPLIT_TILE = 32
# A dense lookup over at least this many tokens (a long question's prefill) widens one-byte centroid codes to float16
# once, before its passes (wide_codes: two torch kernels over the codes, ~2x their bytes written), so that the
# denominator pass's programs, one per block of query rows, stream float16 tiles rather than each turn every code
# into one again. Results are the same bits either way.
WIDE_CODES_TOKENS = 256
LARGE_DECODE_CENTROIDS = 16384  # decode lookups over at least this many centroids per head take the long-context tiles
# A benchmark's switch (squeeze bench e2e --one-launch): what a decode lookup given `sync` runs in one launch: "off"
# (nothing: the passes and the cut as without it), "passes" (both passes; the cut, where keys are asked, in a launch
# of its own), "cut" (both passes and the cut: one launch before the expansion) or "expand" (the whole lookup:
# both passes, the cut and the expansion; "cut" and "expand" not yet timed in a step)
ONE_LAUNCH = "passes"
ONE_LAUNCH_MODES = ("off", "passes", "cut", "expand")


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
    one_launch_ahead: so does a one-launch decode lookup (centroid_decode_lookup_kernel's AHEAD: each program the
                      first block of one task, which the queue may give another program); off until a step is
                      timed with it (the one launch was measured without).
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
    one_launch_ahead: bool = False

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


def lookup_sync(device: torch.device) -> torch.Tensor:
    """The counters [SYNC_SLOTS] int32 of one-launch decode lookups (cluster_select's `sync`), zeroed: made once,
    outside any CUDA graph capture, by the owner of the lookups that use it, and used by one lookup at a time (the
    kernel leaves it zeroed for the next)."""
    return torch.zeros(SYNC_SLOTS, dtype=torch.int32, device=device)


def _check_sync(sync: torch.Tensor, device: torch.device) -> None:
    if sync.dtype != torch.int32 or tuple(sync.shape) != (SYNC_SLOTS,) or sync.device != device:
        raise ValueError(f"sync must be lookup_sync's [{SYNC_SLOTS}] int32 counters on {device}")


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


@dataclass
class _Passes:
    """One lookup's two passes checked and planned, their buffers allocated (_plan_passes): what _run_passes
    launches. inputs: (q, centroids, counts, allowed, indptr, idx, step) as the kernels read them (dummies where
    unused); keep / score [rows, C] out; starts / block_sums: dense only, or None; elements: (out, base, per) of a
    list whose rows are the KV heads, or None; cut: a _Cut or None, with its pointers and constants (cut_ptrs,
    cut_args) for the score pass."""

    inputs: tuple
    part_max: torch.Tensor
    part_sum: torch.Tensor
    s_cache: torch.Tensor
    staged: torch.Tensor | None  # a dense prefill's queries as the dots read them [Hq * Lq, BLOCK_D] (STAGE_Q)
    valid: torch.Tensor | None
    keep: torch.Tensor
    score: torch.Tensor
    starts: torch.Tensor | None
    block_sums: torch.Tensor | None
    elements: tuple | None
    cut: _Cut | None
    cut_ptrs: tuple
    cut_args: dict
    cfg: LookupConfig
    scale2: float
    threshold: float
    rows: int
    capacity: int
    units: int
    m_blocks: int
    nsplit: int
    score_blocks: int
    score_m: int
    has_allowed: bool
    use_list: bool
    scaled: bool
    zero: bool

    @property
    def q(self) -> torch.Tensor:
        return self.inputs[0]

    @property
    def counts(self) -> torch.Tensor:
        return self.inputs[2]

    @property
    def c(self) -> int:
        return self.inputs[1].shape[1]

    @property
    def strides(self) -> tuple[int, ...]:
        """The strides both passes take: q's two, the centroids' two, the counts', allowed's, the s cache's."""
        q, centroids, counts, allowed = self.inputs[:4]
        return (q.stride(0), q.stride(1), centroids.stride(0), centroids.stride(1), counts.stride(0),
                allowed.stride(0), self.s_cache.stride(0))

    @property
    def dense_decode(self) -> bool:
        """A dense lookup of one token without an allowed mask: the lookups that batch (with starts: kind)."""
        return not self.use_list and not self.has_allowed and self.q.shape[1] == 1

    def kind(self) -> tuple:
        """What lookups launched together share (BATCHED): shapes, dtypes, the launch parameters and the constexprs.
        Only dense decode lookups (one token, no allowed mask, with starts) batch; any other is a kind of its own."""
        q, centroids, counts = self.inputs[:3]
        if not self.dense_decode or self.starts is None:
            return (id(self),)
        cut = self.cut
        return (q.device, q.dtype, centroids.dtype, counts.dtype, tuple(q.shape), centroids.shape[0], self.rows,
                self.cfg, self.scaled, self.valid is not None,
                None if cut is None else (cut.off is not None, cut.keys.listed is not None, cut.keys.per_head))

    def denominator_pointers(self) -> tuple:
        """Row of DENOMINATOR_POINTERS."""
        q, centroids, counts = self.inputs[:3]
        return (q, centroids, counts, self.inputs[6], self.part_max, self.part_sum, self.s_cache, self._valid_arg,
                self._hist)

    def denominator_params(self) -> list[int]:
        """Row of DENOMINATOR_PARAMS."""
        strides = self.strides
        return [self.c, self.nsplit, *strides[:5], strides[6], *_bits(self.scale2)]

    def score_pointers(self) -> tuple:
        """Row of SCORE_POINTERS."""
        return (*self.denominator_pointers(), self.keep, self.score, *self._starts_args, *self.cut_ptrs[1:])

    def score_params(self) -> list[int]:
        """Row of SCORE_PARAMS."""
        a = self.cut_args
        return [*self.denominator_params(), self.score_blocks, self.score_blocks, self.keep.stride(0),
                self.score.stride(0), *_bits(self.threshold), a.get("M", 0), a.get("lo", 0), a.get("hi", 0),
                *_bits(a.get("key_base", 0.0), a.get("key_least", 0.0), a.get("per_listed", 0.0))]

    def cut_pointers(self) -> tuple:
        """Row of CUT_POINTERS."""
        return (self.score, self.counts, self.cut.out, self.keep, *self._starts_args)

    def cut_params(self, block_c: int) -> list[int]:
        """Row of CUT_PARAMS."""
        return [self.c, max(1, triton.cdiv(self.c, block_c)), self.counts.stride(0), self.keep.stride(0),
                self.score.stride(0)]

    @property
    def _valid_arg(self) -> torch.Tensor:
        return self.valid if self.valid is not None else self.counts  # dummy unless HAS_VALID

    @property
    def _hist(self) -> torch.Tensor:
        return self.cut.hist if self.cut is not None else self.counts  # dummy unless ZERO_HIST

    @property
    def _starts_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts, block_sums), dummies unless HAS_STARTS."""
        return (self.starts, self.block_sums) if self.starts is not None else (self.counts, self.counts)


# Row b of a batched launch's tables (kernels/jit/centroid.py reads them by these positions; floats as their
# float32 bits). The score pass's begin with the denominator pass's (kernels/jit/centroid.py _sequence).
DENOMINATOR_POINTERS = ("q", "centroids", "counts", "step", "part_max", "part_sum", "s_cache", "valid", "hist")
DENOMINATOR_PARAMS = ("C", "NSPLIT", "stride_qh", "stride_qt", "stride_ch", "stride_cc", "stride_nh", "stride_s",
                      "scale2")
SCORE_POINTERS = DENOMINATOR_POINTERS + ("keep", "score", "starts", "block_sums", "on", "cut", "listed")
SCORE_PARAMS = DENOMINATOR_PARAMS + ("NPROG", "NB", "stride_kr", "stride_or", "threshold", "M", "lo", "hi",
                                     "key_base", "key_least", "per_listed")
CUT_POINTERS = ("score", "counts", "cut", "keep", "starts", "block_sums")
CUT_PARAMS = ("C", "NB", "stride_nh", "stride_kr", "stride_or")
# The entries whose tiles the kernels load or store, taken as 16-byte aligned under ALIGNED (kernels/tables.py)
DENOMINATOR_TILES = ("q", "centroids", "part_max", "part_sum", "s_cache")
SCORE_TILES = DENOMINATOR_TILES + ("keep", "score")
CUT_TILES = ("score", "keep")
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third axis: a batched denominator pass holds B x its splits there


def wide_codes(codes: torch.Tensor) -> torch.Tensor:
    """One-byte centroid codes [..., D] uint8 as the float16 values 1024 + code the dots read them as (their bits
    0x6400 | code: exact), in a new tensor of the same shape."""
    return codes.to(torch.int16).bitwise_or_(0x6400).view(torch.float16)


def _block_d(d: int) -> int:
    """The head dimension as the kernels tile it (tl.dot needs >= 16, a power of two)."""
    return max(MIN_DOT_DIM, triton.next_power_of_2(d))


def _bits(*values: float) -> list[int]:
    """Floats as the int32 bits of their float32 values (what a launch passes for a Python float)."""
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


def _plan_passes(q, centroids, counts, scale, threshold, rows, allowed, indptr, idx, keep, score, config,
                 starts=None, block_sums=None, step=None, valid=None, zero=False, elements=None,
                 cut=None) -> _Passes | None:
    """Both passes planned. allowed: [rows, C] bool or None; indptr/idx: CSR candidates or None (dense); keep/score:
    the [rows, C] outputs (for lists the score pass writes the candidates' entries only: the others are zeroed by
    the denominator pass with `zero`); starts / block_sums: the clusters' key ranges [Hkv, C + 1] and the kept keys
    per (row, score block) [rows, NB] out (dense only); step: the one-byte centroids' step [Hkv, D] (the kernels
    scale q by it as they load it), or None; valid: [1] int64, the real tokens of Lq (the first ones), or None
    (all). elements (lists whose rows are the KV heads): (out [rows] float32, base, per), out set to base + per x
    each row's candidates by the score pass. cut: a _Cut, or None: the score pass writes the scores, marks in keep
    the clusters it scored, adds each cluster's keys into its score's bin of the histogram, and its last program
    writes the threshold, for centroid_cut_kernel to decide keep (and the block sums) after it. Returns None where
    nothing is to run (lists of no capacity)."""
    hq, lq, d = q.shape
    hkv, c, _ = centroids.shape
    use_list = indptr is not None
    g, hpr = hq // hkv, hq // rows
    gh = hpr if use_list else g  # query heads per unit
    units = hq // gh
    capacity = idx.numel() if use_list else 0
    width = min(c, capacity) if use_list else c  # the most positions one unit can have
    if width == 0:
        return None
    cfg = config or default_config(q.device, lq, d, q.dtype, c, units)

    q, centroids, counts = _row_major(q), _row_major(centroids), _row_major(counts)
    if lq >= WIDE_CODES_TOKENS and not use_list and centroids.dtype == torch.uint8 and q.dtype != torch.float32:
        centroids = wide_codes(centroids)
    m_blocks = triton.cdiv(gh * lq, cfg.block_m)
    c_blocks = triton.cdiv(width, cfg.block_c)
    nsplit = max(1, min(c_blocks, cfg.max_splits, triton.cdiv(cfg.target_programs, units * m_blocks)))
    score_m, score_c = cfg.score_tiles[:2]
    if lq == 1:  # the score pass reads s, no tl.dot: its row tile need only cover the unit's query rows (G in decode)
        score_m = min(score_m, max(2, triton.next_power_of_2(gh * lq)))
    f32 = dict(dtype=torch.float32, device=q.device)
    part_max = torch.empty(hq * lq, nsplit, **f32)
    part_sum = torch.empty(hq * lq, nsplit, **f32)
    s_cache = torch.empty(hq * lq, capacity if use_list else c, **f32) if lq == 1 else part_max  # dummy if unused
    staged = None
    if lq > 1 and not use_list:  # the centroid-major score pass reads them (float16 over one-byte codes)
        codes16 = step is not None and q.dtype != torch.float32
        staged = torch.empty(hq * lq, _block_d(d), dtype=torch.float16 if codes16 else q.dtype, device=q.device)
    allowed_u8 = _row_major(allowed).view(torch.uint8) if allowed is not None else keep.view(torch.uint8)  # dummy
    inputs = (q, centroids, counts, allowed_u8, indptr if use_list else counts, idx if use_list else counts,
              step.contiguous() if step is not None else part_max)  # dummies: never read unless USE_LIST, SCALED
    cut_ptrs, cut_args = cut.score_args(counts, elements is not None and use_list) if cut is not None else \
        ((counts, counts, score, counts), {})
    return _Passes(inputs, part_max, part_sum, s_cache, staged, valid, keep.view(torch.uint8), score, starts,
                   block_sums, elements, cut, cut_ptrs, cut_args, cfg, float(scale) * LOG2E,
                   float(threshold) if threshold > 0 else -1.0,  # S >= 0, so "> -1" keeps every cluster
                   rows, capacity, units, m_blocks, nsplit, triton.cdiv(width, score_c), score_m, allowed is not None,
                   use_list, step is not None, zero)


def _run_passes(calls: list[_Passes], hold: Keep = None) -> None:
    """Both passes of lookups of one kind (_Passes.kind): one as it is, several BATCHED, their tensors and values in
    tables (hold: as kernels.union_ops.union_attention_batch's keep)."""
    p = calls[0]
    batched = len(calls) > 1
    q = p.q
    hq, lq, d = q.shape
    hkv = p.inputs[1].shape[0]
    cfg, use_list, cut = p.cfg, p.use_list, p.cut
    g, hpr = hq // hkv, hq // p.rows
    gh = hpr if use_list else g
    nsplit = max(x.nsplit for x in calls)
    common = dict(
        D=d,
        BLOCK_D=_block_d(d),
        HAS_ALLOWED=p.has_allowed,
        USE_LIST=use_list,
        **_dot_options(q, p.scaled),
        **dependent_launch(q.device),
    )
    batch = batch_tables(calls, _Passes.denominator_pointers, _Passes.denominator_params,
                         (DENOMINATOR_POINTERS, DENOMINATOR_PARAMS), q.device, hold,
                         hinted=lambda x: x.strides[:4], tiles=DENOMINATOR_TILES) if batched else {}
    centroid_denominator_kernel[(p.units, p.m_blocks, nsplit * len(calls))](
        *p.inputs, p.part_max, p.part_sum, p.s_cache, p._valid_arg, p.keep, p.score, p._hist,
        p.scale2, lq, p.c, p.capacity, g, gh, hpr, nsplit, *p.strides, p.keep.stride(0), p.score.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_C=cfg.block_c, STORE_S=lq == 1, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, HAS_VALID=p.valid is not None,
        AHEAD=cfg.read_ahead and not use_list and p.valid is None and not batched,
        ZERO=p.zero and use_list, ZERO_HIST=cut is not None, CUT_BINS=CUT_BINS, CUT_COPIES=CUT_COPIES, **common,
        **batch, qs_ptr=p.staged, STAGE_Q=p.staged is not None,
    )
    score_c, score_warps, score_stages = p.cfg.score_tiles[1:]
    starts, block_sums = p._starts_args
    if not use_list and lq > 1:  # dense prefill: the centroid-major score pass (never batched)
        centroid_score_prefill_kernel[(p.units, p.score_blocks)](
            p.staged, *p.inputs[1:4], p.part_max, p.part_sum, p.keep, p.score, starts, block_sums, p._valid_arg,
            *p.cut_ptrs, p.scale2, p.threshold, lq, p.c, g, hpr, p.nsplit, p.score_blocks, *p.strides[2:6],
            p.keep.stride(0), p.score.stride(0),
            D=d, BLOCK_D=common["BLOCK_D"], BLOCK_M=p.score_m, BLOCK_C=score_c,
            BLOCK_H=max(MIN_DOT_DIM, triton.next_power_of_2(hpr)),
            BLOCK_SPLIT=max(2, triton.next_power_of_2(p.nsplit)), HAS_ALLOWED=p.has_allowed,
            HAS_STARTS=p.starts is not None, DOT_PRECISION=common["DOT_PRECISION"], CODES16=common["CODES16"],
            HAS_VALID=p.valid is not None, num_warps=score_warps,
            num_stages=score_stages, **p.cut_args, **dependent_launch(q.device),
        )
        return
    out_elements, read_base, read_per = p.elements if p.elements is not None else (p.score, 0.0, 0.0)  # dummy
    batch = batch_tables(calls, _Passes.score_pointers, _Passes.score_params, (SCORE_POINTERS, SCORE_PARAMS),
                         q.device, hold,
                         hinted=lambda x: x.strides[:4], tiles=SCORE_TILES) if batched else {}
    centroid_score_kernel[(p.units, max(x.score_blocks for x in calls), len(calls))](
        *p.inputs, p.part_max, p.part_sum, p.s_cache, p.keep, p.score, starts, block_sums, p._valid_arg,
        out_elements, *p.cut_ptrs, p.scale2, p.threshold, lq, p.c, p.capacity, g, gh, hpr, p.nsplit,
        p.score_blocks, p.score_blocks, *p.strides, p.keep.stride(0), p.score.stride(0),
        BLOCK_M=p.score_m, BLOCK_C=score_c, BLOCK_SPLIT=_split_tile(calls), LOAD_S=lq == 1,
        HAS_STARTS=p.starts is not None, HAS_VALID=p.valid is not None, num_warps=score_warps,
        num_stages=score_stages, read_base=float(read_base), read_per=float(read_per),
        HAS_ELEMENTS=p.elements is not None and use_list, **p.cut_args, **common, **batch,
    )


def _split_tile(calls: list[_Passes]) -> int:
    """The score pass's tile of the denominator's partials (BLOCK_SPLIT): SPLIT_TILE for lookups of the kind that
    batches, so that a lookup sums its partials alike alone and in a batch; the calls' split count's power of two
    otherwise."""
    if calls[0].dense_decode:
        return SPLIT_TILE
    return max(2, triton.next_power_of_2(max(x.nsplit for x in calls)))


def _launch(*args, **kwargs) -> _Passes | None:
    """_plan_passes(*args, **kwargs) launched at once: the plan, or None where nothing ran."""
    passes = _plan_passes(*args, **kwargs)
    if passes is not None:
        _run_passes([passes])
    return passes


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
    sync: torch.Tensor | None = None,
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
    instead of their clusters and the tail (written by the expansion: no extra launch); sync: lookup_sync's counters,
    or None: a lookup of one token with a row per KV head then runs both passes in one launch
    (centroid_decode_lookup_kernel: the same results bit for bit), any other as above.
    Returns keep, score (as cluster_keep) and the Selection of `kernels.layout.expand_groups(keep, starts, total,
    tail)`; no host synchronisation.
    """
    pending: list = []
    out = select_later(SelectCall(q, centroids, counts, scale, threshold, rows, starts, total, tail, fixed=fixed,
                                  step=step, valid=valid, keys=keys, sync=sync), pending, config=config)
    select_now(pending)
    return out


@dataclass
class _Select:
    """A cluster_select planned (select_later): its passes (None where there is no centroid), the score pass's
    centroid block (the cut's and the expansion's) and its expansion."""

    passes: _Passes | None
    block_c: int
    expansion: Expansion | None
    sync: torch.Tensor | None = None  # both passes in one launch (only where _one_launch)

    def kind(self) -> tuple:
        """What lookups launched together share: their passes' kind, and their expansions'. A lookup of one launch
        batches with none."""
        if self.passes is None or self.expansion is None or self.sync is not None:
            return (id(self),)
        return (self.passes.kind(), self.block_c, self.expansion.kind())


def select_later(call: SelectCall, pending: list, *, config: LookupConfig | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, Selection]:
    """cluster_select(*call.args(), **call.kwargs(), config=config) checked and planned, every buffer allocated and
    the plan appended to `pending`: its results (keep, score, Selection) at once, their values written when
    select_now(pending) runs. No launch (except a row-major copy of an input that needs one: inputs are read as they
    are here) and no host synchronisation."""
    q, centroids, counts, scale, threshold, rows, starts, total, tail = call.args()
    fixed, step, valid, keys = call.fixed, call.step, call.valid, call.keys
    _check_common(q, centroids, counts, rows, step, valid)
    _check_scalars(scale, threshold)
    hkv, c = counts.shape
    if tuple(starts.shape) != (hkv, c + 1) or starts.dtype != torch.int64 or starts.device != q.device:
        raise ValueError(f"starts must be an int64 [Hkv, C + 1] = [{hkv}, {c + 1}] tensor on {q.device}")
    if keys is not None and rows != hkv:
        raise ValueError("a cut at a number of keys needs one row per KV head")
    cfg = config or default_config(q.device, q.shape[1], q.shape[2], q.dtype, c, hkv)
    score_c = cfg.score_tiles[1]
    keep = torch.empty(rows, c, dtype=torch.bool, device=q.device)
    score = torch.empty(rows, c, dtype=torch.float32, device=q.device)
    nb = max(1, triton.cdiv(c, score_c))
    block_sums = (torch.zeros if c == 0 else torch.empty)(rows, nb, dtype=torch.int64, device=q.device)  # all
    # written (no centroid: no pass)
    starts = starts.contiguous()
    cut = None if keys is None else _Cut.new(keys, q.device, fixed.on.contiguous() if fixed is not None else None)
    passes = _plan_passes(q, centroids, counts, scale, threshold if cut is None else 1.0, rows, None, None, None,
                          keep, score, cfg, starts, block_sums, step, valid, cut=cut)
    selection, expansion = plan_expansion(keep, starts, block_sums, score_c, total, tail, fixed=fixed)
    sync = call.sync
    if sync is not None:
        _check_sync(sync, q.device)
    pending.append(_Select(passes, score_c, expansion, sync if _one_launch(passes) else None))
    return keep, score, selection


def _one_launch(passes: _Passes | None) -> bool:
    """Whether centroid_decode_lookup_kernel takes the lookup: a dense one of one token with a row per KV head, whose
    passes run on as many warps (the one launch's reductions then are the two passes')."""
    return (ONE_LAUNCH != "off" and passes is not None and passes.dense_decode and passes.starts is not None
            and passes.valid is None and passes.rows == passes.units
            and passes.cfg.score_tiles[2] == passes.cfg.num_warps)


def select_now(pending: list, keep: Keep = None) -> None:
    """Launch the lookups select_later planned into `pending`, and empty it: those of one kind (_Select.kind: dense
    decode lookups of the same shapes, dtypes, launch parameters and options, over any number of centroids and
    keys) through one launch of each of their kernels (the denominator pass, the score pass, the cut where keys
    are asked, the expansion), BATCHED, each lookup's tensors and values read from tables; a lone lookup of its kind,
    or one the batched kernels do not take (Lq > 1: a question's prefill), as cluster_select launches it. Kinds in
    the order of their first lookup. keep: where the tables' host copies go, to live as long as a CUDA graph that
    captured their upload (as kernels.union_ops.union_attention_batch's; None: an eager call)."""
    kinds: dict[tuple, list[_Select]] = {}
    for record in pending:
        kinds.setdefault(record.kind(), []).append(record)
    for members in kinds.values():
        splits = max(1, max(r.passes.nsplit if r.passes is not None else 1 for r in members))
        per_launch = MAX_GRID_Z // splits  # (the denominator pass's third grid axis)
        for first in range(0, len(members), per_launch):
            _run_selects(members[first:first + per_launch], keep)
    pending.clear()


def _run_selects(records: list[_Select], hold: Keep) -> None:
    """The launches of cluster_select lookups of one kind: both passes, the cut where keys are asked, the
    expansion."""
    passes = [r.passes for r in records]
    cut_here = expand_here = False
    if passes[0] is not None:
        if records[0].sync is not None:  # a lone lookup (_Select.kind)
            cut_here = ONE_LAUNCH in ("cut", "expand") and passes[0].cut is not None
            expand_here = ONE_LAUNCH == "expand" and records[0].expansion is not None
            _run_one_launch(passes[0], records[0].sync, cut_here, records[0].expansion if expand_here else None)
        else:
            _run_passes(passes, hold)
        if passes[0].cut is not None and not cut_here:
            _cut(passes, records[0].block_c, hold=hold)
    if records[0].expansion is not None and not expand_here:
        launch_expansions([r.expansion for r in records], hold)


def _run_one_launch(p: _Passes, sync: torch.Tensor, cut_here: bool = False, expansion: Expansion | None = None,
                    ) -> None:
    """Both passes of a dense decode lookup with a row per KV head (_one_launch) in one launch of as many programs as
    its denominator pass has (centroid_decode_lookup_kernel); sync: its queues' counters, zero (lookup_sync);
    cut_here: the cut at its keys decided in the same launch (centroid_cut_kernel's work); expansion: the lookup's
    expansion, run in the same launch too (expand_groups_kernel's work; with a cut only where cut_here)."""
    q = p.q
    hq, _, d = q.shape
    cfg = p.cfg
    starts, block_sums = p._starts_args
    centroid_decode_lookup_kernel[(p.units * p.nsplit,)](
        q, *p.inputs[1:3], p.inputs[6], p.part_max, p.part_sum, p.s_cache, p.keep, p.score, starts, block_sums,
        p._hist, *p.cut_ptrs[1:], sync, p.scale2, p.threshold, p.c, hq // p.units, p.nsplit, p.score_blocks, p.units,
        q.stride(0), p.inputs[1].stride(0), p.inputs[1].stride(1), p.counts.stride(0), p.s_cache.stride(0),
        p.keep.stride(0), p.score.stride(0),
        D=d, BLOCK_D=_block_d(d), BLOCK_M=cfg.block_m, BLOCK_C=cfg.block_c, SCORE_M=p.score_m,
        SCORE_C=cfg.score_tiles[1], BLOCK_SPLIT=_split_tile([p]), HAS_STARTS=True, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, AHEAD=cfg.one_launch_ahead, CUT_HERE=cut_here, **p.cut_args,
        **_expansion_args(expansion, p.score_blocks, cfg.score_tiles[1]), SYNC=SYNC_SLOTS, **_dot_options(q, p.scaled),
        **dependent_launch(q.device),
    )


def _expansion_args(e: Expansion | None, nb: int, block_c: int) -> dict:
    """centroid_decode_lookup_kernel's arguments of an expansion in its launch (launch_expansions' of the one), or
    none."""
    if e is None:
        return {}
    if e.nb != nb or e.block_g != block_c:
        raise ValueError(f"the expansion's blocks ({e.nb} of {e.block_g}) must be the score pass's ({nb} of {block_c})")
    lists, on, width = e.fixed_args
    rchunk, block_nb = sum_tiles(e.keep.shape[0], nb)
    return dict(indptr_ptr=e.indptr, out_ptr=e.out, fixed_ptr=lists, fixed_on_ptr=on, W=width, tail=e.tail,
                EXPAND_HERE=True, EXP_BLOCK_K=e.block_k, EXP_SUB=e.sub, EXP_RCHUNK=rchunk, EXP_BLOCK_NB=block_nb,
                EXP_BLOCK_T=EXPAND_BLOCK_T, EXP_FIXED=e.has_fixed)


def _dot_options(q: torch.Tensor, scaled: bool) -> dict:
    """The passes' dot constexprs for queries q over centroids (one-byte codes where scaled)."""
    return dict(DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 must not round through tf32;
                # "tf32" is Triton's default and means nothing for 16-bit inputs
                SCALED=scaled, CODES16=scaled and q.dtype != torch.float32)  # float16 dots over 1024 + code


def _cut(calls: list[_Passes], block_c: int, among: bool = False, hold: Keep = None,
         sums: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """centroid_cut_kernel over each lookup's score [rows, C] at the threshold its score pass wrote (cut.out): keep
    [rows, C] written (among: only where the score pass marked it, a list's candidates), and with starts the kept
    keys per block of block_c centroids into block_sums (sums: (starts, block_sums) of a lone lookup whose passes
    had none, a list's). Lookups of one kind: several BATCHED."""
    p = calls[0]
    rows, counts = p.rows, p.counts
    if sums is not None and len(calls) > 1:
        raise ValueError("a cut given its block sums' tensors is a lone lookup's")
    starts, block_sums = sums if sums is not None else p._starts_args
    batch = batch_tables(calls, _Passes.cut_pointers, lambda x: x.cut_params(block_c), (CUT_POINTERS, CUT_PARAMS),
                         p.q.device, hold, tiles=CUT_TILES) if len(calls) > 1 else {}
    nb = [max(1, triton.cdiv(x.c, block_c)) for x in calls]
    centroid_cut_kernel[(rows, max(nb), len(calls))](
        p.score, counts, p.cut.out, p.keep, starts, block_sums, p.c, nb[0], rows // counts.shape[0],
        counts.stride(0), p.keep.stride(0), p.score.stride(0), BLOCK_C=block_c,
        HAS_STARTS=sums is not None or p.starts is not None,
        AMONG=among, num_warps=4, **dependent_launch(p.q.device), **batch,
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
    cut_sums: tuple[torch.Tensor, torch.Tensor] | None = None,
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
    cut_sums (with keys): (starts [Hkv, C + 1] int64, block_sums [rows, cdiv(C, CUT_BLOCK)] int64 out): the cut
              also sums the kept clusters' keys per block of CUT_BLOCK clusters (the expansion's first step).
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
    if cut_sums is not None and keys is None:
        raise ValueError("cut_sums are the cut's: they need keys")
    ran = _launch(q, centroids, counts, scale, 1.0 if keys is not None else threshold, rows, None,
                  cand_indptr.contiguous(), cand_idx.contiguous(), keep, score, config, step=step, valid=valid,
                  zero=True, elements=out_read if in_kernel else None, cut=cut)
    if ran is None:  # no candidate can be listed: nothing kept, nothing scored
        keep.zero_()
        score.zero_()
        if cut_sums is not None:
            cut_sums[1].zero_()
    elif keys is not None:
        _cut([ran], CUT_BLOCK, among=True, sums=cut_sums)
    if out_read is not None and (not in_kernel or ran is None):
        out_read[0].copy_(read_elements(cand_indptr, hkv, out_read[1], out_read[2]))
    return keep, score


def _output(out, name, shape, dtype, device) -> torch.Tensor:
    """`out` checked, or a new tensor (not zeroed: the kernels write every entry)."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device or out.stride(-1) != 1:
        raise ValueError(f"{name} must be a {dtype} {list(shape)} tensor on {device} with unit last stride")
    return out


__all__ = ["LookupConfig", "SelectCall", "cluster_keep", "cluster_keep_list", "cluster_select", "default_config",
           "select_later", "select_now"]


def cluster_keep_among(q: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor, scale: float, threshold: float,
                       rows: int, candidates: Selection, *, step: torch.Tensor | None = None,
                       valid: torch.Tensor | None = None, read: tuple[float, float] | None = None,
                       keys: torch.Tensor | float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`kernels.reference.centroid.cluster_keep_among` on the GPU: `cluster_keep_list` over the candidates' lists."""
    return _keep_among(q, centroids, counts, scale, threshold, rows, candidates, step, valid, read, keys)


def _keep_among(q, centroids, counts, scale, threshold, rows, candidates, step, valid, read, keys, cut_sums=None):
    """cluster_keep_among's work (its arguments), the cut also summing the kept keys per block with cut_sums
    (cluster_keep_list's)."""
    elements = torch.empty(centroids.shape[0], dtype=torch.float32, device=q.device) if read is not None else None
    keep, score = cluster_keep_list(q, centroids, counts, scale, threshold, rows, candidates.indptr,
                                    candidates.indices, step=step, valid=valid,
                                    out_read=(elements, *read) if read is not None else None, keys=keys,
                                    cut_sums=cut_sums)
    return keep, score, elements


def cluster_select_among(q: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor, scale: float,
                         threshold: float, rows: int, candidates: Selection, starts: torch.Tensor, total: int,
                         tail: int = 0, *, step: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                         read: tuple[float, float] | None = None, keys: KeyCount | float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Selection]:
    """`kernels.reference.centroid.cluster_select_among` on the GPU: `cluster_keep_among`, then the expansion. With
    keys, the cut's launch also sums the kept keys per block of CUT_BLOCK clusters, which the expansion reads: no
    block sums launch of its own (where the expansion's tiles take CUT_BLOCK clusters a program)."""
    c = centroids.shape[1]
    block_g, sub, block_k = write_tiles(total, c)
    sums = None
    if keys is not None and block_g == CUT_BLOCK:  # (a cut needs a row per KV head: cluster_keep_list says so)
        sums = (starts.contiguous(), torch.empty(rows, triton.cdiv(c, CUT_BLOCK), dtype=torch.int64, device=q.device))
    keep, score, elements = _keep_among(q, centroids, counts, scale, threshold, rows, candidates, step, valid, read,
                                        keys, sums)
    if sums is None:
        return keep, score, elements, expand_groups(keep, starts, total, tail)
    return keep, score, elements, expand_block_sums(keep, sums[0], sums[1], CUT_BLOCK, total, tail, sub=sub,
                                                    block_k=block_k)
