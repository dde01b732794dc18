"""Ingest: chunked prefill of the fixed context, then each method's index and calibration, as named tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.attention import QueryCapture, StepContext
from engine.config import IndexSettings
from engine.fixed_cache import FixedContextCache, FixedContextLayer
from engine.model import LoadedModel
from engine.policies import POLICIES, CalibrationSet, get_policy
from kernels.backend import Backend

PREFILL_CHUNK = 1024  # context tokens per forward call of the prefill
Progress = Callable[[str, int, int], None]  # (stage, done, total)
OnArtifact = Callable[[str, torch.Tensor], None]  # (name, tensor): called once per artifact as soon as it is final


def _no_progress(stage: str, done: int, total: int) -> None:
    return None


def _no_artifact(name: str, tensor: torch.Tensor) -> None:
    return None


@dataclass
class IngestOutput:
    """artifacts: name -> tensor, ready for storage (see `artifact names` below); tokens: fixed-context length."""

    artifacts: dict[str, torch.Tensor]
    tokens: int
    dense_tail: int


def effective_settings(settings: IndexSettings, tokens: int) -> IndexSettings:
    """The dense tail cannot cover the whole context: keep at least one clustered key."""
    if tokens < 2:
        raise ValueError(f"the document has {tokens} token(s); at least 2 are needed")
    return replace(settings, dense_tail=min(settings.dense_tail, tokens - 1))


def prefill(lm: LoadedModel, ids: torch.Tensor, settings: IndexSettings, backend: Backend,
            progress: Progress = _no_progress, chunk: int = PREFILL_CHUNK) -> tuple[FixedContextCache, QueryCapture]:
    """Run the fixed context through the model in chunks. ids: [L] int64.

    Returns the cache (fixed K/V of every layer, sliding layers trimmed to their window) and the captured queries
    of the last `settings.dense_tail` positions at the global layers.
    """
    total = ids.numel()
    cache = FixedContextCache.empty(lm.sliding_windows, capacity=total)  # global layers' K/V allocated once
    capture = QueryCapture(start=total - settings.dense_tail, queries={})
    step = StepContext(cache=cache, policy=get_policy("full"), thresholds=(), settings=settings, backend=backend, capture=capture)
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


def kv_artifacts(layer_idx: int, layer: FixedContextLayer) -> dict[str, torch.Tensor]:
    """A layer's fixed K/V as artifacts: `layer{i}.keys` / `.values` [Hkv, Lkept, D]."""
    return {f"layer{layer_idx}.keys": layer.fixed_keys, f"layer{layer_idx}.values": layer.fixed_values}


def build_indexes(lm: LoadedModel, cache: FixedContextCache, capture: QueryCapture, settings: IndexSettings,
                  progress: Progress = _no_progress, on_artifact: OnArtifact = _no_artifact) -> dict[str, torch.Tensor]:
    """Every sparse method's index per global layer, then their calibrations. Returns the index and calibration
    artifacts by name, each handed to `on_artifact` when made (a layer's index after its clustering, the
    calibrations at the end); each global layer's K/V are handed over just before its clustering, so that saving
    them overlaps the next layers' clustering."""
    artifacts: dict[str, torch.Tensor] = {}
    sets: list[CalibrationSet] = []
    global_layers = lm.global_layers
    for n, layer_idx in enumerate(global_layers):
        progress("clustering", n, len(global_layers))
        layer = cache.layers[layer_idx]
        for name, t in kv_artifacts(layer_idx, layer).items():
            on_artifact(name, t)
        clustered = layer.fixed_keys[:, : layer.fixed_len - settings.dense_tail]  # [Hkv, Lc, D]
        index: dict[str, torch.Tensor] = {}
        for policy in POLICIES.values():
            index.update(policy.build(clustered, settings, index))
        queries = torch.cat(capture.queries[layer_idx], dim=1)  # [Hq, dense_tail, D]
        # one threshold pools every global layer's scores: with device_map="auto" the layers sit on several GPUs
        sets.append(CalibrationSet(index={k: t.to(lm.device) for k, t in index.items()}, queries=queries.to(lm.device)))
        made = {f"layer{layer_idx}.{name}": t for name, t in index.items()}
        made[f"layer{layer_idx}.calib_queries"] = queries
        for name, t in made.items():
            on_artifact(name, t)
        artifacts.update(made)
    progress("clustering", len(global_layers), len(global_layers))
    progress("calibrating", 0, 1)
    scale = attention_scale(lm, global_layers[0]) if global_layers else 1.0
    for policy in POLICIES.values():
        for name, t in policy.calibrate(sets, scale, settings).items():
            artifacts[f"calib.{policy.name}.{name}"] = t
            on_artifact(f"calib.{policy.name}.{name}", t)
    progress("calibrating", 1, 1)
    return artifacts


def ingest_tokens(lm: LoadedModel, ids: torch.Tensor, settings: IndexSettings, backend: Backend,
                  progress: Progress = _no_progress, on_artifact: OnArtifact = _no_artifact) -> IngestOutput:
    """From token ids to every artifact of a context: per layer `layer{i}.keys` / `.values` [Hkv, Lkept, D],
    per global layer the methods' index tensors and `.calib_queries` [Hq, tail, D], and `calib.{method}.{name}`.

    on_artifact: called once per artifact as soon as it is final, so that a caller can save it while the rest is
    made (engine.writer): `tokens` and the sliding layers' K/V right after the prefill, each global layer's K/V
    before its clustering and its index after, the calibrations last. The tensor must not be modified by the callee."""
    settings = effective_settings(settings, ids.numel())
    cache, capture = prefill(lm, ids, settings, backend, progress)
    artifacts: dict[str, torch.Tensor] = {"tokens": ids.cpu()}
    on_artifact("tokens", artifacts["tokens"])
    for i, layer in enumerate(cache.layers):
        made = kv_artifacts(i, layer)
        if i not in lm.global_layers:  # build_indexes hands the global layers' over, one before each clustering
            for name, t in made.items():
                on_artifact(name, t)
        artifacts.update(made)
    artifacts.update(build_indexes(lm, cache, capture, settings, progress, on_artifact))
    return IngestOutput(artifacts=artifacts, tokens=ids.numel(), dense_tail=settings.dense_tail)
