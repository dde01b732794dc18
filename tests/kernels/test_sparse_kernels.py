"""kernels.sparse_ops.sparse_attention (Triton) against kernels.reference.

Without CUDA the kernels run in the Triton interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1), so the
CPU tests use small shapes and fp32/fp16 only (bf16 tl.dot is wrong in the interpreter). Shapes are chosen to reach
every branch: decode (G * Lq <= 16: split-KV + merge) and prefill (plain, or split when the grid is small), rows = Hq
and rows = Hkv, GQA ratios 1/2/4, uneven rows (many keys, 3 keys, none), Lk not a multiple of any block, work items
not a multiple of the key block, more partials per row than one merge step, int32/int64 indices with a garbage tail.
The GPU tests (marked `gpu`) run bf16 at realistic shapes, check that no call synchronises with the host, and replay
the call in a CUDA graph.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import sparse as reference
from kernels.selection import Selection
from kernels.sparse_ops import (
    DECODE_EXPECTED_FRACTION,
    DECODE_WORKERS_PER_SM,
    GATHER_MAX_BYTES,
    PREFILL_TARGET_PROGRAMS_PER_SM,
    SparseAttentionConfig,
    dense_attention,
    max_items,
    packed_buffer_entries,
    plan,
    sparse_attention,
)

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: both sides compute in fp32 from the same values and differ only in summation order (and, on the GPU, in
# exp2 vs exp): ~1e-6 observed, so 1e-4 leaves room without hiding a wrong key or head (those move results by 1e-2).
# fp16: the kernel rounds the probabilities to fp16 before P @ V (as FlashAttention does): ~2^-11 relative per term.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}
LK = 203  # not a multiple of any block size or chunk
GQA = [(2, 2), (4, 2), (8, 2)]  # (Hq, Hkv): ratios 1, 2, 4


def make_qkv(hq: int, hkv: int, lq: int, lk: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q [Hq, Lq, D], k/v [Hkv, Lk, D] on DEVICE. q is scaled up so that softmax is peaky: a wrong key shows."""
    g = torch.Generator().manual_seed(seed)
    q = (2.0 * torch.randn(hq, lq, d, generator=g)).to(dtype)
    k = torch.randn(hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(hkv, lk, d, generator=g).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def uneven_mask(rows: int, lk: int, seed: int = 0, run: int = 5) -> torch.Tensor:
    """[rows, lk] bool: row 0 keeps ~85% of the keys, row 1 three keys, row 2 none, the others runs of `run` keys
    (as a cluster-permuted context gives) with probability 0.3."""
    g = torch.Generator().manual_seed(seed)
    runs = torch.rand(rows, math.ceil(lk / run), generator=g) < 0.3
    mask = runs.repeat_interleave(run, dim=1)[:, :lk]
    mask[0] = torch.rand(lk, generator=g) < 0.85
    if rows > 1:
        mask[1] = False
        mask[1, torch.randperm(lk, generator=g)[:3]] = True
    if rows > 2:
        mask[2] = False
    return mask


def selection_on_device(mask: torch.Tensor, index_dtype=torch.int64, tail: int = 0, seed: int = 0) -> Selection:
    """Selection.from_mask on DEVICE, indptr and indices cast to `index_dtype`, indices followed by `tail` garbage
    entries (a preallocated capacity longer than indptr[-1]; the garbage is out of range on purpose: it must never
    be read)."""
    sel = Selection.from_mask(mask)
    g = torch.Generator().manual_seed(seed)
    garbage = torch.randint(-(2**30), 2**30, (tail,), generator=g)
    indices = torch.cat([sel.indices, garbage]).to(index_dtype)
    return Selection(indptr=sel.indptr.to(index_dtype).to(DEVICE), indices=indices.to(DEVICE), num_keys=sel.num_keys)


def check(q, k, v, sel: Selection, *, ref_sel: Selection | None = None, config=None, scale=None):
    """sparse_attention against the reference (computed from the clean int64 selection `ref_sel`)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out, lse = sparse_attention(q, k, v, sel, scale, config=config)
    ref_out, ref_lse = reference.sparse_attention(q, k, v, ref_sel or sel, scale)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    tol = TOL[q.dtype]
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    return out, lse


@pytest.mark.parametrize("lq", [1, 3, 40, 130])
@pytest.mark.parametrize(
    "hq,hkv,rows_of",
    [(hq, hkv, r) for hq, hkv in GQA for r in ("hq", "hkv") if not (r == "hkv" and hq == hkv)],
)
def test_matches_reference(hq, hkv, rows_of, lq):
    """Decode (lq 1, 3) and prefill (lq 40, 130), rows = Hq and rows = Hkv, uneven rows including an empty one."""
    q, k, v = make_qkv(hq, hkv, lq, LK, 32, torch.float32, seed=lq)
    rows = hq if rows_of == "hq" else hkv
    sel = selection_on_device(uneven_mask(rows, LK, seed=rows))
    out, lse = check(q, k, v, sel)
    if rows > 2:  # the empty row: out 0, lse -inf for every query head it serves
        heads = slice(2 * hq // rows, 3 * hq // rows)
        assert torch.all(out[heads] == 0) and torch.all(lse[heads] == float("-inf"))


@pytest.mark.parametrize("lq", [3, 130])
@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dtypes_and_head_dims(dtype, d, lq):
    q, k, v = make_qkv(4, 2, lq, LK, d, dtype, seed=d)
    check(q, k, v, selection_on_device(uneven_mask(2, LK, seed=d)))


# Configs forced on the same inputs: every variant of the kernel must give the reference answer.
FORCED = {
    "plain": SparseAttentionConfig(split=False, block_m=16, block_n=16, num_warps=4, num_stages=2),
    # items of 5 keys (not a multiple of block_n) on 3 persistent workers; 4 partials per merge step, so the ~35
    # items of row 0 take several merge steps
    "split-tiny-items": SparseAttentionConfig(split=True, block_m=32, block_n=16, num_warps=4, num_stages=2,
                                              chunk=5, workers=3, merge_block_m=2, merge_block_i=4),
    # items of 40 keys over blocks of 32: one full and one partial block per item
    "split-uneven-blocks": SparseAttentionConfig(split=True, block_m=32, block_n=32, num_warps=4, num_stages=2,
                                                 chunk=40, workers=2, merge_block_m=16, merge_block_i=2),
    # the selected K/V packed first (gather_selected_kernel), then attended without indices; plain and split
    "plain-gathered": SparseAttentionConfig(split=False, block_m=16, block_n=16, num_warps=4, num_stages=2,
                                            gather=True),
    "split-gathered": SparseAttentionConfig(split=True, block_m=32, block_n=16, num_warps=4, num_stages=2,
                                            chunk=5, workers=3, merge_block_m=2, merge_block_i=4, gather=True),
    # packed K/V read through tensor descriptors for the whole blocks (Hopper's default prefill path)
    "plain-gathered-tma": SparseAttentionConfig(split=False, block_m=16, block_n=16, num_warps=4, num_stages=2,
                                                gather=True, tma=True),
}


@pytest.mark.parametrize("lq", [3, 40])
@pytest.mark.parametrize("name", list(FORCED))
def test_forced_configs(name, lq):
    q, k, v = make_qkv(4, 2, lq, LK, 16, torch.float32, seed=7)
    check(q, k, v, selection_on_device(uneven_mask(2, LK, seed=3)), config=FORCED[name])


@pytest.mark.parametrize("lq", [1, 40])
@pytest.mark.parametrize("rows_of", ["hq", "hkv"])
def test_full_selection_is_dense_attention(rows_of, lq):
    """Selecting every key gives dense attention (reference.attention_with_lse)."""
    hq, hkv = 4, 2
    q, k, v = make_qkv(hq, hkv, lq, LK, 32, torch.float32, seed=11)
    rows = hq if rows_of == "hq" else hkv
    sel = selection_on_device(torch.ones(rows, LK, dtype=torch.bool))
    scale = 32**-0.5
    out, lse = sparse_attention(q, k, v, sel, scale)
    ref_out, ref_lse = reference.attention_with_lse(q, k, v, scale)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


@pytest.mark.parametrize("lq,lk,d,dtype", [(1, LK, 32, torch.float32), (40, LK, 32, torch.float32),
                                            (1, LK, 64, torch.float16), (40, 77, 16, torch.float16), (3, 0, 16, torch.float32)])
@pytest.mark.parametrize("hq,hkv", GQA)
def test_dense_attention_is_reference_attention(hq, hkv, lq, lk, d, dtype):
    """dense_attention (every key, no index list) against reference.attention_with_lse, with strided q and k (views of
    larger buffers, as the engine's fixed K/V during an ingest are); no keys gives out 0 and lse -inf."""
    q, k, v = make_qkv(hq, hkv, lq, lk + 5, d, dtype, seed=13)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # [Hq, Lq, D] with token-major strides
    k, v = k[:, :lk], v[:, :lk]  # views: the head stride is of the longer buffer
    scale = d**-0.5
    out, lse = dense_attention(q, k, v, scale)
    ref_out, ref_lse = reference.attention_with_lse(q, k, v, scale)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])


@pytest.mark.parametrize("lq", [1, 40])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_index_dtype_and_capacity_tail(index_dtype, lq):
    """indptr/indices int32 or int64, indices followed by a garbage tail past indptr[-1] that must be ignored."""
    q, k, v = make_qkv(8, 2, lq, LK, 16, torch.float32, seed=5)
    mask = uneven_mask(8, LK, seed=5)
    sel = selection_on_device(mask, index_dtype=index_dtype, tail=97)
    check(q, k, v, sel, ref_sel=selection_on_device(mask))


@pytest.mark.parametrize("lq", [1, 40])
def test_nothing_selected(lq):
    """Every row empty (with and without spare capacity): out 0, lse -inf everywhere."""
    q, k, v = make_qkv(4, 2, lq, LK, 16, torch.float32)
    for tail in (0, 9):
        sel = selection_on_device(torch.zeros(2, LK, dtype=torch.bool), tail=tail)
        out, lse = sparse_attention(q, k, v, sel, 0.25)
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_query_dtype_follows_keys():
    """An fp32 query over fp16 keys runs in fp16 (as if q had been cast), like the reference up to that rounding."""
    q, k, v = make_qkv(4, 2, 3, LK, 16, torch.float16, seed=4)
    sel = selection_on_device(uneven_mask(2, LK, seed=4))
    out, lse = sparse_attention(q.float(), k, v, sel, 0.25)
    ref_out, ref_lse = reference.sparse_attention(q, k, v, sel, 0.25)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float16])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float16])


@pytest.mark.parametrize("lq", [3, 40])
def test_strided_inputs(lq):
    """q, k, v as views of [L, H, D] buffers (the layout of a model's projections): no copies needed."""
    q, k, v = make_qkv(4, 2, lq, LK, 16, torch.float32, seed=2)
    qt, kt, vt = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
    assert not qt.is_contiguous() and not kt.is_contiguous()
    check(qt, kt, vt, selection_on_device(uneven_mask(2, LK, seed=2)))


def test_rejects_bad_inputs():
    q, k, v = make_qkv(4, 2, 1, LK, 16, torch.float32)
    sel = selection_on_device(uneven_mask(2, LK))
    with pytest.raises(ValueError, match="rows"):
        sparse_attention(q, k, v, selection_on_device(uneven_mask(3, LK)), 1.0)
    with pytest.raises(TypeError):
        sparse_attention(q, k.half(), v, sel, 1.0)  # k and v differ
    with pytest.raises(TypeError):
        sparse_attention(q, k.double(), v.double(), sel, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        sparse_attention(q[..., :12], k[..., :12], v[..., :12], sel, 1.0)
    with pytest.raises(ValueError, match="keys"):
        sparse_attention(q, k[:, :100], v[:, :100], sel, 1.0)
    with pytest.raises(ValueError):
        SparseAttentionConfig(split=True, block_m=16, block_n=16, num_warps=4, num_stages=2)  # no chunk/workers


def test_plan_depends_on_shapes_only():
    """Decode picks split-KV with one 16-row block and at most DECODE_WORKERS_PER_SM workers per SM, finer items for
    shorter contexts;
    a large prefill picks the plain grid; a prefill too small to fill the GPU splits into block-aligned items."""
    dec_512k = plan(num_m=4, rows=8, head_dim=128, capacity=52_000 * 8, num_keys=512 * 1024, num_sms=132)
    dec_128k = plan(num_m=4, rows=8, head_dim=128, capacity=13_000 * 8, num_keys=128 * 1024, num_sms=132)
    for dec in (dec_512k, dec_128k):
        assert dec.split and dec.block_m == 16 and 1 <= dec.workers <= DECODE_WORKERS_PER_SM * 132
        assert dec.chunk % dec.block_n == 0
    assert dec_128k.chunk < dec_512k.chunk
    # full attention's step: items cut for every key, so they end in one wave of workers
    dense = plan(num_m=4, rows=8, head_dim=128, capacity=8 * 128 * 1024, num_keys=128 * 1024, num_sms=132, dense=True)
    assert dense.split and max_items(8 * 128 * 1024, 8, 128 * 1024, dense.chunk) <= DECODE_WORKERS_PER_SM * 132
    tiny = plan(num_m=1, rows=2, head_dim=64, capacity=10, num_keys=10, num_sms=132)
    assert tiny.split and tiny.workers == max_items(10, 2, 10, tiny.chunk)
    pre = plan(num_m=4 * 1024, rows=8, head_dim=128, capacity=13_000 * 8, num_keys=128 * 1024, num_sms=132)
    assert not pre.split and pre.block_m >= 64
    small = plan(num_m=512, rows=8, head_dim=128, capacity=13_000 * 8, num_keys=128 * 1024, num_sms=132)
    assert small.split and small.chunk % small.block_n == 0
    m_blocks = 512 // small.block_m
    assert small.workers <= max_items(13_000 * 8, 8, 128 * 1024, small.chunk)
    assert small.workers * m_blocks <= PREFILL_TARGET_PROGRAMS_PER_SM * 132 + m_blocks  # one wave of programs
    # an index list sized for the worst case (every key) is cut for a typical selection: a 10% one fills the GPU
    worst = plan(num_m=256, rows=8, head_dim=128, capacity=8 * 128 * 1024, num_keys=128 * 1024, num_sms=132)
    assert worst.split
    typical_items = max_items(int(DECODE_EXPECTED_FRACTION * 8 * 128 * 1024), 8, 128 * 1024, worst.chunk)
    assert typical_items * (256 // worst.block_m) >= 132


PARTLY_PACKED = {
    "plain": dict(split=False, block_m=16, block_n=16),
    "plain-tma": dict(split=False, block_m=16, block_n=16, tma=True),
    "split": dict(split=True, block_m=32, block_n=16, chunk=5, workers=3, merge_block_m=2, merge_block_i=4),
}


@pytest.mark.parametrize("lq", [3, 40])
@pytest.mark.parametrize("name", list(PARTLY_PACKED))
def test_packed_buffers_smaller_than_the_selection(name, lq):
    """Packed buffers holding only the first rows' keys (their bound in bytes): those rows read the packed K/V,
    the rows past the buffers read through the indices (decided per row on the device); both give the reference."""
    mask = uneven_mask(4, LK, seed=3)[[1, 3, 0, 2]]  # rows of 3 keys, a few runs, ~85% of the keys, none
    counts = mask.sum(1)
    assert 0 < counts[0] < counts[0] + counts[1] < counts[:3].sum()
    entries = int(counts[0] + counts[1]) + 7  # rows 0 and 1 fit, row 2 does not
    cfg = SparseAttentionConfig(num_warps=4, num_stages=2, gather=True, packed_entries=entries,
                                **PARTLY_PACKED[name])
    q, k, v = make_qkv(4, 2, lq, LK, 16, torch.float32, seed=5)
    check(q, k, v, selection_on_device(mask), config=cfg)


@pytest.mark.parametrize("name", ["plain", "split"])
def test_partly_packed_with_strided_head_dim(name):
    """K/V whose head dimension is strided (the packing copy wants it contiguous): the rows past the packed
    buffers read the copy with its own strides."""
    mask = uneven_mask(4, LK, seed=3)[[1, 3, 0, 2]]
    counts = mask.sum(1)
    cfg = SparseAttentionConfig(num_warps=4, num_stages=2, gather=True, packed_entries=int(counts[0] + counts[1]) + 7,
                                **PARTLY_PACKED[name])
    q, k, v = make_qkv(4, 2, 40, LK, 16, torch.float32, seed=6)
    kt, vt = (torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0] for x in (k, v))  # [Hkv, Lk, D], stride 2
    assert kt.stride(-1) == 2 and torch.equal(kt, k)
    check(q, kt, vt, selection_on_device(mask), config=cfg)


def test_plan_bounds_the_packed_buffers():
    """Prefill packs the selected K/V into buffers of the index list's capacity, at most GATHER_MAX_BYTES (K and V)."""
    pre = plan(num_m=4 * 1024, rows=8, head_dim=128, capacity=8 * 512 * 1024, num_keys=512 * 1024, num_sms=132)
    assert pre.gather and pre.packed_entries == 0  # sized at the call, from the capacity
    assert packed_buffer_entries(1000, 128, 2) == 1000
    bound = packed_buffer_entries(32 * 512 * 1024, 128, 2)
    assert bound == GATHER_MAX_BYTES // (2 * 128 * 2) < 32 * 512 * 1024


@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_max_items_bounds_every_selection(chunk):
    """The scratch size bound: sum over rows of ceil(count / chunk) never exceeds max_items(capacity, ...)."""
    g = torch.Generator().manual_seed(chunk)
    for _ in range(20):
        rows, num_keys = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 600, (1,), generator=g))
        counts = (torch.rand(rows, generator=g) ** 3 * (num_keys + 1)).long().clamp(max=num_keys)
        items = int(((counts + chunk - 1) // chunk).sum())
        assert items <= max_items(int(counts.sum()), rows, num_keys, chunk)


# ---------------------------------------------------------------------------------------------------------- GPU ---
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# bf16: the kernel rounds probabilities to bf16 before P @ V (<= 2^-9 relative per term, random signs): with ~3K
# keys per row |out| ~ 0.03 and the error ~1e-4 (max over 4M values ~3e-4). Scores are fp32 dots of the same bf16
# values on both sides, so lse agrees to ~1e-5.
BF16_OUT = dict(atol=2e-3, rtol=1e-2)
BF16_LSE = dict(atol=2e-3, rtol=1e-3)


def realistic(hq, hkv, lq, lk, d, rows, seed=0, run=20, frac=0.10):
    """bf16 q/k/v on CUDA and a selection of ~frac of the keys per row in runs of `run` keys, rows uneven
    (row fractions from frac/4 to 2*frac)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(hq, lq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(hkv, lk, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(hkv, lk, d, device="cuda", generator=g, dtype=torch.bfloat16)
    row_frac = frac * torch.linspace(0.25, 2.0, rows, device="cuda")[torch.randperm(rows, device="cuda", generator=g)]
    runs = torch.rand(rows, lk // run, device="cuda", generator=g) < row_frac[:, None]
    return q, k, v, Selection.from_mask(runs.repeat_interleave(run, dim=1))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("lq", [1, 64, 1024])  # decode split-KV; prefill split (grid too small); prefill plain
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("hq,hkv,rows_of", [(32, 8, "hkv"), (32, 8, "hq"), (32, 32, "hq")])
def test_gpu_bf16_realistic(hq, hkv, rows_of, d, lq):
    q, k, v, sel = realistic(hq, hkv, lq, 32 * 1024, d, hq if rows_of == "hq" else hkv)
    scale = d**-0.5
    out, lse = sparse_attention(q, k, v, sel, scale)
    ref_out, ref_lse = reference.sparse_attention(q, k, v, sel, scale)  # fp32 from the same bf16 values
    torch.testing.assert_close(out, ref_out, **BF16_OUT)
    torch.testing.assert_close(lse, ref_lse, **BF16_LSE)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("lq", [1, 1024])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (4, 1, 256)])
def test_gpu_dense_bf16_realistic(hq, hkv, d, lq):
    """dense_attention at 32K keys in bf16 against the fp32 reference from the same values, and without host sync."""
    q, k, v, _ = realistic(hq, hkv, lq, 32 * 1024, d, hkv, seed=3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dense_attention(q, k, v, d**-0.5)  # also the warm-up compile
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out, lse = dense_attention(q, k, v, d**-0.5)
    ref_out, ref_lse = reference.attention_with_lse(q, k, v, d**-0.5)
    torch.testing.assert_close(out, ref_out, **BF16_OUT)
    torch.testing.assert_close(lse, ref_lse, **BF16_LSE)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("lq", [1, 1024])
def test_gpu_no_host_sync_and_cuda_graph(lq):
    """The call never synchronises with the host, and a captured graph replays correctly with a new selection of the
    same capacity (counts per row differ: the work plan is made on the device)."""
    q, k, v, sel_a = realistic(32, 8, lq, 8192, 128, 8, seed=1)
    _, _, _, sel_b = realistic(32, 8, lq, 8192, 128, 8, seed=2)
    cap = max(sel_a.indices.numel(), sel_b.indices.numel()) + 64
    indptr = torch.zeros_like(sel_a.indptr)
    indices = torch.zeros(cap, dtype=torch.int32, device="cuda")
    static = Selection(indptr=indptr, indices=indices, num_keys=sel_a.num_keys)

    def load(sel: Selection) -> None:
        indptr.copy_(sel.indptr)
        indices[: sel.indices.numel()].copy_(sel.indices)

    load(sel_a)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sparse_attention(q, k, v, static, 0.1)  # also warms up (compiles) outside the capture
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparse_attention(q, k, v, static, 0.1)
    for sel in (sel_b, sel_a):
        load(sel)
        graph.replay()
        ref_out, ref_lse = reference.sparse_attention(q, k, v, sel, 0.1)
        torch.testing.assert_close(out, ref_out, **BF16_OUT)
        torch.testing.assert_close(lse, ref_lse, **BF16_LSE)
