"""The package's walls, read from its source: which parts may import which, and no cycles.

Every `import` counts, at module level or inside a function (a late import still couples the
two modules; hiding it in a function only hides a cycle). The rules:

- config.py and model.py (the math) import nothing of runtime/, transport/ or planner/;
- planner/, schedules and sim.py (the models of cost and time) import no JAX, Flax or optax,
  and nothing of runtime/ or transport/;
- transport/ (moves arrays) imports nothing of runtime/, model.py or planner/;
- no two modules of h2jax import each other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "h2jax"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str] = frozenset()) -> set[str]:
    """Every module `path` imports (absolute names; relative imports resolved). In
    `from P import name`, where P.name is one of `modules` it is that module that is
    imported, not P's own body."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{alias.name}" for alias in node.names]
            submodules = {n for n in names if n in modules}
            out.update(submodules)
            if len(submodules) < len(names):  # some names come from P's own body
                out.add(prefix)
    return out


def package_graph() -> dict[str, set[str]]:
    """h2jax module -> the h2jax modules it imports (names that are not modules dropped)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in imports_of(path, set(modules)) if m in modules and m != name}
    return graph


def _in(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def violations(graph: dict[str, set[str]], external: dict[str, set[str]]) -> list[str]:
    rules = [
        (lambda m: m in ("h2jax.config", "h2jax.model"),
         ("h2jax.runtime", "h2jax.transport", "h2jax.planner"), "the model"),
        (lambda m: _in(m, "h2jax.planner") or _in(m, "h2jax.schedules") or m in ("h2jax.sim", "h2jax.sim_plans", "h2jax.schedule"),
         ("h2jax.runtime", "h2jax.transport", "jax", "flax", "optax"), "planner and simulator"),
        (lambda m: _in(m, "h2jax.transport"),
         ("h2jax.runtime", "h2jax.model", "h2jax.planner"), "transport"),
    ]
    out = []
    for module in sorted(graph):
        imported = graph[module] | external[module]
        for applies, forbidden, wall in rules:
            if not applies(module):
                continue
            for target in sorted(imported):
                if any(_in(target, f) for f in forbidden):
                    out.append(f"{module} imports {target} ({wall} wall)")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def all_imports() -> dict[str, set[str]]:
    """h2jax module -> every name it imports, h2jax's own and third parties' alike."""
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def test_no_module_crosses_a_wall():
    found = violations(package_graph(), all_imports())
    assert not found, "\n".join(found)


def test_no_import_cycles_between_modules():
    found = cycles(package_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


# The checks themselves, on small made-up graphs: they must be able to fail.


def test_the_wall_check_catches_a_transport_importing_the_runtime():
    graph = {"h2jax.transport.mpi": {"h2jax.runtime.train"}, "h2jax.runtime.train": set()}
    external = {m: set() for m in graph}
    assert violations(graph, external) == ["h2jax.transport.mpi imports h2jax.runtime.train (transport wall)"]


def test_the_wall_check_catches_a_planner_importing_jax():
    graph = {"h2jax.planner.search": set()}
    assert violations(graph, {"h2jax.planner.search": {"jax", "jax.numpy"}}) == [
        "h2jax.planner.search imports jax (planner and simulator wall)",
        "h2jax.planner.search imports jax.numpy (planner and simulator wall)",
    ]


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_check_finds_cycles(edges, expected):
    assert cycles(edges) == expected
