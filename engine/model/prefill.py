"""The model over a fixed context's tokens: the chunked prefill every ingest runs (full attention, each layer's K/V
kept, the calibration queries captured), shared with what methods learn per model (Saap's partitions), and the
softmax scale of a layer's attention."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.cache import FixedContextCache
from engine.attention.function import QueryCapture, StepContext
from engine.model.load import LoadedModel
from kernels.backend import Backend

PREFILL_CHUNK = 1024  # context tokens per forward call of the prefill
Progress = Callable[[str, int, int], None]  # (stage, done, total)


def no_progress(stage: str, done: int, total: int) -> None:
    return None


def prefill(lm: LoadedModel, ids: torch.Tensor, calibration: int, backend: Backend,
            progress: Progress = no_progress, chunk: int = PREFILL_CHUNK) -> tuple[FixedContextCache, QueryCapture]:
    """Run the fixed context through the model in chunks. ids: [L] int64.

    Returns the cache (fixed K/V of every layer, sliding layers trimmed to their window) and the captured queries
    of the last `calibration` positions at the global layers, with the sums of every position's unit query outer
    products (QueryCapture.moment).
    """
    total = ids.numel()
    cache = FixedContextCache.empty(lm.sliding_windows, capacity=total)  # global layers' K/V allocated once
    capture = QueryCapture(start=max(0, total - calibration), queries={}, moments={})
    step = StepContext(cache=cache, method=None, plan=None, backend=backend, capture=capture)  # dense
    progress("prefill", 0, total)
    with torch.inference_mode():
        for start in range(0, total, chunk):
            piece = ids[start : start + chunk].to(lm.device)
            step.positions = torch.arange(start, start + piece.numel(), device=lm.device)
            lm.model(input_ids=piece[None], position_ids=step.positions[None], past_key_values=cache, use_cache=True,
                     logits_to_keep=1, squeeze_step=step)
            cache.commit()
            progress("prefill", min(start + chunk, total), total)
    cache.release_new()
    return cache, capture


def attention_scale(lm: LoadedModel, layer_idx: int) -> float:
    """The softmax scale of a layer's attention (Gemma uses query_pre_attn_scalar, most models 1/sqrt(head_dim))."""
    for module in lm.model.get_decoder().layers[layer_idx].modules():
        if hasattr(module, "scaling") and getattr(module, "layer_idx", None) == layer_idx:
            return float(module.scaling)
    return lm.head_dim ** -0.5


def global_scale(lm: LoadedModel) -> float:
    """The softmax scale of the global layers (the calibrations pool them)."""
    return attention_scale(lm, lm.global_layers[0]) if lm.global_layers else 1.0
