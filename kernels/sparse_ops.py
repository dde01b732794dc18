"""Typed wrappers of the sparse-attention Triton kernels (kernels/jit/sparse.py): check, plan, launch.

`sparse_attention(q, k, v, selection, scale)` has the signature and semantics of `kernels.reference.sparse.sparse_attention`
and never synchronises with the host: the keys per row are only known on the device, so every grid and buffer size
below depends only on shapes and on the capacity of `selection.indices` (CUDA-graph friendly).

Two variants of one kernel, picked from the shapes by `plan`:
    split-KV (decode, G * Lq <= DECODE_MAX_M; also prefill grids too small to fill the GPU): each row's key list is
        cut into work items of `chunk` keys, numbered row after row (the kernels derive the numbering from indptr
        on the device: items per row = ceil(count / chunk) and their prefix sum). A fixed grid of `workers`
        programs takes items w, w + workers, ... (a row with many keys spreads over many SMs: the paper's load
        balancing, sec. 4.2), each writing a normalised partial out [M, D] and its lse to scratch; a second kernel
        merges each row's partials by log-sum-exp. Scratch: max_items(capacity, rows, num_keys, chunk) items of
        M * (D + 1) fp32 values (decode at 512K, 10%, 8 rows, M 4, D 128: ~3.4 MB).
    plain (prefill): FlashAttention forward over a (query block, row) grid, each program reading its row's keys;
        no scratch, no merge.
Prefill (either variant) first copies the selected K/V into packed buffers in selection order (`gather`, one
memory-bound kernel), so the attention's loads are contiguous and software-pipelined (on Hopper, whole blocks come
through tensor descriptors); the buffers hold at most GATHER_MAX_BYTES, and the rows whose keys end past them read
through the indices. Decode reads through the indices (each key is read once there, so a copy would only add
traffic).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kernels.checks import LOG2E, check_qkv
from kernels.jit.sparse import gather_selected_kernel, sparse_attn_fwd_kernel, sparse_attn_merge_kernel
from kernels.launch import dependent_launch
from kernels.reference import sparse as reference
from kernels.selection import Selection

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: no descriptor path
    TensorDescriptor = None

INDEX_DTYPES = (torch.int32, torch.int64)

# --- Knobs (tune on the GPU) -------------------------------------------------------------------------------------
DECODE_MAX_M = 16  # G * Lq up to this: split-KV with one query block (tl.dot needs >= 16 rows, so this is free)
DECODE_BLOCK_N = 64  # keys per inner step in decode (halved for D = 256)
DECODE_WARPS = 4
DECODE_STAGES = 3
# Persistent workers per SM. Keep it at or below the programs that fit on an SM at once (~3 at 147-156 registers,
# 4 warps, BLOCK_N 64, D 128): a worker that waits for a free slot finishes a whole share late.
DECODE_WORKERS_PER_SM = 3  # H200, 128K, 32/8, 90%: 3 workers/SM with 256-key items 16.8 us, 2/SM with 64: 29.8 us
# Keys per work item: a multiple of the key block in [MIN, MAX] that cuts a row's expected keys into as many items
# as the row's share of the workers, times ITEMS_PER_WORKER, so that the items end in one wave. (H100,
# Quest's 10% at 128K/512K, 32/8: rounding the chunk down to a power of two made 416 items for 396 workers, a second
# wave for 20 of them: 31.6/101 us; one wave of 392 items: 26.9/82.5 us. Two items per worker: 28.7/84.5 us.)
DECODE_ITEMS_PER_WORKER = 1
# The capacity is the worst case (every key of every row); the selected keys are only known on the device. Items
# are sized for a typical selection, this fraction of the keys (a heavier one just gives workers more items).
DECODE_EXPECTED_FRACTION = 0.1
DECODE_MIN_CHUNK = 64
DECODE_MAX_CHUNK = 8192
PREFILL_BLOCK_N = 128  # a quarter for D = 256 (shared memory; see plan)
# Prefill copies the selected K/V into packed buffers first (config.gather): Triton pipelines contiguous loads into
# shared memory, not the index-dependent ones. H200, 128K, 32/8 heads, 1024 new tokens, 16% kept (engine/bench/tune.py):
# gathered 64 x 128 tiles on 4 warps, 3 stages, 0.91 ms with the copy; indexed loads 1.28-1.41 ms.
# 128 x 128 tiles on 8 warps through tensor descriptors: 0.73 ms (see plan).
# The selection's size is known on the device only, so the buffers hold the worst case (the capacity of the index
# list) up to this many bytes (K and V): a selection that outgrows them packs its first entries, and the rows past
# them read through the indices (decided per row on the device).
GATHER_MAX_BYTES = 4 << 30
PREFILL_TMA = True  # packed prefill reads whole key blocks through tensor descriptors where the GPU has them
PREFILL_SPLIT_BELOW = 1.0  # split prefill over keys when (query blocks * rows) < this * SMs
PREFILL_TARGET_PROGRAMS_PER_SM = 2  # split prefill: aim at this many (query block, item) programs per SM
MERGE_BLOCK_D = 64  # head-dim slice per merge program (more programs, fewer registers)
MERGE_TILE = 4096  # split prefill: merge_block_m * merge_block_i * MERGE_BLOCK_D fp32 partials per merge step
MERGE_WARPS = 4
GATHER_BLOCK_N = 64  # keys per program of the packing copy (config.gather)
INTERPRETER_SMS = 4  # "SMs" without CUDA (TRITON_INTERPRET=1 on the CPU): small, so tests run the persistent loop


@dataclass(frozen=True)
class SparseAttentionConfig:
    """How one call is cut into programs. `chunk` is used only when `split`; `workers` is grid axis 1 when `split`."""

    split: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    chunk: int = 0
    workers: int = 0
    merge_block_m: int = 1  # query rows per merge program
    merge_block_i: int = 128  # partials per merge step (a decode row at 512K / 10% has ~200 items of 256 keys)
    gather: bool = False  # copy the selected K/V into packed buffers first, then attend without indices
    packed_entries: int = 0  # gather: entries of the packed buffers (0: the whole selection, up to GATHER_MAX_BYTES)
    tma: bool = False  # with gather, unsplit: read whole key blocks through tensor descriptors (Hopper's copy engine)

    def __post_init__(self):
        for name in ("merge_block_m", "merge_block_i"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.packed_entries < 0 or (self.packed_entries and not self.gather):
            raise ValueError(f"packed_entries needs gather=True, got {self.packed_entries}")
        if self.tma and (self.split or not self.gather):
            raise ValueError("tma needs gather=True and split=False")
        if self.split and (self.chunk < 1 or self.workers < 1):
            raise ValueError(f"split needs chunk >= 1 and workers >= 1, got chunk={self.chunk} workers={self.workers}")


@dataclass(frozen=True)
class DecodeTiles:
    """A decode step's split-KV tiles (plan's knobs, the defaults above): keys per inner step (halved for D = 256),
    warps and pipeline stages of a worker, and persistent workers per SM. `python -m engine.bench.union --sweep`
    times alternatives on a GPU."""

    block_n: int = DECODE_BLOCK_N
    num_warps: int = DECODE_WARPS
    num_stages: int = DECODE_STAGES
    workers_per_sm: int = DECODE_WORKERS_PER_SM

    def __post_init__(self):
        if self.block_n < 32 or self.block_n & (self.block_n - 1) or min(self.num_warps, self.num_stages,
                                                                          self.workers_per_sm) < 1:
            raise ValueError(f"decode tiles need a power-of-two block_n >= 32 and positive warps, stages and "
                             f"workers: {self}")


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """Tensor descriptors: Triton >= 3.4 on a GPU of compute capability 9 or more (Hopper's copy engine)."""
    return (TensorDescriptor is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def max_items(capacity: int, rows: int, num_keys: int, chunk: int) -> int:
    """Upper bound of sum_r ceil(count_r / chunk) given sum_r count_r <= capacity and count_r <= num_keys."""
    by_capacity = (capacity + rows * (chunk - 1)) // chunk
    by_keys = rows * triton.cdiv(num_keys, chunk)
    return min(by_capacity, by_keys)


def packed_buffer_entries(capacity: int, head_dim: int, elem_bytes: int) -> int:
    """Entries of the packed K/V buffers: the whole index list's capacity, or as many as GATHER_MAX_BYTES hold."""
    return max(1, min(capacity, GATHER_MAX_BYTES // (2 * head_dim * elem_bytes)))


def plan(num_m: int, rows: int, head_dim: int, capacity: int, num_keys: int, num_sms: int,
         elem_bytes: int = 2, tma: bool = False, dense: bool = False, extra_items: int = 0,
         tiles: DecodeTiles = DecodeTiles()) -> SparseAttentionConfig:
    """The default config for M = G * Lq query rows per row, from shapes only (never from device values).

    capacity: selection.indices.numel() (an upper bound of the selected keys of all rows together).
    tma: the device has tensor descriptors (_has_tma); unsplit packed prefill then uses them.
    dense: every key of every row, in order (`dense_attention`): the loads are contiguous already, nothing is packed.
    extra_items: work items each row has beside its keys' in a decode step (kernels/union_ops.py: new tokens, follow
    rows), taken out of its share of the workers.
    tiles: a decode step's tiles (DecodeTiles; the defaults unless a benchmark sweeps them).
    """
    if num_m <= DECODE_MAX_M:
        block_n = tiles.block_n if head_dim <= 128 else tiles.block_n // 2
        target_workers = tiles.workers_per_sm * num_sms
        # dense: every key, so items sized for all of them (cut for a tenth, full attention's step at 128K merged 410
        # partials a row: 8.6 us a layer on an H200)
        expected = capacity if dense else min(capacity, int(rows * num_keys * DECODE_EXPECTED_FRACTION))
        row_items = max(1, target_workers // rows - extra_items) * DECODE_ITEMS_PER_WORKER
        chunk = block_n * triton.cdiv(triton.cdiv(max(1, expected // rows), row_items), block_n)
        chunk = min(max(chunk, DECODE_MIN_CHUNK), DECODE_MAX_CHUNK)
        workers = max(1, min(max_items(capacity, rows, num_keys, chunk), target_workers))
        return SparseAttentionConfig(split=True, block_m=16, block_n=block_n, num_warps=tiles.num_warps,
                                     num_stages=tiles.num_stages, chunk=chunk, workers=workers)
    # H200, 128K, 32/8, 1024 new tokens, 16% kept, packed K/V, copy included (engine/bench/tune.py):
    # 128 x 128 tiles on 8 warps, 3 stages: 0.73 ms through tensor descriptors, 0.77 ms through plain loads;
    # 64 x 128 on 4 warps 0.84 ms (the 64-row tiles read every key block from L2 twice as often). Head dim 256:
    # 64 x 32 tiles on 4 warps, 2 stages (untimed): the kernel holds pipeline buffers for the packed and the indexed
    # key loop, and 64-key blocks asked for 288 KB of shared memory on an H200 (227 KB there).
    wide = head_dim <= 128
    block_m = min(128 if wide else 64, max(16, triton.next_power_of_2(num_m)))
    block_n = PREFILL_BLOCK_N if wide else PREFILL_BLOCK_N // 4  # D 256: both key loops' buffers fit in 227 KB
    gather = not dense  # packed K/V buffers of at most GATHER_MAX_BYTES (packed_buffer_entries)
    num_warps = 8 if wide and block_m == 128 else 4
    num_stages = 3 if wide else 2
    m_blocks = triton.cdiv(num_m, block_m)
    if m_blocks * rows >= PREFILL_SPLIT_BELOW * num_sms or capacity == 0:
        return SparseAttentionConfig(split=False, block_m=block_m, block_n=block_n, num_warps=num_warps,
                                     num_stages=num_stages, gather=gather, tma=gather and tma and PREFILL_TMA)
    # Too few programs to fill the GPU: cut rows into items (a multiple of block_n) so that ~TARGET programs run
    # over a typical selection (DECODE_EXPECTED_FRACTION of the keys: the capacity is the worst case, and items
    # cut from it left 16 items of 8K keys for 132 SMs at 128K: a 64-token question's attention at 10% took 180 us
    # a layer on an H200, half of dense attention's 353), merged like decode; a heavier selection gives the
    # workers more items.
    want_items = max(1, triton.cdiv(PREFILL_TARGET_PROGRAMS_PER_SM * num_sms, m_blocks))
    expected = capacity if dense else min(capacity, int(rows * num_keys * DECODE_EXPECTED_FRACTION))
    chunk = block_n * max(1, triton.cdiv(triton.cdiv(max(1, expected), want_items), block_n))
    workers = max(1, min(max_items(capacity, rows, num_keys, chunk), want_items))
    merge_block_i = min(16, triton.next_power_of_2(triton.cdiv(workers, rows)))  # ~items per row
    merge_block_m = max(1, MERGE_TILE // min(head_dim, MERGE_BLOCK_D) // merge_block_i)
    return SparseAttentionConfig(split=True, block_m=block_m, block_n=block_n, num_warps=num_warps,
                                 num_stages=num_stages, chunk=chunk, workers=workers,
                                 merge_block_m=merge_block_m, merge_block_i=merge_block_i, gather=gather)


def check_selection(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: Selection) -> None:
    """q, k, v and a selection fit each other (rows, keys, index dtypes, one device)."""
    check_qkv(q, k, v)
    hq, hkv, rows = q.shape[0], k.shape[0], selection.rows
    if rows not in (hq, hkv) or hq % rows:
        raise ValueError(f"selection has {rows} rows; expected Hq={hq} or Hkv={hkv}")
    if selection.num_keys > k.shape[1]:
        raise ValueError(f"selection indexes {selection.num_keys} keys but k holds {k.shape[1]}")
    indptr, indices = selection.indptr, selection.indices
    if indptr.dim() != 1 or indptr.dtype not in INDEX_DTYPES or indices.dim() != 1 or indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"selection.indptr/indices must be 1-D int32/int64; got {indptr.dtype} {tuple(indptr.shape)}, "
                        f"{indices.dtype} {tuple(indices.shape)}")
    devices = {t.device for t in (q, k, v, indptr, indices)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v and the selection must share one device; got {sorted(map(str, devices))}")


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
    scale: float,
    config: SparseAttentionConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over only the keys its row selects; see kernels.reference.sparse.sparse_attention.

    q: [Hq, Lq, D]; k, v: [Hkv, Lk, D] (fp16, bf16 or fp32, any strides; q is cast to k's dtype, the dtype of the
    tensor-core inputs, when it differs); selection: rows in {Hq, Hkv}, indptr/indices int32 or int64, indices sorted
    per row, possibly longer than indptr[-1] (the tail is ignored). config: override `plan` (tests, tuning).
    Returns out [Hq, Lq, D] float32 and lse [Hq, Lq] float32 (natural log; 0 and -inf for a row with no keys).
    """
    check_selection(q, k, v, selection)
    indices = selection.indices.contiguous()
    return _launch(q, k, v, selection.indptr.contiguous(), indices, indices.numel(), selection.num_keys, scale, config)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    config: SparseAttentionConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query over every key (no mask): kernels.reference.sparse.attention_with_lse without a mask, through the same
    grids as `sparse_attention` (split-KV over persistent workers in decode, query blocks x KV heads in prefill)
    with each KV head's keys read in order and no index list. Memory O(Lq * D): no score matrix.

    q: [Hq, Lq, D]; k, v: [Hkv, Lk, D] (any strides). Returns out [Hq, Lq, D] fp32 and lse [Hq, Lq] fp32.
    """
    hkv, lk = k.shape[0], k.shape[1]
    check_qkv(q, k, v)
    if config is not None and config.gather:
        raise ValueError("dense_attention reads K/V in place: config.gather must be False")
    # row r = KV head r, keys r * lk ..: the kernels read neither indptr nor indices (DENSE), so k stands in for both
    return _launch(q, k, v, k, k, hkv * lk, lk, scale, config, dense=True)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.sparse.attention_with_lse: without a mask through the dense mode of the sparse kernel; a
    boolean mask (tests, tools; the engine masks by positions through the causal kernel) goes to the reference."""
    if mask is not None:
        return reference.attention_with_lse(q, k, v, scale, mask)
    return dense_attention(q, k, v, scale)


def _launch(q, k, v, indptr, indices, capacity: int, num_keys: int, scale: float,
            config: SparseAttentionConfig | None, dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan and run the kernels over a checked selection (indptr [rows + 1], indices with `capacity` entries, or
    DENSE: the whole KV head per row, num_keys each; indptr and indices are not read). Returns out [Hq, Lq, D], lse
    [Hq, Lq] fp32."""
    q = q.to(k.dtype)  # no-op when they match
    hq, lq, d = q.shape
    hkv = k.shape[0]
    rows = hkv if dense else indptr.numel() - 1
    group = hq // rows
    num_m = group * lq  # query rows per selection row
    out = torch.empty(hq, lq, d, device=q.device, dtype=torch.float32)  # flat: [rows, num_m, D]
    lse = torch.empty(hq, lq, device=q.device, dtype=torch.float32)  # flat: [rows, num_m]
    if out.numel() == 0:
        return out, lse
    if capacity == 0 and dense:  # no keys at all
        return out.zero_(), lse.fill_(float("-inf"))
    cfg = config or plan(num_m, rows, d, capacity, num_keys, num_sms(q.device), k.element_size(),
                         _has_tma(q.device), dense=dense)
    block_r = max(2, triton.next_power_of_2(rows))
    m_blocks = triton.cdiv(num_m, cfg.block_m)
    common = dict(
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r, SPLIT=cfg.split,
        EXACT_FP32=q.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages, DENSE=dense,
        dense_len=num_keys if dense else 0, **dependent_launch(q.device),
    )
    qk_scale = scale * LOG2E
    if cfg.gather:  # packed copies of the first `entries` selected K/V, in selection order
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))  # the copy reads rows of unit stride
        entries = cfg.packed_entries or packed_buffer_entries(capacity, d, k.element_size())
        k_packed = torch.empty(entries, d, device=q.device, dtype=k.dtype)
        v_packed = torch.empty_like(k_packed)
        gather_selected_kernel[(triton.cdiv(num_keys, GATHER_BLOCK_N), rows)](
            k, v, indptr, indices, k_packed, v_packed, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            rows, hkv, entries, HEAD_DIM=d, BLOCK_N=GATHER_BLOCK_N, num_warps=4,
            **dependent_launch(q.device),
        )
        common.update(PACKED=True, kp_ptr=k_packed, vp_ptr=v_packed, packed_cap=entries)
        if cfg.tma:
            if TensorDescriptor is None:
                raise RuntimeError("config.tma needs triton.tools.tensor_descriptor (Triton >= 3.4)")
            common.update(k_desc=TensorDescriptor.from_tensor(k_packed, [cfg.block_n, d]),
                          v_desc=TensorDescriptor.from_tensor(v_packed, [cfg.block_n, d]), TMA=True)
    strides = (*q.stride(), *k.stride(), *v.stride())  # of k / v as the kernel reads them (after any copy above)
    if not cfg.split:
        sparse_attn_fwd_kernel[(m_blocks, rows)](
            q, k, v, indptr, indices, out, lse, *strides, rows, hkv, group, lq, 1, qk_scale, **common
        )
        return out, lse
    n_items = max(1, max_items(capacity, rows, num_keys, cfg.chunk))
    part_out = torch.empty(n_items, num_m, d, device=q.device, dtype=torch.float32)  # [items, M, D]
    part_lse = torch.empty(n_items, num_m, device=q.device, dtype=torch.float32)  # [items, M], base 2
    sparse_attn_fwd_kernel[(m_blocks, cfg.workers)](
        q, k, v, indptr, indices, part_out, part_lse, *strides, rows, hkv, group, lq, cfg.chunk, qk_scale, **common
    )
    block_d = min(d, MERGE_BLOCK_D)
    merge_block_m = min(cfg.merge_block_m, triton.next_power_of_2(num_m))
    sparse_attn_merge_kernel[(triton.cdiv(num_m, merge_block_m), rows, d // block_d)](
        part_out, part_lse, indptr, out, lse, rows, num_m, cfg.chunk,
        HEAD_DIM=d, BLOCK_M=merge_block_m, BLOCK_I=cfg.merge_block_i, BLOCK_D=block_d, BLOCK_R=block_r,
        num_warps=MERGE_WARPS, DENSE=dense, dense_len=num_keys if dense else 0, **dependent_launch(q.device),
    )
    return out, lse


__all__ = ["SparseAttentionConfig", "check_selection", "dense_attention", "max_items", "num_sms", "packed_buffer_entries", "plan",
           "sparse_attention"]

