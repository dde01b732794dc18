"""Settings named on a benchmark's command line: a method's (`--set METHOD.SETTING=VALUE`) and the follow rows'
(`--follow SETTING=VALUE`)."""

from __future__ import annotations


def parse_settings(items: list[str]) -> dict[str, dict]:
    """["quest.bounds=int8", ...] -> {"quest": {"bounds": "int8"}}, each value converted to the type of the
    setting's default (engine.methods.REGISTRY)."""
    import dataclasses

    from engine.methods import REGISTRY

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
        out.setdefault(method, {})[field] = _convert(value, kind)
    return out


def parse_follow(items: list[str]):
    """["lead=4", "carry=false"] -> engine.attention.follow.FollowSettings with those fields (the others at their defaults),
    each value converted to its default's type; ValueError on an unknown setting or a bad value."""
    import dataclasses

    from engine.attention.follow import FollowSettings

    defaults = FollowSettings()
    fields = [f.name for f in dataclasses.fields(FollowSettings)]
    values = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in fields or not value:
            raise ValueError(f"expected SETTING=VALUE with a follow setting ({', '.join(fields)}), got {item!r}")
        kind = type(getattr(defaults, name))
        values[name] = _convert(value, kind)
    return FollowSettings(**values)


def _convert(value: str, kind: type):
    """`value` as a `kind` (bool: 1/true/yes or 0/false/no; ValueError otherwise)."""
    if kind is bool:
        if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() in ("1", "true", "yes")
    return kind(value)
