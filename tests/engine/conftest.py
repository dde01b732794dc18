"""The engine's fixtures: a tiny random-weight model of each architecture the engine serves (tests.support.tiny_models),
saved once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import ARCHS, make_tiny_model


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model_path(request, tmp_path_factory) -> Path:
    """A saved tiny model directory, built once per architecture for the whole test session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_models"), request.param)
