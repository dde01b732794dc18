"""A small random stand-in for `squeeze bench capture`'s file, for the CPU benchmark modules' tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def synthetic_capture(path: Path, tokens: int = 1024, queries: int = 256, seed: int = 0) -> Path:
    """Write keys / values [1, tokens, 256], queries [1, 2, queries, 256] (float16) and meta [rope_theta, tokens]:
    one source of dimension 256 with 2 query heads, as engine.bench.extend reads it. Returns path."""
    g = torch.Generator().manual_seed(seed)
    save_file({"meta": torch.tensor([10000.0, float(tokens)], dtype=torch.float64),
               "keys": torch.randn(1, tokens, 256, generator=g).half(),
               "values": torch.randn(1, tokens, 256, generator=g).half(),
               "queries": torch.randn(1, 2, queries, 256, generator=g).half()}, str(path))
    return path
