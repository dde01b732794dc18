"""The kernel variants a CPU test run launches, recorded for a compile on a machine without a GPU.

Under the interpreter (TRITON_INTERPRET=1, tests/conftest.py) every @triton.jit kernel of kernels/jit is an
InterpretedFunction; `record` adds a pre-run hook to each (Triton's own hook: it sees every launch's arguments) that
notes the launch's variant: each argument's compile-time form (a tensor's element type, an int's width, a float, a
constexpr's value, None). With SQUEEZE_KERNEL_LAUNCHES=FILE set, tests/conftest.py records a whole test run into
FILE (one per process); `python -m tests.kernels.compile_check --launches FILE...` compiles every variant for an
H100 with the real compiler (tests/kernels/compile_check.py).
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
from pathlib import Path

import torch

# torch dtype -> Triton pointer element type
ELEMENT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
           torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def argument_form(value, constexpr: bool):
    """(signature entry, constexpr value or None) of one launch argument."""
    if constexpr or value is None:
        return "constexpr", value
    if isinstance(value, torch.Tensor):
        return "*" + ELEMENT[value.dtype], None
    if isinstance(getattr(value, "base", None), torch.Tensor) and hasattr(value, "block_shape"):  # a TMA descriptor
        return f"tensordesc<{ELEMENT[value.base.dtype]}[{', '.join(str(int(n)) for n in value.block_shape)}]>", None
    if isinstance(value, bool):
        return "i1", None
    if isinstance(value, int):
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), None
    if isinstance(value, float):
        return "fp32", None
    raise TypeError(f"no compile-time form for an argument of type {type(value).__name__}")


def variant(fn, args: tuple, kwargs: dict) -> dict:
    """A launch of kernel function `fn` (its Python function) as a JSON-able variant: module, name, signature
    {argument: type}, constexprs {argument: value}."""
    spec = inspect.signature(fn)
    params = spec.parameters
    bound = spec.bind_partial(*args, **kwargs)
    signature, constexprs = {}, {}
    for name, param in params.items():
        value = bound.arguments.get(name, param.default)
        kind, fixed = argument_form(value, "constexpr" in str(param.annotation))
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = fixed
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs}


def kernels() -> list:
    """Every launchable kernel of kernels/jit as the process has it (InterpretedFunction or JITFunction)."""
    import kernels.jit as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if name.endswith("_kernel") and fn is not None and fn.__module__ == module.__name__:
                found.append(obj)
    return found


class Recorder:
    """The distinct variants launched between `install` and `uninstall` (usable as a context manager)."""

    def __init__(self):
        self.variants: dict[str, dict] = {}
        self._hooks: list = []

    def install(self) -> None:
        for kernel in kernels():
            if not hasattr(kernel, "add_pre_run_hook"):
                raise RuntimeError("launches are recorded under the interpreter only (TRITON_INTERPRET=1)")
            hook = self._hook(kernel.fn)
            kernel.add_pre_run_hook(hook)
            self._hooks.append((kernel, hook))

    def uninstall(self) -> None:
        for kernel, hook in self._hooks:
            kernel.pre_run_hooks.remove(hook)
        self._hooks.clear()

    def __enter__(self) -> "Recorder":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _hook(self, fn):
        def note(*args, **kwargs):
            v = variant(fn, args, kwargs)
            self.variants.setdefault(json.dumps(v, sort_keys=True), v)

        return note

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(list(self.variants.values())))
