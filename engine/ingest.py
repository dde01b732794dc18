"""Ingest: chunked prefill of the fixed context, then the asked methods' indexes and calibrations, as named
tensors (engine.artifacts names them). `build_methods` also builds a method later, from a stored context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import artifacts as names
from engine.attention import QueryCapture, StepContext
from engine.config import ContextSettings
from engine.fixed_cache import FixedContextCache, FixedContextLayer
from engine.fixed_rows import FixedRows
from engine.kmeans import query_moment
from engine.model import LoadedModel
from engine.policies import CalibrationSet, LayerIndex, LayerKeys, Method, StepPlan, Tensors, make_method
from engine.policies.budget import budget_curves
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
    """artifacts: name -> tensor, ready for storage (engine.artifacts); tokens: fixed-context length; rows: which
    token each row of a global layer's K/V holds."""

    artifacts: dict[str, torch.Tensor]
    tokens: int
    rows: FixedRows


def prefill(lm: LoadedModel, ids: torch.Tensor, calibration: int, backend: Backend,
            progress: Progress = _no_progress, chunk: int = PREFILL_CHUNK) -> tuple[FixedContextCache, QueryCapture]:
    """Run the fixed context through the model in chunks. ids: [L] int64.

    Returns the cache (fixed K/V of every layer, sliding layers trimmed to their window) and the captured queries
    of the last `calibration` positions at the global layers, with the sums of every position's unit query outer
    products (QueryCapture.moment).
    """
    total = ids.numel()
    cache = FixedContextCache.empty(lm.sliding_windows, capacity=total)  # global layers' K/V allocated once
    capture = QueryCapture(start=max(0, total - calibration), queries={}, moments={})
    step = StepContext(cache=cache, method=make_method("full"), plan=StepPlan(1.0), backend=backend, capture=capture)
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


def kv_artifacts(layer_idx: int, layer: FixedContextLayer) -> dict[str, torch.Tensor]:
    """A layer's fixed K/V as artifacts: `layer{i}.keys` / `.values` [Hkv, Lkept, D]."""
    return {names.layer_name(layer_idx, "keys"): layer.fixed_keys, names.layer_name(layer_idx, "values"): layer.fixed_values}


def build_methods(keys: dict[int, torch.Tensor], queries: dict[int, torch.Tensor], tail: int, methods: list[Method],
                  scale: float, device: torch.device, progress: Progress = _no_progress, on_artifact: OnArtifact = _no_artifact,
                  before_layer: Callable[[int], None] | None = None, prepared: dict[str, Tensors] | None = None,
                  required: dict[str, dict[int, Tensors]] | None = None, first: int = 0,
                  moments: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each method's index of every global layer, then its calibration, as named artifacts.

    keys: global layer -> its fixed keys [Hkv, L, D] (rows as engine.fixed_rows arranges them: the indexed tokens in
    order, then `tail` dense rows);
    queries: global layer -> its calibration queries [Hq, n, D]; methods: in build order (each after what it
    requires: engine.policies.build_order); scale: the layers' softmax scale; device: where the calibrations run
    (one pools every global layer: with device_map="auto" the layers sit on several GPUs); prepared: method -> its model-level artifacts (`layer{i}.{name}`);
    required: indexes built before (method -> global layer -> artifacts) that `methods` may require (not made again);
    first: the position of the first indexed token (the context's sink rows come after the indexed ones);
    moments: global layer -> the second moment of the context's unit queries [Hkv, D, D] (QueryCapture.moment), for
    a query-aware clustering; a layer without one gets its calibration queries' (engine.kmeans.query_moment).
    Each artifact goes to `on_artifact` when made (a layer's indexes after its layer, calibrations at the end);
    `before_layer(i)` runs before layer i is indexed (the ingest saves its K/V then, overlapping the next layers).
    """
    prepared = prepared or {}
    out: dict[str, torch.Tensor] = {}
    built: dict[str, dict[int, Tensors]] = {**(required or {}), **{m.name: {} for m in methods}}
    layers = sorted(keys)
    for n, layer_idx in enumerate(layers):
        progress("clustering", n, len(layers))
        if before_layer is not None:
            before_layer(layer_idx)
        full = keys[layer_idx]
        moment = (moments or {}).get(layer_idx)
        if moment is None and layer_idx in queries:
            moment = query_moment(queries[layer_idx], full.shape[0])
        layer = LayerKeys(layer_idx=layer_idx, keys=full[:, : full.shape[1] - tail], tail=tail, first=first,
                          query_moment=None if moment is None else moment.to(full.device))
        for method in methods:
            missing = [r for r in method.requires if r not in built]
            if missing:
                raise ValueError(f"{method.name} requires {', '.join(missing)} to be built with it")
            required = {r: built[r][layer_idx] for r in method.requires}
            mine = layer_part(prepared.get(method.name, {}), layer_idx)
            index = method.build(layer, required, mine)
            built[method.name][layer_idx] = index
            for name, t in index.items():
                full_name = names.method_layer_name(method.name, layer_idx, name)
                out[full_name] = t
                on_artifact(full_name, t)
    progress("clustering", len(layers), len(layers))
    progress("calibrating", 0, len(methods))
    for n, method in enumerate(methods):
        own = prepared.get(method.name, {})  # a lookup sees its layer's model-level artifacts too (as in a session,
        # the index's own copy of one winning: saap's b2 with the document's bucket sizes, its chunks' columns)
        sets = [CalibrationSet(index=LayerIndex(tensors={k: t.to(device) for k, t in
                                                         {**layer_part(own, i), **built[method.name][i]}.items()},
                                                num_keys=keys[i].shape[1], tail=tail),
                               queries=queries[i].to(device)) for i in layers]
        calibration = method.calibrate(sets, scale)
        if "budget_decode" not in calibration:  # what a budget reads (Method.plan), unless the method knows it exactly
            calibration.update(budget_curves(method, sets, scale, calibration))
        for name, t in calibration.items():
            full_name = names.method_calib_name(method.name, name)
            out[full_name] = t
            on_artifact(full_name, t)
        progress("calibrating", n + 1, len(methods))
    return out


def layer_part(artifacts: Tensors, layer_idx: int) -> Tensors:
    """The `layer{i}.` artifacts of one layer (e.g. a method's model-level ones), by their short names."""
    out = {}
    for name, t in artifacts.items():
        parsed = names.split_layer(name)
        if parsed is not None and parsed[0] == layer_idx:
            out[parsed[1]] = t
    return out


def ingest_tokens(lm: LoadedModel, ids: torch.Tensor, settings: ContextSettings, backend: Backend,
                  methods: list[Method] | None = None, progress: Progress = _no_progress,
                  on_artifact: OnArtifact = _no_artifact, prepared: dict[str, Tensors] | None = None) -> IngestOutput:
    """From token ids to a context's artifacts: per layer `layer{i}.keys` / `.values` [Hkv, Lkept, D], per global
    layer `.calib_queries` [Hq, n, D] (the queries of the last n = settings.calibration tokens) and `.query_moment`
    [Hkv, D, D] (the second moment of every position's unit queries: engine.kmeans.query_moment), and the indexes and
    calibrations of `methods` (in build order; engine.policies.build_order; None: none, a context that full
    attention reads).

    on_artifact: called once per artifact as soon as it is final, so that a caller can save it while the rest is
    made (engine.serve.writer): `tokens` and the sliding layers' K/V right after the prefill, each global layer's K/V
    before its indexing and its indexes after, the calibrations last. The tensor must not be modified by the callee."""
    rows = settings.rows(ids.numel())
    cache, capture = prefill(lm, ids, settings.calibration, backend, progress)
    with torch.inference_mode():  # the cache's tensors are inference tensors
        for i in lm.global_layers:  # the sink's rows after the indexed ones (engine.fixed_rows)
            rows.arrange(cache.layers[i].fixed_keys)
            rows.arrange(cache.layers[i].fixed_values)
    artifacts: dict[str, torch.Tensor] = {names.TOKENS: ids.cpu()}
    on_artifact(names.TOKENS, artifacts[names.TOKENS])
    for i, layer in enumerate(cache.layers):
        made = kv_artifacts(i, layer)
        if i not in lm.global_layers:  # the global layers' go over one before each layer's indexing
            for name, t in made.items():
                on_artifact(name, t)
        artifacts.update(made)
    queries = {i: torch.cat(capture.queries[i], dim=1) for i in lm.global_layers}  # [Hq, n, D]
    moments = {i: capture.moment(i, cache.layers[i].fixed_keys.shape[0]) for i in lm.global_layers}  # [Hkv, D, D]

    def hand_over(layer_idx: int) -> None:
        for name, t in kv_artifacts(layer_idx, cache.layers[layer_idx]).items():
            on_artifact(name, t)
        for name, t in ((names.CALIB_QUERIES, queries[layer_idx]), (names.QUERY_MOMENT, moments[layer_idx])):
            artifacts[names.layer_name(layer_idx, name)] = t
            on_artifact(names.layer_name(layer_idx, name), t)

    keys = {i: cache.layers[i].fixed_keys for i in lm.global_layers}
    scale = global_scale(lm)
    artifacts.update(build_methods(keys, queries, rows.dense, methods or [], scale, lm.device, progress, on_artifact,
                                   hand_over, prepared, first=rows.sink, moments=moments))
    return IngestOutput(artifacts=artifacts, tokens=ids.numel(), rows=rows)
