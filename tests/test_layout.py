"""The package's layout (docs/development.md): rooms in layers, no import upward or in a circle, no file over ~400
lines, one-line docstrings. Every import counts, also one inside a function: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dataplane_rl"
MAX_LINES = 420  # "about 400": a file past this is two files

# Rooms from the bottom up; a room may import only rooms on its own layer or below (docs/development.md).
LAYERS = [
    {"errors", "config_types", "yaml_load", "resources", "hosts", "units", "rng", "trace", "ray_calls", "__init__"},  # foundation
    {"schema", "algorithms"},
    {"config"},
    {"store"},
    {"tasks", "model", "columns"},
    {"rollout"},
    {"checkpoint"},
    {"train"},
    {"run"},
    {"driver"},
    {"bench", "cli"},
]
RANK = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def room_of(module: str) -> str:
    """dataplane_rl.store.shm -> store; dataplane_rl.errors -> errors."""
    return module.split(".")[1] if module.count(".") else "__init__"


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports_of(path: Path, name: str) -> set[str]:
    """Every dataplane_rl module this file imports, resolved to a module that exists."""
    mods = modules()
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            # `from pkg import submodule` depends on the submodule (a package's own __init__ runs first anyway)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            targets = subs + ([base] if len(subs) < len(node.names) else [])
        for t in targets:
            if t.startswith("dataplane_rl"):
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != name:
                    found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    return {name: imports_of(path, name) for name, path in modules().items()}


def test_every_room_has_a_layer():
    rooms = {room_of(m) for m in modules()}
    assert rooms <= set(RANK), f"rooms without a layer in this test and docs/development.md: {sorted(rooms - set(RANK))}"


def test_no_upward_import():
    upward = [f"{m} ({room_of(m)}) imports {t} ({room_of(t)})" for m, ts in graph().items() for t in sorted(ts)
              if RANK[room_of(t)] > RANK[room_of(m)]]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_circle_between_rooms():
    edges = {}
    for m, ts in graph().items():
        for t in ts:
            if room_of(t) != room_of(m):
                edges.setdefault(room_of(m), set()).add(room_of(t))
    cycle = find_cycle(edges)
    assert cycle is None, "rooms import each other in a circle: " + " -> ".join(cycle)


def test_no_circle_between_modules():
    cycle = find_cycle(graph())
    assert cycle is None, "modules import each other in a circle: " + " -> ".join(cycle)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(n: str, stack: list[str]):
        state[n] = 1
        stack.append(n)
        for t in sorted(edges.get(n, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (c := visit(t, stack)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (c := visit(n, [])):
            return c
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_is_small_and_says_what_it_is(name):
    path = modules()[name]
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(PKG.parent)} has {lines} lines; split it by idea (docs/development.md)"
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.strip(), f"{path.relative_to(PKG.parent)} has no module docstring"
