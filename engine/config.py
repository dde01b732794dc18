"""Settings of a context (what every method shares); each method's own settings live with the method
(engine.policies). Both are part of the cache key of what they build."""

from __future__ import annotations

from dataclasses import asdict, dataclass

DEFAULT_DENSE_TAIL = 100  # last context tokens: kept dense, and their queries calibrate the methods (paper, app. C)
PROMPT_VERSION = 1  # bump when the document/question template changes: old contexts are then not reused
CONTEXT_VERSION = 4  # bump when what a context stores changes (4: each method's index in its own namespace)
# Calibrated sparsities: a requested sparsity maps to its threshold by interpolation between these points.
SPARSITY_GRID = (0.0, 0.3, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.97, 0.98, 0.99)


@dataclass(frozen=True)
class ContextSettings:
    """How a document becomes a context, whatever the methods.

    dense_tail: last context tokens every method reads densely; their queries are the calibration queries
    """

    dense_tail: int = DEFAULT_DENSE_TAIL

    def __post_init__(self) -> None:
        if self.dense_tail < 1:
            raise ValueError(f"dense_tail must be at least 1, got {self.dense_tail}")

    def as_dict(self) -> dict:
        """The settings as stored and as part of a context's cache key."""
        return {**asdict(self), "prompt_version": PROMPT_VERSION, "context_version": CONTEXT_VERSION}

    @classmethod
    def from_dict(cls, data: dict) -> "ContextSettings":
        """Back from `as_dict` (the version fields and unknown keys are ignored)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
