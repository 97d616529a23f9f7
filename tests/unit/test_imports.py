"""The package's import graph: no module imports a module that imports it back, by any path, and the engine
imports nothing from the layers built on it. Read from the source (no import runs), so it takes milliseconds."""

from __future__ import annotations

import ast
from pathlib import Path

import mt_ray

ROOT = Path(mt_ray.__file__).parent


def _graph() -> dict[str, set[str]]:
    """Each module's `mt_ray` imports (a name imported from a package resolves to its submodule where it is one)."""
    modules = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(("mt_ray", *f.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        modules[name] = f
    graph = {}
    for name, f in modules.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mt_ray"):
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("mt_ray")}
        graph[name] = (found & modules.keys()) - {name}
    return graph


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path of imports from `start` back to itself, if any (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_module_imports_itself_back():
    graph = _graph()
    cycles = [c for m in sorted(graph) if (c := _cycle_through(graph, m))]
    assert not cycles, f"import cycles: {[' -> '.join(c) for c in cycles]}"


def test_the_engine_imports_nothing_built_on_it():
    above = ("mt_ray.cluster", "mt_ray.training", "mt_ray.tracking", "mt_ray.cli")
    wrong = {m: sorted(d for d in deps if d.startswith(above))
             for m, deps in _graph().items() if m.startswith("mt_ray.engine")}
    assert not {m: d for m, d in wrong.items() if d}
