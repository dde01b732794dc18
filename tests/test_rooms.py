"""The rooms' import rules, read from the source: kernels/ and storage/ import nothing of the project but
themselves, engine/ does not import app/, and the modules of kernels/ import each other without a cycle (lazy
imports inside functions count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("app", "engine", "kernels", "storage")


def project_imports(path: Path) -> set[str]:
    """Dotted names of the project modules `path` imports anywhere in its body (`from kernels import x` gives
    kernels.x, which may be a module or a name in kernels/__init__)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] in ROOMS}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ROOMS:
                out.add(node.module)
                out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # relative: inside its own package
            package = path.relative_to(ROOT).with_suffix("").parts[: -node.level]
            out.add(".".join(package + ((node.module,) if node.module else ())))
    return out


def modules(room: str) -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in (ROOT / room).rglob("*.py")}


@pytest.mark.parametrize("room", ["kernels", "storage"])
def test_lower_rooms_import_only_themselves(room):
    for name, path in modules(room).items():
        foreign = {m for m in project_imports(path) if m.split(".")[0] != room}
        assert not foreign, f"{name} imports {sorted(foreign)}"


def test_engine_does_not_import_the_app():
    for name, path in modules("engine").items():
        upward = {m for m in project_imports(path) if m.split(".")[0] == "app"}
        assert not upward, f"{name} imports {sorted(upward)}"


def test_engine_core_imports_neither_the_serving_layer_nor_the_benchmarks():
    """The engine's core (engine/*.py, engine/policies/) is what the serving layer (engine/serve/), the benchmarks
    (engine/bench/) and the app build on: it imports none of them."""
    core = {name: path for name, path in modules("engine").items()
            if not name.startswith(("engine.serve", "engine.bench"))}
    assert "engine.session" in core and "engine.policies.quest" in core
    for name, path in core.items():
        upward = {m for m in project_imports(path) if m.startswith(("engine.serve", "engine.bench", "app"))}
        assert not upward, f"{name} imports {sorted(upward)}"


def test_kernels_have_no_import_cycle():
    mods = modules("kernels")
    graph = {name: {m for m in project_imports(path) if m in mods and m != name} for name, path in mods.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(name):] + [name])}")
        if name in done:
            return
        for dep in graph[name]:
            visit(dep, stack + [name])
        done.add(name)

    for name in graph:
        visit(name, [])
    assert "kernels.backend" in graph and "kernels.dispatch" in graph


def test_kernel_families_are_name_matched():
    """Each kernel family F has its kernel kernels/jit/F.py, its wrapper kernels/F_ops.py and its reference
    kernels/reference/F.py, and the wrapper offers every function of the reference under the same name (what
    Backend.kernel(F) relies on)."""
    import importlib
    import inspect

    from kernels.backend import families

    jit = {p.stem for p in (ROOT / "kernels" / "jit").glob("*.py") if p.stem != "__init__"}
    ops = {p.stem.removesuffix("_ops") for p in (ROOT / "kernels").glob("*_ops.py")}
    assert set(families()) == jit == ops, (sorted(families()), sorted(jit), sorted(ops))
    for family in families():
        ref = importlib.import_module(f"kernels.reference.{family}")
        wrapper = importlib.import_module(f"kernels.{family}_ops")
        public = [n for n, f in inspect.getmembers(ref, inspect.isfunction)
                  if not n.startswith("_") and f.__module__ == ref.__name__]
        missing = [n for n in public if not callable(getattr(wrapper, n, None))]
        assert public and not missing, f"kernels/{family}_ops.py lacks {missing}"
