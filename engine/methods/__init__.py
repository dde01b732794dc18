"""The methods of the engine, by name: one registry line per method. Everything that lists methods (the app, the
command line, the benchmarks, the contract test) iterates over REGISTRY."""

from __future__ import annotations

from collections.abc import Iterable

from engine.attention.method import (
    CalibrationSet,
    LayerIndex,
    LayerKeys,
    Lookup,
    Method,
    MethodSettings,
    Preparation,
    StepPlan,
    Tensors,
)
from engine.methods.duo.policy import DuoPolicy
from engine.methods.duo_squeeze import DuoSqueezePolicy
from engine.methods.full import FullPolicy
from engine.methods.hsqueeze import HierarchicalSqueezePolicy
from engine.methods.quest import QuestPolicy
from engine.methods.saap.policy import SaapPolicy
from engine.methods.squeeze import SqueezePolicy

REGISTRY: dict[str, type[Method]] = {cls.name: cls for cls in (
    FullPolicy,
    SqueezePolicy,
    HierarchicalSqueezePolicy,
    QuestPolicy,
    DuoPolicy,
    DuoSqueezePolicy,
    SaapPolicy,
)}
METHODS = tuple(REGISTRY)
SPARSE_METHODS = tuple(name for name, cls in REGISTRY.items() if cls.sparse)


def method_class(name: str) -> type[Method]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None


def make_method(name: str, settings: MethodSettings | dict | None = None) -> Method:
    """An instance of method `name` with `settings` (its Settings, a dict of their fields, or None: defaults)."""
    cls = method_class(name)
    if isinstance(settings, dict):
        fields = set(cls.Settings.__dataclass_fields__)
        unknown = sorted(set(settings) - fields)
        if unknown:
            raise ValueError(f"unknown {name} setting(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
        settings = cls.Settings(**settings)
    return cls(settings)


def stand_ins(methods: Iterable[Method], layers: list[int], num_kv_heads: int, head_dim: int) -> dict[str, Tensors]:
    """Each method's model-level artifacts made without a model (Method.stand_in): for benchmarks that time
    random-weight models and for tests of the mechanics; a fidelity measurement needs the trained ones."""
    return {m.name: m.stand_in(list(layers), num_kv_heads, head_dim) for m in methods}


def build_order(names: Iterable[str]) -> list[str]:
    """The sparse methods among `names` and everything they require, each after its requirements."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise ValueError(f"methods require each other: {' -> '.join(path + (name,))}")
        cls = method_class(name)
        for req in cls.requires:
            visit(req, path + (name,))
        if cls.sparse and name not in order:
            order.append(name)

    for name in names:
        visit(name, ())
    return order


__all__ = ["REGISTRY", "METHODS", "SPARSE_METHODS", "method_class", "make_method", "build_order", "stand_ins", "Method",
           "MethodSettings", "Preparation", "StepPlan", "Lookup", "LayerIndex", "LayerKeys", "CalibrationSet", "Tensors"]
