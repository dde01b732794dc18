"""From captured keys to the benchmark's shapes: longer contexts and more heads, keeping real key statistics.

How: a captured source is one global layer's KV head (Gemma 3 270M: 3 global layers x 1 KV head of dimension 256).
Each source is cut into its two halves of 128 dimensions (the rotate-half RoPE pairs dimension i with i + 128,
so each half keeps one of the two coordinates of every rotating pair; the two halves behave as two heads with
their own attention), giving 2S sources of dimension 128. The context is lengthened by repeating the captured
sequence, each repetition rotated by RoPE to the positions it occupies (so a repeated key is the key the same
content would have there); KV head h takes source h mod 2S, and heads that share a source start their context
(h div 2S) x N/2 positions further from the queries, so that they attend differently. Queries are the captured
last queries, rotated to sit right after the lengthened context.
"""

from __future__ import annotations

import torch


def rope_shift(x: torch.Tensor, delta: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate rotate-half RoPE vectors by `delta` extra positions.

    x: [..., N, D] (D even, pairs (i, i + D/2)); delta: [N] positions to add. Returns float32 [..., N, D].
    """
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)  # [D/2]
    angle = delta.double()[:, None] * inv_freq[None, :]  # [N, D/2]
    cos, sin = torch.cos(angle).float(), torch.sin(angle).float()
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _repeat_rotated(x: torch.Tensor, length: int, theta: float, offset: int = 0) -> torch.Tensor:
    """x: [S, N, D] at positions 0..N-1 -> [S, length, D]: repetitions at positions N, 2N, ..., all moved
    `offset` positions back (further from queries placed after `length`)."""
    n = x.shape[1]
    pieces = []
    for start in range(0, length, n):
        take = min(n, length - start)
        pieces.append(rope_shift(x[:, :take], torch.full((take,), float(start - offset), device=x.device), theta))
    return torch.cat(pieces, dim=1)


def _halves(x: torch.Tensor, d: int) -> torch.Tensor:
    """[S, ..., 2d] -> [2S, ..., d]: each source's two halves as two sources."""
    return torch.cat([x[..., :d], x[..., d:]], dim=0) if x.shape[-1] == 2 * d else x


def extend(captured: dict[str, torch.Tensor], length: int, hkv: int, hq: int, lq: int, d: int = 128,
           dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda"):
    """Benchmark tensors from a capture (see engine.bench.capture).

    Returns q [Hq, lq, d], k, v [Hkv, length, d] in `dtype` on `device`; query head j reads KV head j // (Hq // Hkv)
    and is the captured query head j mod G' of that KV head's source (G' = captured query heads per source).
    """
    theta, n = float(captured["meta"][0]), int(captured["meta"][1])
    keys = captured["keys"].to(device)  # [S, N, Dc]
    values = captured["values"].to(device)
    queries = captured["queries"].to(device)  # [S, Gc, Q, Dc]
    q_count = queries.shape[2]
    v_src = _halves(values.float().repeat(1, -(-length // n), 1)[:, :length], d)
    # Queries: the last lq captured queries (repeated backwards if more are asked), placed after the context.
    reps = -(-lq // q_count)
    q_seq = torch.cat([rope_shift(queries, torch.full((q_count,), float(-(reps - 1 - r) * q_count), device=device), theta)
                       for r in range(reps)], dim=2)[:, :, -lq:]  # [S, Gc, lq, Dc] at positions n - lq .. n - 1
    q_src = _halves(rope_shift(q_seq, torch.full((lq,), float(length - n), device=device), theta), d)  # [S', Gc, lq, d]
    sources = v_src.shape[0]
    group, gc = hq // hkv, q_src.shape[1]
    k = torch.empty(hkv, length, d, dtype=dtype, device=device)
    v = torch.empty_like(k)
    q = torch.empty(hq, lq, d, dtype=dtype, device=device)
    k_by_offset: dict[int, torch.Tensor] = {}
    for h in range(hkv):
        s, offset = h % sources, (h // sources) * (n // 2)
        if offset not in k_by_offset:
            k_by_offset[offset] = _halves(_repeat_rotated(keys, length, theta, offset), d)  # [S', length, d]
        k[h] = k_by_offset[offset][s].to(dtype)
        v[h] = v_src[s].to(dtype)
        for j in range(group):
            q[h * group + j] = q_src[s, j % gc].to(dtype)
    return q, k, v
