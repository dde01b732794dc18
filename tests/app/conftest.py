"""The app room's fixtures: a tiny random-weight GQA Llama (byte tokenizer) loaded on the CPU, once per test module;
a Chromium page (Playwright) for the browser tests, of the size a module's `viewport` fixture asks for."""

from __future__ import annotations

import pytest

from engine.model.load import load_model
from tests.support.browser import CHROMIUM, CHROMIUM_ARGS
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return load_model(str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama_gqa")), "cpu")


@pytest.fixture
def viewport() -> dict:
    return {"width": 1200, "height": 900}


@pytest.fixture
def page(viewport):
    """A new page of a headless Chromium started for the test (skipped without Playwright)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport=viewport)
        finally:
            browser.close()
