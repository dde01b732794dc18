"""The lookup's and the expansion's kernel variants compile for an H100 with the installed Triton, on a machine
without a GPU (tests/kernels/compile_check.py): the interpreter the other CPU tests run them in accepts code
Triton's compiler refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.compile_check import variants

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine compiles them as its tests launch them")
def test_the_lookup_kernels_compile_for_an_h100():
    env = dict(os.environ, TRITON_INTERPRET="0")  # (this process's kernels are the interpreter's: tests/conftest.py)
    run = subprocess.run([sys.executable, "-m", "tests.kernels.compile_check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = [line for line in run.stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == len(variants()), run.stdout
