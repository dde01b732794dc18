"""Kernel variants compile for an H100 with the installed Triton, on a machine without a GPU
(tests/kernels/compile_check.py): the interpreter the other CPU tests run them in accepts code Triton's compiler
refuses. The lookup's and the expansion's listed variants, and a launch recorded as a test run records them
(tests/kernels/launches.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.compact_ops import expand_groups
from tests.kernels.compile_check import variants
from tests.kernels.launches import Recorder

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine compiles them as its tests launch "
                                "them")


def _compile_check(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="0")  # (this process's kernels are the interpreter's: tests/conftest.py)
    return subprocess.run([sys.executable, "-m", "tests.kernels.compile_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_lookup_kernels_compile_for_an_h100():
    run = _compile_check()
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = [line for line in run.stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == len(variants()), run.stdout


@pytest.mark.parametrize("label,waits", [("one launch, threshold", 1), ("one launch, cut", 1),
                                         ("one launch, cut here", 2), ("one launch, whole lookup", 3),
                                         ("one launch, whole lookup at a threshold", 2)])
def test_a_one_launch_lookups_waits_keep_their_ordering_when_compiled(label, waits):
    """Each wait of a one-launch lookup reads its counter with acquire, and each count it waits for is added with
    release, in the PTX for an H100: the interpreter runs its programs one after another, so only the compiled code
    can show an ordering lost (an atomic whose result goes unused is dropped by the compiler, acquire and all)."""
    run = _compile_check("--ptx", label)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("ld.global.gpu.acquire") >= waits, label
    assert len(re.findall(r"(?:atom|red)\.global\.gpu\.release\.add", run.stdout)) >= waits, label  # (a result
    # unused: Triton 3.9 writes a reduction, red, where 3.6 writes atom)


def test_a_recorded_launch_compiles_for_an_h100(tmp_path):
    """An expansion launched under the interpreter with a Recorder on (its block sums' kernel, then its own): each
    variant (a bool keep, int64 starts, the tiles as constexprs) noted once for two launches of the same form, and
    compiled; none noted after."""
    keep = torch.tensor([[True, False, True], [False, True, True]])
    starts = torch.tensor([[0, 2, 5, 9]])
    with Recorder() as recorder:
        expand_groups(keep, starts, 9, 2)
        expand_groups(~keep, starts, 9, 2)
    expand_groups(keep, starts, 9, 2)
    assert sorted(v["name"] for v in recorder.variants.values()) == ["expand_groups_kernel",
                                                                     "group_block_sums_kernel"]
    [v] = [v for v in recorder.variants.values() if v["name"] == "expand_groups_kernel"]
    assert v["signature"]["keep_ptr"] == "*i1"
    assert v["signature"]["starts_ptr"] == "*i64" and v["constexprs"]["HAS_FIXED"] is False
    recorder.save(tmp_path / "launches")
    run = _compile_check("--launches", str(tmp_path / "launches"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(line.split()[1] for line in run.stdout.splitlines()) == ["expand_groups_kernel",
                                                                           "group_block_sums_kernel"], run.stdout
