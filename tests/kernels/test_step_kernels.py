"""The small kernels of a decode step against their references: kernels.append_ops.append_tokens (a call's new K/V
written at a device-side count; append_tokens_batch, a batched step's in one launch) and kernels.tally_ops.tally_step
(a lookup's statistics added into a turn's sums).

Both move data without arithmetic beyond integer counts, float sums of a few hundred integers and maxima, so they
must agree with the references exactly. Without CUDA the kernels run in the Triton interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels import append_ops, tally_ops
from kernels.reference import append as append_reference
from kernels.reference import tally as tally_reference

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def buffers(hkv: int, cap: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(hkv, cap, d, generator=g).to(DEVICE, dtype) for _ in range(2))


@pytest.mark.parametrize("hkv,n,d,start", [(8, 1, 128, 0), (2, 5, 16, 3), (1, 64, 256, 10), (4, 300, 32, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_append_tokens_matches_reference(hkv, n, d, start, dtype):
    """Writes at the count, converts to the buffers' dtype, advances the count; strided inputs (the model's
    [1, Hkv, n, D] states, transposed) and calls past one program's rows (the reference's path) alike."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(n, hkv, d, generator=g).to(DEVICE).transpose(0, 1)  # [Hkv, n, D], strided as the model's
    v = torch.randn(n, hkv, d, generator=g).to(DEVICE).transpose(0, 1)
    cap = start + n + 7
    ours, theirs = buffers(hkv, cap, d, dtype, 2), buffers(hkv, cap, d, dtype, 2)
    count_ours = torch.tensor([start], device=DEVICE)
    count_theirs = count_ours.clone()
    append_ops.append_tokens(k, v, *ours, count_ours)
    append_reference.append_tokens(k, v, *theirs, count_theirs)
    assert count_ours.item() == count_theirs.item() == start + n
    torch.testing.assert_close(ours[0], theirs[0], atol=0, rtol=0)
    torch.testing.assert_close(ours[1], theirs[1], atol=0, rtol=0)
    torch.testing.assert_close(ours[0][:, start : start + n], k.to(dtype), atol=0, rtol=0)


def test_append_tokens_twice_continues_at_the_count():
    k, v = (torch.randn(2, 3, 16, device=DEVICE) for _ in range(2))
    kb, vb = torch.zeros(2, 8, 16, device=DEVICE), torch.zeros(2, 8, 16, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    append_ops.append_tokens(k, v, kb, vb, count)
    append_ops.append_tokens(v, k, kb, vb, count)
    assert count.item() == 6
    torch.testing.assert_close(kb[:, 3:6], v, atol=0, rtol=0)
    torch.testing.assert_close(vb[:, :3], v, atol=0, rtol=0)



@pytest.mark.parametrize("n,d", [(1, 128), (3, 16), (1, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_batch_of_appends_in_one_launch_writes_each_sequence_as_alone(n, d, dtype):
    """append_tokens_batch: row b of the step's [B, Hkv, n, D] states into sequence b's buffers of a capacity of its
    own, at its own count (one launch reading the buffers' addresses and strides from tables), equal to an
    append_tokens per sequence; a sequence too long for one program sends the whole batch to the reference."""
    g = torch.Generator().manual_seed(n * d)
    hkv, starts, caps = 2, [0, 5, 2], [8, 64, 16]
    k = torch.randn(3, n, hkv, d, generator=g).to(DEVICE).transpose(1, 2)  # [B, Hkv, n, D], strided as the model's
    v = torch.randn(3, n, hkv, d, generator=g).to(DEVICE).transpose(1, 2)
    ours = [buffers(hkv, cap, d, dtype, b) for b, cap in enumerate(caps)]
    alone = [tuple(t.clone() for t in pair) for pair in ours]
    counts = [torch.tensor([s], device=DEVICE) for s in starts]
    counts_alone = [c.clone() for c in counts]
    append_ops.append_tokens_batch(k, v, [p[0] for p in ours], [p[1] for p in ours], counts, keep=[])
    for b in range(3):
        append_ops.append_tokens(k[b], v[b], *alone[b], counts_alone[b])
        assert counts[b].item() == counts_alone[b].item() == starts[b] + n
        torch.testing.assert_close(ours[b][0], alone[b][0], atol=0, rtol=0)
        torch.testing.assert_close(ours[b][1], alone[b][1], atol=0, rtol=0)
        torch.testing.assert_close(ours[b][1][:, starts[b] : starts[b] + n], v[b].to(dtype), atol=0, rtol=0)
    one = buffers(hkv, 8, d, dtype, 7)
    count = torch.tensor([1], device=DEVICE)
    append_ops.append_tokens_batch(k[:1], v[:1], [one[0]], [one[1]], [count])  # a batch of one: a lone launch
    assert count.item() == 1 + n
    torch.testing.assert_close(one[0][:, 1 : 1 + n], k[0].to(dtype), atol=0, rtol=0)
    big = torch.randn(2, hkv, append_ops.MAX_ROWS, d, device=DEVICE)
    bufs = [buffers(hkv, append_ops.MAX_ROWS, d, torch.float32, 9 + b) for b in range(2)]
    counts = [torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(2)]
    append_ops.append_tokens_batch(big, big, [p[0] for p in bufs], [p[1] for p in bufs], counts)
    assert [c.item() for c in counts] == [append_ops.MAX_ROWS] * 2
    torch.testing.assert_close(bufs[1][0], big[1], atol=0, rtol=0)


def tally_case(rows: int, units: int, follow: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 500, (rows,), generator=g)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(DEVICE)
    elements = torch.randint(0, 9000, (rows,), generator=g).float().to(DEVICE)
    fresh = (torch.rand(rows, follow, generator=g) < 0.3).to(DEVICE) if follow else None
    scores = torch.randn(rows, units, generator=g).to(DEVICE) if units else None
    return indptr, elements, fresh, scores


@pytest.mark.parametrize("rows,units,follow", [(8, 6554, 40), (1, 3, 0), (4, 0, 7), (32, 2049, 130)])
def test_tally_step_matches_reference(rows, units, follow):
    """Three steps into the same sums: kept keys per row (with the fresh follow rows), index elements read, the
    units' running maximum (rows of a [layers, heads] sum, as the recorder passes them)."""
    sums = [(torch.zeros(3, rows + 2, device=DEVICE), torch.zeros(3, device=DEVICE),
             torch.full((rows, units), float("-inf"), device=DEVICE) if units else None) for _ in range(2)]
    for step in range(3):
        indptr, elements, fresh, scores = tally_case(rows, units, follow, step)
        for fn, (kept, read, best) in zip((tally_ops.tally_step, tally_reference.tally_step), sums):
            fn(indptr, elements, kept[1, :rows], read[1:2], fresh, scores, best)
    (kept_a, read_a, best_a), (kept_b, read_b, best_b) = sums
    torch.testing.assert_close(kept_a, kept_b, atol=0, rtol=0)
    torch.testing.assert_close(read_a, read_b, atol=0, rtol=0)
    assert kept_a[1, :rows].sum() > 0 and kept_a[0].abs().sum() == 0 and kept_a[1, rows:].abs().sum() == 0
    if units:
        torch.testing.assert_close(best_a, best_b, atol=0, rtol=0)
