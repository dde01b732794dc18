"""The app room's fixtures: a tiny random-weight GQA Llama (byte tokenizer) loaded on the CPU, once per test module."""

from __future__ import annotations

import pytest

from engine.model.load import load_model
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return load_model(str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama_gqa")), "cpu")
