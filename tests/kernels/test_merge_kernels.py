"""kernels.merge_ops.merge_attention (Triton, two parts) against kernels.reference.merge_attention.

The parts are partial attentions over disjoint key sets: (out fp32 [H, L, D], lse [H, L]); an empty part has lse
-inf. The kernel may write into the caller's tensor (the engine's [Lq, Hq, D] output in the model's dtype, seen as
[Hq, Lq, D]). Without CUDA the kernel runs in the Triton interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels import merge_ops
from kernels.reference import merge as reference

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: the same formula in another order (exp of differences vs logsumexp): ~1e-7 observed.
F32 = dict(atol=1e-5, rtol=1e-5)
# A 16-bit destination rounds the merged value once: half an ulp of fp16 (2^-11) or bf16 (2^-8) relative.
OUT_TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def parts(h: int, lq: int, d: int, seed: int = 0):
    """Two parts with an empty row in each and a row empty in both (out 0, lse -inf there, as the kernels give)."""
    g = torch.Generator().manual_seed(seed)
    out_a, out_b = torch.randn(h, lq, d, generator=g), torch.randn(h, lq, d, generator=g)
    lse_a, lse_b = 3 * torch.randn(h, lq, generator=g), 3 * torch.randn(h, lq, generator=g)
    lse_a[0, 0] = float("-inf")
    lse_b[-1, -1] = float("-inf")
    if lq > 1:
        lse_a[0, 1] = lse_b[0, 1] = float("-inf")
        out_a[0, 1] = out_b[0, 1] = 0.0
    return [(t.to(DEVICE), u.to(DEVICE)) for t, u in ((out_a, lse_a), (out_b, lse_b))]


@pytest.mark.parametrize("h,lq,d", [(4, 1, 16), (8, 3, 64), (3, 37, 256)])
def test_matches_reference(h, lq, d):
    p = parts(h, lq, d)
    want_out, want_lse = reference.merge_attention(p)
    out, lse = merge_ops.merge_attention(p)
    torch.testing.assert_close(out, want_out, **F32)
    torch.testing.assert_close(lse, want_lse, **F32)
    assert torch.isneginf(lse[0, min(1, lq - 1)]) == (lq > 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_writes_into_the_callers_layout(dtype):
    """Into a [Lq, H, D] buffer of the model's dtype seen as [H, Lq, D] (strided), as the engine's attention does."""
    h, lq, d = 4, 5, 32
    p = parts(h, lq, d, seed=1)
    want_out, _ = reference.merge_attention(p)
    buf = torch.full((lq, h, d), 7.0, dtype=dtype, device=DEVICE)
    out, _ = merge_ops.merge_attention(p, buf.transpose(0, 1))
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf.transpose(0, 1).float(), want_out, **OUT_TOL.get(dtype, F32))


def test_reference_writes_into_out_too():
    p = parts(2, 3, 16, seed=2)
    want_out, want_lse = reference.merge_attention(p)
    buf = torch.empty(3, 2, 16, device=DEVICE)
    out, lse = reference.merge_attention(p, buf.transpose(0, 1))
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf.transpose(0, 1), want_out, **F32)
    torch.testing.assert_close(lse, want_lse, **F32)


def test_other_part_counts_go_to_the_reference():
    p = parts(2, 3, 16, seed=3)
    three = p + [parts(2, 3, 16, seed=4)[0]]
    for case in (p[:1], three):
        want_out, want_lse = reference.merge_attention(case)
        out, lse = merge_ops.merge_attention(case)
        torch.testing.assert_close(out, want_out, **F32)
        torch.testing.assert_close(lse, want_lse, **F32)


def test_rejects_a_mismatched_destination():
    p = parts(2, 3, 16)
    with pytest.raises(ValueError, match="out must be"):
        merge_ops.merge_attention(p, torch.empty(2, 3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="parts disagree"):
        merge_ops.merge_attention([p[0], (p[1][0][:, :2], p[1][1][:, :2])])
