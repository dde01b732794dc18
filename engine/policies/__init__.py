"""The methods of the engine, by name. Building order matters: a policy may reuse what earlier ones built."""

from engine.policies.base import CalibrationSet, LayerIndex, Lookup, Policy
from engine.policies.full import FullPolicy
from engine.policies.hsqueeze import HierarchicalSqueezePolicy
from engine.policies.squeeze import SqueezePolicy

POLICIES: dict[str, Policy] = {p.name: p for p in (FullPolicy(), SqueezePolicy(), HierarchicalSqueezePolicy())}
METHODS = tuple(POLICIES)


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None


__all__ = ["POLICIES", "METHODS", "get_policy", "Policy", "Lookup", "LayerIndex", "CalibrationSet"]
