"""The names of a context's artifacts: the one module that makes and parses them.

    tokens, offsets                     the fixed context's token ids and their character offsets
    layer{i}.keys, layer{i}.values      layer i's fixed K/V [Hkv, Lkept, D] (original order)
    layer{i}.calib_queries              a global layer's calibration queries [Hq, n, D]
    layer{i}.query_moment               a global layer's second moment of the context's unit queries [Hkv, D, D]
    {method}.layer{i}.{name}            a method's index of global layer i
    {method}.calib.{name}               a method's calibration
A model-level artifact of a method (learned once per model, stored apart from documents) is `layer{i}.{name}` or
a plain name, within the method's model-level namespace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

TOKENS = "tokens"
OFFSETS = "offsets"
_LAYER = re.compile(r"layer(\d+)\.(.+)")
KV_NAMES = ("keys", "values")
CALIB_QUERIES = "calib_queries"
QUERY_MOMENT = "query_moment"


def layer_name(layer: int, name: str) -> str:
    """`layer{i}.{name}`: a layer's K/V or calibration queries (or, in a namespace, a method's layer artifact)."""
    return f"layer{layer}.{name}"


def method_name(method: str, name: str) -> str:
    """`{method}.{name}`: a name in a method's namespace."""
    return f"{method}.{name}"


def method_layer_name(method: str, layer: int, name: str) -> str:
    return method_name(method, layer_name(layer, name))


def method_calib_name(method: str, name: str) -> str:
    return method_name(method, f"calib.{name}")


def split_layer(name: str) -> tuple[int, str] | None:
    """`layer{i}.{rest}` -> (i, rest); anything else -> None."""
    m = _LAYER.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def namespace(name: str, methods: tuple[str, ...]) -> str | None:
    """The method (of `methods`) whose namespace the artifact `name` is in, or None for the context's own."""
    method, _, rest = name.partition(".")
    return method if rest and method in methods and split_layer(name) is None else None


@dataclass
class MethodArtifacts:
    """One method's artifacts of a context: layers: global layer -> name -> tensor; calibration: name -> tensor."""

    layers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    calibration: dict[str, torch.Tensor] = field(default_factory=dict)

    def named(self, method: str) -> dict[str, torch.Tensor]:
        """Back to full artifact names."""
        out = {method_layer_name(method, i, n): t for i, layer in self.layers.items() for n, t in layer.items()}
        out.update({method_calib_name(method, n): t for n, t in self.calibration.items()})
        return out


@dataclass
class ContextArtifacts:
    """A context's artifacts, parsed: the fixed context, per-layer K/V and calibration queries, and each method's
    artifacts (unrecognised names are kept in `other`)."""

    tokens: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    kv: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # layer -> keys/values
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # global layer -> calibration queries
    moments: dict[int, torch.Tensor] = field(default_factory=dict)  # global layer -> query moment (engine.index.kmeans)
    methods: dict[str, MethodArtifacts] = field(default_factory=dict)
    other: dict[str, torch.Tensor] = field(default_factory=dict)


def parse(artifacts: dict[str, torch.Tensor], methods: tuple[str, ...] | None = None) -> ContextArtifacts:
    """Sort a context's artifacts by what they are. methods: the method names to recognise (None: any prefix)."""
    out = ContextArtifacts()
    for name, t in artifacts.items():
        if name == TOKENS:
            out.tokens = t
            continue
        if name == OFFSETS:
            out.offsets = t
            continue
        layer = split_layer(name)
        if layer is not None:
            i, rest = layer
            if rest in KV_NAMES:
                out.kv.setdefault(i, {})[rest] = t
            elif rest == CALIB_QUERIES:
                out.queries[i] = t
            elif rest == QUERY_MOMENT:
                out.moments[i] = t
            else:
                out.other[name] = t
            continue
        method, _, rest = name.partition(".")
        if rest and (methods is None or method in methods):
            entry = out.methods.setdefault(method, MethodArtifacts())
            layer = split_layer(rest)
            if layer is not None:
                entry.layers.setdefault(layer[0], {})[layer[1]] = t
                continue
            if rest.startswith("calib."):
                entry.calibration[rest[len("calib."):]] = t
                continue
        out.other[name] = t
    return out


def layer_part(artifacts: dict[str, torch.Tensor], layer_idx: int) -> dict[str, torch.Tensor]:
    """The `layer{i}.` artifacts of one layer (e.g. a method's model-level ones), by their short names."""
    out = {}
    for name, t in artifacts.items():
        parsed = split_layer(name)
        if parsed is not None and parsed[0] == layer_idx:
            out[parsed[1]] = t
    return out
