"""Method settings named on a benchmark's command line (`--set METHOD.SETTING=VALUE`)."""

from __future__ import annotations


def parse_settings(items: list[str]) -> dict[str, dict]:
    """["quest.bounds=int8", ...] -> {"quest": {"bounds": "int8"}}, each value converted to the type of the
    setting's default (engine.policies.REGISTRY)."""
    import dataclasses

    from engine.policies import REGISTRY

    out: dict[str, dict] = {}
    for item in items:
        name, _, value = item.partition("=")
        method, _, field = name.partition(".")
        if method not in REGISTRY or not value:
            raise ValueError(f"expected METHOD.SETTING=VALUE with a registered method, got {item!r}")
        fields = {f.name: f for f in dataclasses.fields(REGISTRY[method].Settings)}
        if field not in fields:
            raise ValueError(f"{method} has no setting {field!r}; it has {', '.join(fields)}")
        kind = type(getattr(REGISTRY[method].Settings(), field))
        out.setdefault(method, {})[field] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
    return out
