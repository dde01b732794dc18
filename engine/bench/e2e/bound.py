"""The byte bound of a decode step: the bytes it must read (the weights, the global layers' fixed K/V times the step's
KV budget, the sliding windows, the turn's new K/V) over the measured copy bandwidth."""

from __future__ import annotations

import statistics
import time

import torch

from engine.model.load import LoadedModel

MiB = 1 << 20

CPU_COPY_BYTES = 64 * MiB  # the CPU's copy bandwidth is timed on smaller buffers than the GPU's 1 GiB

COPY_REPEATS = 5

def copy_bandwidth(device: torch.device) -> float:
    """Device copy bandwidth in GB/s (bytes read + written per second): on CUDA the kernel benchmark's (1 GiB,
    triton's do_bench median); on the CPU the median of COPY_REPEATS copies of CPU_COPY_BYTES."""
    if device.type == "cuda":
        from engine.bench.kernels import copy_bandwidth as cuda_copy_bandwidth

        return cuda_copy_bandwidth(device)
    src = torch.ones(CPU_COPY_BYTES // 2, dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages
    seconds = []
    for _ in range(COPY_REPEATS):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    return 2 * CPU_COPY_BYTES / statistics.median(seconds) / 1e9

def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter once (tied ones once), but of the input embedding
    table only one row, unless it is also the output projection."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields a tied one once
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        total -= (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()
    return total

def byte_bound(lm: LoadedModel, fixed_len: int, new_tokens: float) -> dict:
    """What a decode step reads besides the global layers' fixed context, and that context's dense K/V bytes.

    new_tokens: the turn's new tokens a timed decode step attends to, on average (question + answer so far)."""
    itemsize = torch.empty((), dtype=lm.dtype).element_size()
    per_token = lm.num_kv_heads * 2 * lm.head_dim * itemsize  # one token's K and V in one layer
    windows = lm.sliding_windows
    return {
        "weight_bytes": weight_bytes(lm.model),
        "global_fixed_kv_bytes": len(lm.global_layers) * fixed_len * per_token,  # x the step's KV budget
        "sliding_window_kv_bytes": sum(min(w, fixed_len) for w in windows if w is not None) * per_token,
        "new_kv_bytes": round(len(windows) * new_tokens * per_token),
    }

def bound_ms(bound: dict, kv_budget: float, bandwidth_gbs: float) -> float:
    """Milliseconds to read a step's bytes at the copy bandwidth: weights + kv_budget x the global layers' fixed K/V
    (index bytes included in the budget) + the sliding windows + the new tokens' K/V."""
    read = (bound["weight_bytes"] + kv_budget * bound["global_fixed_kv_bytes"] + bound["sliding_window_kv_bytes"]
            + bound["new_kv_bytes"])
    return read / (bandwidth_gbs * 1e9) * 1e3
