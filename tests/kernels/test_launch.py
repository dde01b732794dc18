"""The contract of programmatic dependent launch (kernels/launch.py), held by every kernel and every launch: a
kernel launched with PDL on a GPU may start before the kernel before it has finished, so each kernel must wait
before it reads what an earlier one wrote (or writes anything), and each launch must pass the options that match
the kernel's PDL flag. Read from the source, so that a new kernel or launch that forgets either fails here rather
than as a rare race on a GPU; the kernels' own tests compare their outputs, with PDL on a GPU, to the references."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from kernels import launch

ROOT = Path(__file__).resolve().parents[2]
JIT = sorted((ROOT / "kernels" / "jit").glob("*.py"))
OPS = sorted((ROOT / "kernels").glob("*_ops.py"))
# reads before its wait only what no kernel writes: the first tile of a product's weights, a dense lookup's first
# block of centroids
WAITS_LATER = {"gemv_kernel": "_tile", "centroid_denominator_kernel": "_centroids_ahead",
               "centroid_decode_lookup_kernel": "_centroids_ahead"}


def _kernels() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in JIT:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                found.append((path.name, node))
    return found


def _call_name(stmt: ast.stmt) -> str | None:
    """The called function's name of `f(...)` or `x = f(...)`."""
    value = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign)) else None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        return value.func.id
    return None


def test_every_kernel_waits_for_the_one_before_it_first():
    """Each kernel takes PDL (a constexpr, off by default) and its first statements call wait_prior(PDL) and
    release_next(PDL); a kernel in WAITS_LATER may first call only its named loader of constant data."""
    kernels = _kernels()
    assert len(kernels) >= 25, [name for _, k in kernels for name in [k.name]]
    for file, fn in kernels:
        args = [a.arg for a in fn.args.args]
        assert "PDL" in args, f"{file}:{fn.name} takes no PDL flag"
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        calls = [_call_name(s) for s in body]
        wait = calls.index("wait_prior") if "wait_prior" in calls else None
        assert wait is not None and "release_next" in calls, f"{file}:{fn.name} never calls wait_prior/release_next"
        before = [c for c in calls[:wait] if c != "release_next"]
        allowed = WAITS_LATER.get(fn.name)
        if allowed is None:
            assert not before, f"{file}:{fn.name} runs {before} before wait_prior"
        else:
            assert all(isinstance(s, (ast.Assign, ast.AugAssign)) or _call_name(s) in (allowed, "release_next")
                       for s in body[:wait]), f"{file}:{fn.name} does more than load constants before wait_prior"
            assert allowed in before, f"{file}:{fn.name} was expected to load with {allowed} first"


def _closing(src: str, i: int, pair: str) -> int:
    """The index past the bracket that closes the one opened just before src[i] (pair: "()" or "[]")."""
    depth = 1
    while depth:
        depth += {pair[0]: 1, pair[1]: -1}.get(src[i], 0)
        i += 1
    return i


def test_every_launch_passes_the_dependent_launch_options():
    """Every `X_kernel[grid](...)` in kernels/*_ops.py passes **dependent_launch(...) (directly or through a dict
    of common options built with it), so the kernel's PDL flag and Triton's launch_pdl always agree."""
    launches = 0
    for path in OPS:
        src = path.read_text()
        for m in re.finditer(r"(\w+_kernel)\[", src):
            i = _closing(src, m.end(), "[]")
            call = src[i:_closing(src, i + 1, "()")]
            launches += 1
            passed = "dependent_launch(" in call
            for name in re.findall(r"\*\*(\w+)\b(?!\()", call):  # **common: a dict built with the options
                built = re.search(rf"\b{name} = dict\(", src)
                passed |= built is not None and "dependent_launch(" in src[built.end():_closing(src, built.end(), "()")]
            assert passed, f"{path.name}: {m.group(1)} is launched without dependent_launch"
    assert launches >= 25


def test_no_dependent_launch_off_a_hopper_gpu():
    """The CPU (the interpreter) and older GPUs: the flag is off and Triton gets no launch option."""
    assert launch.dependent_launch(torch.device("cpu")) == {"PDL": False}
    assert not launch.supported(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dependent_launch_follows_the_switch_on_a_gpu():
    device = torch.device("cuda")
    capable = torch.cuda.get_device_capability(device)[0] >= launch.MIN_CAPABILITY
    assert launch.dependent_launch(device) == ({"PDL": True, "launch_pdl": True} if capable else {"PDL": False})
    try:
        launch.ENABLED = False
        assert launch.dependent_launch(device) == {"PDL": False}
    finally:
        launch.ENABLED = True
