"""Ingest: chunked prefill of the fixed context, then the asked methods' indexes and calibrations, as named
tensors (engine.index.artifacts names them). `build_methods` also builds a method later, from a stored context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.cache import FixedContextLayer
from engine.attention.curves import budget_curves
from engine.attention.method import CalibrationSet, LayerIndex, LayerKeys, Method, Tensors
from engine.attention.rows import FixedRows
from engine.context.settings import ContextSettings
from engine.index import artifacts as names
from engine.index.kmeans import query_moment
from engine.model.load import LoadedModel
from engine.model.prefill import Progress, global_scale, no_progress, prefill
from kernels.backend import Backend

OnArtifact = Callable[[str, torch.Tensor], None]  # (name, tensor): called once per artifact as soon as it is final


def _no_artifact(name: str, tensor: torch.Tensor) -> None:
    return None


@dataclass
class IngestOutput:
    """artifacts: name -> tensor, ready for storage (engine.index.artifacts); tokens: fixed-context length; rows: which
    token each row of a global layer's K/V holds."""

    artifacts: dict[str, torch.Tensor]
    tokens: int
    rows: FixedRows


def kv_artifacts(layer_idx: int, layer: FixedContextLayer) -> dict[str, torch.Tensor]:
    """A layer's fixed K/V as artifacts: `layer{i}.keys` / `.values` [Hkv, Lkept, D]."""
    return {names.layer_name(layer_idx, "keys"): layer.fixed_keys, names.layer_name(layer_idx, "values"): layer.fixed_values}


def build_methods(keys: dict[int, torch.Tensor], queries: dict[int, torch.Tensor], tail: int, methods: list[Method],
                  scale: float, device: torch.device, progress: Progress = no_progress, on_artifact: OnArtifact = _no_artifact,
                  before_layer: Callable[[int], None] | None = None, prepared: dict[str, Tensors] | None = None,
                  required: dict[str, dict[int, Tensors]] | None = None, first: int = 0,
                  moments: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each method's index of every global layer, then its calibration, as named artifacts.

    keys: global layer -> its fixed keys [Hkv, L, D] (rows as engine.attention.rows arranges them: the indexed tokens in
    order, then `tail` dense rows);
    queries: global layer -> its calibration queries [Hq, n, D]; methods: in build order (each after what it
    requires: engine.methods.build_order); scale: the layers' softmax scale; device: where the calibrations run
    (one pools every global layer: with device_map="auto" the layers sit on several GPUs); prepared: method -> its model-level artifacts (`layer{i}.{name}`);
    required: indexes built before (method -> global layer -> artifacts) that `methods` may require (not made again);
    first: the position of the first indexed token (the context's sink rows come after the indexed ones);
    moments: global layer -> the second moment of the context's unit queries [Hkv, D, D] (QueryCapture.moment), for
    a query-aware clustering; a layer without one gets its calibration queries' (engine.index.kmeans.query_moment).
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
            mine = names.layer_part(prepared.get(method.name, {}), layer_idx)
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
                                                         {**names.layer_part(own, i), **built[method.name][i]}.items()},
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


def ingest_tokens(lm: LoadedModel, ids: torch.Tensor, settings: ContextSettings, backend: Backend,
                  methods: list[Method] | None = None, progress: Progress = no_progress,
                  on_artifact: OnArtifact = _no_artifact, prepared: dict[str, Tensors] | None = None) -> IngestOutput:
    """From token ids to a context's artifacts: per layer `layer{i}.keys` / `.values` [Hkv, Lkept, D], per global
    layer `.calib_queries` [Hq, n, D] (the queries of the last n = settings.calibration tokens) and `.query_moment`
    [Hkv, D, D] (the second moment of every position's unit queries: engine.index.kmeans.query_moment), and the indexes and
    calibrations of `methods` (in build order; engine.methods.build_order; None: none, a context that full
    attention reads).

    on_artifact: called once per artifact as soon as it is final, so that a caller can save it while the rest is
    made (engine.serve.writer): `tokens` and the sliding layers' K/V right after the prefill, each global layer's K/V
    before its indexing and its indexes after, the calibrations last. The tensor must not be modified by the callee."""
    rows = settings.rows(ids.numel())
    cache, capture = prefill(lm, ids, settings.calibration, backend, progress)
    with torch.inference_mode():  # the cache's tensors are inference tensors
        for i in lm.global_layers:  # the sink's rows after the indexed ones (engine.attention.rows)
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
