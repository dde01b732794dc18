"""kernels.causal_ops.causal_attention (Triton) against kernels.reference.causal_attention, and that reference
against a per-query loop.

Without CUDA the kernel runs in the Triton interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1), so the
CPU tests use small shapes and fp32/fp16 only (bf16 tl.dot is wrong in the interpreter). The layouts are the
engine's two uses:
    context     the sliding-window layer's fixed context: keys at 0 .. Lk - 1, all before the queries (q_pos 500 + i)
    new-tokens  the call's own keys: k_start = q_pos[0], q_pos consecutive, in a static buffer of capacity Lk > Lq
                whose slots past the queries are unwritten (garbage that causal masking must hide)
Shapes reach decode (one 16-row tile) and prefill tiles, Lk not a multiple of any block, tiles that straddle two
query heads, windows that leave some rows a few keys or none, and strided q. The GPU tests (marked `gpu`) run bf16 at
realistic shapes, check that no call synchronises with the host, and replay the call in a CUDA graph with new
positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.causal_ops import causal_attention
from kernels.reference import causal as reference
from kernels.reference import merge as merge_reference
from tests.kernels.test_sparse_kernels import make_qkv  # the same inputs: q scaled up so that a wrong key shows

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# As in tests/kernels/test_sparse_kernels.py. fp32: both sides compute in fp32 from the same values and differ only in
# summation order (and exp2 vs exp): ~1e-6, so 1e-4 leaves room without hiding a wrong key or head (those move
# results by 1e-2). fp16: the kernel rounds the probabilities to fp16 before P @ V: ~2^-11 relative per term.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}
LK = 203  # not a multiple of any block size
GQA = [(2, 2), (4, 2), (8, 2)]  # (Hq, Hkv): ratios 1, 2, 4
CONTEXT_START = 500  # q_pos of the first query in the context layout
GARBAGE = 1e3  # magnitude of the unwritten slots: finite (the reference multiplies them by 0) but loud if read


def layout(case: str, lq: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(q_pos [Lq] int64 on DEVICE, k_start) of a case; new-tokens fills the slots past the queries with garbage."""
    if case == "context":
        return CONTEXT_START + torch.arange(lq, device=DEVICE), 0
    assert case == "new-tokens" and k.shape[1] > lq
    start = 1000 + lq
    g = torch.Generator().manual_seed(lq)
    for x in (k, v):  # the unwritten tail of the static buffer
        x[:, lq:] = (GARBAGE * torch.randn(x[:, lq:].shape, generator=g)).to(x.dtype).to(DEVICE)
    return start + torch.arange(lq, device=DEVICE), start


def check(q, k, v, q_pos, k_start, window, scale=None):
    """causal_attention against the reference; returns (out, lse)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out, lse = causal_attention(q, k, v, scale, q_pos, k_start, window)
    ref_out, ref_lse = reference.causal_attention(q, k, v, scale, q_pos, k_start, window)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    tol = TOL[k.dtype]
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    return out, lse


# ---------------------------------------------------------------------------------------------- reference ---
def naive_causal(q, k, v, scale, q_pos, k_start, window):
    """One query at a time, KV head by index, float64: the keys it sees listed from the rule itself."""
    hq, lq, d = q.shape
    hkv, lk, _ = k.shape
    out = torch.zeros(hq, lq, d, dtype=torch.float64)
    lse = torch.full((hq, lq), -math.inf, dtype=torch.float64)
    for h in range(hq):
        kvh = h // (hq // hkv)
        for i in range(lq):
            p = int(q_pos[i])
            seen = [j for j in range(lk) if k_start + j <= p and (window is None or k_start + j > p - window)]
            if not seen:
                continue
            scores = k[kvh, seen].double() @ q[h, i].double() * scale  # [len(seen)]
            lse[h, i] = torch.logsumexp(scores, 0)
            out[h, i] = torch.softmax(scores, 0) @ v[kvh, seen].double()
    return out, lse


@pytest.mark.parametrize("window", [None, 4, 30])
@pytest.mark.parametrize("case", ["context", "new-tokens", "shuffled"])
@pytest.mark.parametrize("hq,hkv", GQA)
def test_reference_matches_naive_loop(hq, hkv, case, window):
    """The reference's mask against the rule applied key by key (context with window 4: no query sees a key)."""
    g = torch.Generator().manual_seed(hq)
    lq, lk = 6, 25
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((hq, lq, 16), (hkv, lk, 16), (hkv, lk, 16)))
    if case == "context":
        q_pos, k_start = 20 + lk + torch.arange(lq), 20
    elif case == "new-tokens":
        q_pos, k_start = 7 + torch.arange(lq), 7
    else:  # arbitrary, unordered positions among the keys'
        q_pos, k_start = torch.tensor([30, 3, 17, 44, 25, 9]), 3
    got = reference.causal_attention(q, k, v, 0.4, q_pos, k_start, window)
    want = naive_causal(q, k, v, 0.4, q_pos, k_start, window)
    assert got[0].dtype == got[1].dtype == torch.float32
    torch.testing.assert_close(got[0].double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].double(), want[1], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ Triton kernel ---
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("case", ["context", "new-tokens"])
@pytest.mark.parametrize("lq", [1, 37, 130])
@pytest.mark.parametrize("hq,hkv", GQA)
def test_matches_reference(hq, hkv, lq, case, window):
    """Decode (Lq 1) and prefill; context with window 50 leaves every query without a key (out 0, lse -inf)."""
    q, k, v = make_qkv(hq, hkv, lq, LK, 32, torch.float32, seed=lq + hq)
    q_pos, k_start = layout(case, lq, k, v)
    out, lse = check(q, k, v, q_pos, k_start, window)
    if case == "context" and window == 50:
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("lq", [1, 37])
@pytest.mark.parametrize("d", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dtypes_and_head_dims(dtype, d, lq):
    """New tokens in a sliding window, fp32 and fp16, head dims 16 to 256 (256 takes the smaller tiles)."""
    q, k, v = make_qkv(4, 2, lq, 70, d, dtype, seed=d)
    q_pos, k_start = layout("new-tokens", lq, k, v)
    check(q, k, v, q_pos, k_start, window=20)


@pytest.mark.parametrize("lq", [1, 130])
def test_rows_with_few_or_no_visible_keys(lq):
    """Context keys 0 .. 202, queries from 500, window 350: query i sees the 52 - i keys 151 + i .. 202, and from
    i = 52 on none (out exactly 0, lse -inf, no NaN); one tile mixes both kinds of rows."""
    q, k, v = make_qkv(4, 2, lq, LK, 32, torch.float32, seed=3)
    q_pos, k_start = layout("context", lq, k, v)
    out, lse = check(q, k, v, q_pos, k_start, window=350)
    seen = (LK - (CONTEXT_START - 350 + 1) - torch.arange(lq)).clamp(min=0)  # keys each query sees
    empty = (seen == 0).to(DEVICE)
    assert bool(empty.any()) == (lq > 52)
    assert torch.all(out[:, empty] == 0) and torch.all(lse[:, empty] == float("-inf"))
    assert torch.isfinite(lse[:, ~empty]).all() and not out.isnan().any()


@pytest.mark.parametrize("window", [None, 9])
def test_unordered_positions(window):
    """Positions need not be consecutive nor sorted: every row is masked by its own position."""
    q, k, v = make_qkv(8, 2, 37, LK, 16, torch.float32, seed=4)
    g = torch.Generator().manual_seed(4)
    q_pos = (torch.randperm(LK + 20, generator=g)[:37] + 90).to(DEVICE)  # keys at 100 .. 302: some queries come
    check(q, k, v, q_pos, 100, window)  # before key 0, some after the last key


@pytest.mark.parametrize("lq", [1, 37])
def test_unwritten_slots_are_never_read(lq):
    """New tokens in a buffer whose slots past the newest query hold NaN: the kernel reads only up to the newest
    query's slot, so the result equals the reference over the written slots (the reference itself would turn the
    NaN into NaN, as masked values still enter its product)."""
    q, k, v = make_qkv(4, 2, lq, LK, 16, torch.float32, seed=5)
    q_pos, k_start = layout("new-tokens", lq, k, v)
    k[:, lq:] = float("nan")
    v[:, lq:] = float("nan")
    out, lse = causal_attention(q, k, v, 0.25, q_pos, k_start)
    ref_out, ref_lse = reference.causal_attention(q, k[:, :lq], v[:, :lq], 0.25, q_pos, k_start)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


@pytest.mark.parametrize("lq", [1, 37])
def test_strided_inputs(lq):
    """q as a transpose of [Lq, Hq, D] (the layout of a model's projections), k/v with a strided head dim, and
    q_pos a strided view: no copies needed."""
    q, k, v = make_qkv(4, 2, lq, LK, 16, torch.float32, seed=2)
    q_pos, k_start = layout("new-tokens", lq, k, v)
    qt = torch.empty(lq, 4, 16, device=DEVICE).transpose(0, 1).copy_(q)  # [Hq, Lq, D] view of [Lq, Hq, D]
    kt, vt = (torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0] for x in (k, v))  # [Hkv, Lk, D], stride 2
    pos_t = torch.stack([q_pos, torch.zeros_like(q_pos)], dim=-1)[:, 0]
    assert qt.stride() == (16, 4 * 16, 1) and kt.stride(-1) == 2 and pos_t.stride(0) == 2
    check(qt, kt, vt, pos_t, k_start, window=30)


def test_query_dtype_follows_keys_and_int32_positions():
    """An fp32 query over fp16 keys runs in fp16 (as if q had been cast); int32 positions read like int64."""
    q, k, v = make_qkv(4, 2, 37, LK, 16, torch.float16, seed=6)
    q_pos, k_start = layout("new-tokens", 37, k, v)
    out, lse = causal_attention(q.float(), k, v, 0.25, q_pos.int(), k_start, 40)
    ref_out, ref_lse = reference.causal_attention(q, k, v, 0.25, q_pos, k_start, 40)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float16])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float16])


def test_no_keys():
    """Lk == 0: zeros and -inf without a launch."""
    q, k, v = make_qkv(4, 2, 3, 0, 16, torch.float32)
    out, lse = causal_attention(q, k, v, 0.25, torch.arange(3, device=DEVICE), 0)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all() and lse.shape == (4, 3)


def test_rejects_bad_inputs():
    q, k, v = make_qkv(4, 2, 3, LK, 16, torch.float32)
    pos = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        causal_attention(q[:3], k, v, 1.0, pos, 0)
    with pytest.raises(TypeError):
        causal_attention(q, k.half(), v, 1.0, pos, 0)  # k and v differ
    with pytest.raises(ValueError, match="head_dim"):
        causal_attention(q[..., :12], k[..., :12], v[..., :12], 1.0, pos, 0)
    with pytest.raises(ValueError, match="shape"):
        causal_attention(q, k, v[:, :100], 1.0, pos, 0)
    with pytest.raises(ValueError, match="q_pos"):
        causal_attention(q, k, v, 1.0, pos[:2], 0)
    with pytest.raises(TypeError, match="q_pos"):
        causal_attention(q, k, v, 1.0, pos.float(), 0)
    with pytest.raises(TypeError, match="q_pos"):
        causal_attention(q, k, v, 1.0, [0, 1, 2], 0)
    with pytest.raises(TypeError, match="k_start"):
        causal_attention(q, k, v, 1.0, pos, torch.tensor(0))
    with pytest.raises(ValueError, match="window"):
        causal_attention(q, k, v, 1.0, pos, 0, window=0)


# ---------------------------------------------------------------------------------------------------------- GPU ---
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# bf16: the kernel rounds probabilities to bf16 before P @ V (<= 2^-9 relative per term); scores are fp32 dots of
# the same bf16 values on both sides.
BF16 = dict(atol=2e-2, rtol=2e-2)


def realistic(hq, hkv, lq, lk, d, case, seed=0):
    """bf16 q/k/v on CUDA, q_pos [Lq] int64 and k_start in the layout of `case` (see the module docstring)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)
               for shape in ((hq, lq, d), (hkv, lk, d), (hkv, lk, d)))
    if case == "context":
        return q, k, v, lk + torch.arange(lq, device="cuda"), 0
    k_start = 5000
    k[:, lq:] = GARBAGE
    v[:, lq:] = GARBAGE
    return q, k, v, k_start + torch.arange(lq, device="cuda"), k_start


GPU_SHAPES = [(1, 4096, "context"), (1024, 4096, "context"), (1, 1024 + 64, "new-tokens"),
              (1024, 1024 + 64, "new-tokens")]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("window", [None, 512])
@pytest.mark.parametrize("lq,lk,case", GPU_SHAPES)
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (4, 1, 256)])  # a Llama-like 8B; Gemma 3 270M
def test_gpu_bf16_realistic(hq, hkv, d, lq, lk, case, window):
    q, k, v, q_pos, k_start = realistic(hq, hkv, lq, lk, d, case)
    out, lse = causal_attention(q, k, v, d**-0.5, q_pos, k_start, window)
    ref_out, ref_lse = reference.causal_attention(q, k, v, d**-0.5, q_pos, k_start, window)
    torch.testing.assert_close(out, ref_out, **BF16)
    torch.testing.assert_close(lse, ref_lse, **BF16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("lq", [1, 200])
@pytest.mark.parametrize("d", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_every_tile_fits(dtype, d, lq):
    """Every dtype and head dim compiles within the GPU's shared memory (fp32 takes half the keys per block) and
    matches the reference at the CPU tests' tolerances."""
    q, k, v = make_qkv(8, 2, lq, 1000, d, dtype, seed=d)
    q_pos, k_start = layout("new-tokens", lq, k, v)
    check(q, k, v, q_pos, k_start, window=300)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("lq", [1, 1024])
def test_gpu_no_host_sync(lq):
    q, k, v, q_pos, k_start = realistic(32, 8, lq, 1024 + 64, 128, "new-tokens")
    causal_attention(q, k, v, 0.1, q_pos, k_start, 512)  # warm-up: compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        causal_attention(q, k, v, 0.1, q_pos, k_start, 512)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("window", [None, 512])
@pytest.mark.parametrize("lq", [1, 1024])
def test_gpu_cuda_graph_replay_with_new_positions(lq, window):
    """One call captured with static q/k/v/q_pos; q and the positions changed in place, then replayed: the
    positions are read on the device at every replay (k_start is baked in, so the new positions shift the
    queries against the same keys)."""
    q, k, v, q_pos, k_start = realistic(32, 8, lq, 1024 + 64, 128, "new-tokens", seed=1)
    causal_attention(q, k, v, 0.1, q_pos, k_start, window)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = causal_attention(q, k, v, 0.1, q_pos, k_start, window)
    g = torch.Generator(device="cuda").manual_seed(2)
    for shift in (0, 37):
        q.copy_(torch.randn(q.shape, device="cuda", generator=g, dtype=q.dtype))
        q_pos.copy_(k_start + shift + torch.arange(lq, device="cuda"))
        for x in (k, v):  # the slots the shifted queries may see are written
            x[:, : lq + shift].normal_(generator=g)
        graph.replay()
        ref_out, ref_lse = reference.causal_attention(q, k, v, 0.1, q_pos, k_start, window)
        torch.testing.assert_close(out, ref_out, **BF16)
        torch.testing.assert_close(lse, ref_lse, **BF16)


@pytest.mark.parametrize("lq,hq,hkv", [(1, 8, 2), (5, 4, 2), (37, 2, 2)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_merged_with_a_prior_into_the_callers_layout(lq, hq, hkv, out_dtype):
    """With prior (another key set's attention, some rows empty) and out (the engine's [Lq, Hq, D] output in the
    model's dtype, seen as [Hq, Lq, D]): the union's attention, as the reference's causal part merged with the prior."""
    q, k, v = make_qkv(hq, hkv, lq, 64, 32, torch.float32, seed=3)
    q_pos, k_start = layout("new-tokens", lq, k, v)
    g = torch.Generator().manual_seed(7)
    prior = (torch.randn(hq, lq, 32, generator=g).to(DEVICE), (3 * torch.randn(hq, lq, generator=g)).to(DEVICE))
    prior[1][0, 0] = float("-inf")  # a row the other keys leave empty
    prior[0][0, 0] = 0.0
    scale = 32 ** -0.5
    out = torch.empty(lq, hq, 32, device=DEVICE, dtype=out_dtype)
    got, lse = causal_attention(q, k, v, scale, q_pos, k_start, None, prior=prior, out=out.transpose(0, 1))
    assert got.data_ptr() == out.data_ptr()
    own = reference.causal_attention(q, k, v, scale, q_pos, k_start, None)
    want, want_lse = merge_reference.merge_attention([prior, own])
    tol = TOL[torch.float32] if out_dtype == torch.float32 else TOL[torch.float16]
    torch.testing.assert_close(out.transpose(0, 1).float(), want, **tol)
    torch.testing.assert_close(lse, want_lse, **TOL[torch.float32])
    ref_out = torch.empty_like(out)
    reference.causal_attention(q, k, v, scale, q_pos, k_start, None, prior=prior, out=ref_out.transpose(0, 1))
    torch.testing.assert_close(ref_out.float(), out.float(), **tol)
