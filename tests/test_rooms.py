"""The rooms' import rules, read from the source (lazy imports inside functions and imports for type checking
count): no room has an import cycle; kernels/ and storage/ import nothing of the project but themselves; engine/
never imports app/; the engine's sub-rooms stand on floors and import only their own room and lower floors; the
app reaches the engine through the serving layer's public door; the kernel families are name-matched."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("app", "engine", "kernels", "storage")
# The engine's sub-rooms, lowest first: a module imports its own sub-room and lower floors only (text and index
# share the ground floor and do not import each other).
ENGINE_FLOORS = {"text": 0, "index": 0, "attention": 1, "model": 2, "methods": 3, "context": 4, "serve": 5, "bench": 6}
# What the app may import of the engine: the serving layer's door, the names known without torch (the quick
# command line), and the benchmarks' commands (`squeeze bench`, `squeeze eval`).
APP_DOORS = ("engine.serve", "engine.model.catalog", "engine.bench")


def project_imports(path: Path) -> set[str]:
    """Dotted names of the project modules `path` imports anywhere in its body (`from kernels import x` gives
    kernels and kernels.x, which may be a module or a name in kernels/__init__)."""
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


def import_graph(room: str) -> dict[str, set[str]]:
    """Module -> the modules of the same room it imports (a name imported from a module counts as that module)."""
    mods = modules(room)
    return {name: {m if m in mods else m.rpartition(".")[0] for m in project_imports(path)
                   if (m in mods or m.rpartition(".")[0] in mods) and m != name} - {name}
            for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> list[str] | None:
        if name in stack:
            return stack[stack.index(name):] + [name]
        if name in done:
            return None
        for dep in sorted(graph.get(name, ())):
            found = visit(dep, stack + [name])
            if found:
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("room", ROOMS)
def test_no_room_has_an_import_cycle(room):
    graph = import_graph(room)
    assert len(graph) > 5
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("room", ["kernels", "storage"])
def test_lower_rooms_import_only_themselves(room):
    for name, path in modules(room).items():
        foreign = {m for m in project_imports(path) if m.split(".")[0] != room}
        assert not foreign, f"{name} imports {sorted(foreign)}"


def test_engine_does_not_import_the_app():
    for name, path in modules("engine").items():
        upward = {m for m in project_imports(path) if m.split(".")[0] == "app"}
        assert not upward, f"{name} imports {sorted(upward)}"


def sub_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "engine" else None


def test_every_engine_module_is_in_a_sub_room():
    """engine/ holds only its package docstring and the sub-rooms of ENGINE_FLOORS, each with a docstring that says
    what it holds."""
    for name in modules("engine"):
        assert name == "engine" or sub_room(name) in ENGINE_FLOORS, f"{name} is in no sub-room of {ENGINE_FLOORS}"
    for room in ENGINE_FLOORS:
        doc = ast.get_docstring(ast.parse((ROOT / "engine" / room / "__init__.py").read_text()))
        assert doc, f"engine/{room}/__init__.py says nothing of what it holds"


def test_engine_sub_rooms_import_only_their_own_and_lower_floors():
    for name, path in modules("engine").items():
        here = sub_room(name)
        if here is None:
            continue
        for m in project_imports(path):
            there = sub_room(m)
            if there is None or there == here or m == "engine":
                continue
            assert there in ENGINE_FLOORS, f"{name} imports {m}, in no sub-room"
            assert ENGINE_FLOORS[there] < ENGINE_FLOORS[here], \
                f"{name} (floor {ENGINE_FLOORS[here]}) imports {m} (floor {ENGINE_FLOORS[there]})"


def test_the_app_reaches_the_engine_through_its_doors():
    for name, path in modules("app").items():
        inner = {m for m in project_imports(path) if m.split(".")[0] == "engine" and m != "engine"
                 and not any(m == door or m.startswith(door + ".") for door in APP_DOORS)}
        assert not inner, f"{name} imports {sorted(inner)}: the app uses {APP_DOORS}"
        for m in project_imports(path):
            if m.startswith("engine.serve."):  # the serving layer's door is its package, not its modules
                module = m.removeprefix("engine.serve.").split(".")[0]
                assert not (ROOT / "engine" / "serve" / f"{module}.py").exists(), \
                    f"{name} imports {m}: use `from engine.serve import ...`"
            if m.startswith("engine.bench."):  # the benchmarks' commands only, from the command line
                assert name == "app.cli", f"{name} imports {m}"


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
