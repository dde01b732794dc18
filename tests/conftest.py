"""Shared fixtures: the real embedded model (loaded once per test session) and a throwaway cache directory."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on the CPU; set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.model import LoadedModel, load_model


@pytest.fixture(scope="session")
def real_lm_load(tmp_path_factory) -> tuple[LoadedModel, list[tuple[str, int, int]]]:
    """The embedded Gemma 3 270M on the CPU (float32), dequantized once into a session temp dir (a first run),
    with the steps its load reported."""
    steps: list[tuple[str, int, int]] = []
    lm = load_model(None, "cpu", convert_dir=tmp_path_factory.mktemp("models"),
                    progress=lambda *step: steps.append(step))
    return lm, steps


@pytest.fixture(scope="session")
def real_lm(real_lm_load) -> LoadedModel:
    return real_lm_load[0]


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors: intra-op threads only add synchronisation, which costs seconds on a loaded
    2-core machine. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
