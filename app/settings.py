"""The chat's controls as this browser last set them: kept in the browser (`gr.BrowserState`), restored at each page
load. A stored value is taken only where it is still a valid setting (a method that is still registered, a number
within its slider's range); any other falls back to the app's default, without an error."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from app.config import (
    CENTROID_RATIOS,
    LEVEL1_RATIOS,
    MAX_NEW_MIN,
    REPETITIONS,
    SPARSITY_MAX,
    SPARSITY_MIN,
    TEMPERATURES,
    TOP_PS,
    AppConfig,
)
from engine.serve import METHODS


@dataclass(frozen=True)
class ChatSettings:
    """The chat's controls, in the order of `ChatTab.setting_controls`."""

    method: str
    sparsity: float
    max_new_tokens: int
    temperature: float
    top_p: float
    repetition: float
    compare: bool
    centroid_ratio: float
    level1_ratio: float

    @classmethod
    def defaults(cls, config: AppConfig) -> ChatSettings:
        """The controls as a new browser finds them."""
        return cls(method=config.method, sparsity=config.sparsity, max_new_tokens=config.max_new_tokens,
                   temperature=TEMPERATURES[0], top_p=TOP_PS[1], repetition=REPETITIONS[0], compare=False,
                   centroid_ratio=config.centroid_ratio, level1_ratio=config.level1_ratio)

    @classmethod
    def restored(cls, stored, config: AppConfig) -> ChatSettings:
        """The settings a browser kept (`stored`: what `as_stored` gave, as the browser hands it back), each one
        checked on its own: a value that is missing, of another type or out of its range is the default."""
        default = cls.defaults(config)
        stored = stored if isinstance(stored, dict) else {}
        ranges = {"sparsity": (SPARSITY_MIN, SPARSITY_MAX), "temperature": TEMPERATURES, "top_p": TOP_PS,
                  "repetition": REPETITIONS, "centroid_ratio": CENTROID_RATIOS, "level1_ratio": LEVEL1_RATIOS}
        values = {name: _number(stored.get(name), *bounds, getattr(default, name)) for name, bounds in ranges.items()}
        method = stored.get("method")
        values["method"] = method if isinstance(method, str) and method in METHODS else default.method
        tokens = _number(stored.get("max_new_tokens"), MAX_NEW_MIN, config.max_new_tokens_limit, None)
        values["max_new_tokens"] = int(tokens) if tokens is not None and tokens == int(tokens) else \
            default.max_new_tokens
        compare = stored.get("compare")
        values["compare"] = compare if isinstance(compare, bool) else default.compare
        return cls(**values)

    @classmethod
    def from_controls(cls, values, config: AppConfig) -> ChatSettings:
        """The settings the controls show (their values in field order), checked as a restored one is."""
        return cls.restored(dict(zip((f.name for f in fields(cls)), values)), config)

    def as_stored(self) -> dict:
        """What the browser keeps (JSON)."""
        return asdict(self)

    def values(self) -> list:
        """The controls' values, in field order."""
        return [getattr(self, f.name) for f in fields(self)]


def _number(value, low: float, high: float, default):
    """`value` as a float when it is a finite number in [low, high] (a bool is not a number here), else `default`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    value = float(value)
    return value if math.isfinite(value) and low <= value <= high else default
