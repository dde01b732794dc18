"""Debian's chromium, as the browser tests drive it through Playwright: where it is, how it is started, and the mark
that skips a test module where it is missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("SQUEEZE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                    reason=f"no chromium at {CHROMIUM} (apt-get install chromium)")
