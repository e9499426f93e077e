"""Imports run one way: loom's module graph, computed from the source (every import statement,
those inside functions included), has no cycle; the runtime never imports the language; the
language reaches the HTTP layer only through its launcher entry point.

Imports under `if TYPE_CHECKING:` are left out: they never run, and a type named in an
annotation is not an import-time dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (CI's)
ROOT = Path(__file__).resolve().parents[1]
# import name -> folder, as the distribution maps them
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
BELOW_LANGUAGE = ("loom.runtime", "loom.grammar", "loom.radix", "loom.kernels")
# the language's doors into the HTTP layer: `python -m loom.launch_server`
HTTP_ENTRY_POINTS = {"loom.launch_server"}


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, mods) -> list[str]:
    if isinstance(node, ast.Import):
        wanted = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, *([node.module] if node.module else [])])
        # `from package import submodule` imports the submodule
        wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for target in wanted:
        while target and target not in mods:  # an attribute of a module: that module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append(target)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        graph[name] = {
            target
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip
            for target in _targets(name, path, node, mods)
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    # scheduler.py imports the drafter factory inside a method
    assert "loom.runtime.spec.factory" in graph["loom.runtime.scheduler.scheduler"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    detail = [
        " <-> ".join(comp) + "".join(f"\n    {m} -> {sorted(graph[m] & set(comp))}" for m in comp)
        for comp in found
    ]
    assert not found, "import cycles:\n" + "\n".join(detail)


def edges(graph: dict[str, set[str]], source, target) -> list[str]:
    """Every import `a -> b` with source(a) and target(b)."""
    return [
        f"{a} -> {b}"
        for a, deps in sorted(graph.items())
        if source(a)
        for b in sorted(deps)
        if target(b)
    ]


def test_runtime_never_imports_the_language():
    upward = edges(
        import_graph(),
        lambda a: a.startswith(BELOW_LANGUAGE),
        lambda b: not b.startswith(BELOW_LANGUAGE),
    )
    assert not upward, "the runtime imports the language:\n" + "\n".join(upward)


def test_language_reaches_http_only_through_its_launcher():
    inward = edges(
        import_graph(),
        lambda a: not a.startswith(BELOW_LANGUAGE) and a not in HTTP_ENTRY_POINTS,
        lambda b: b.startswith("loom.runtime.server"),
    )
    assert not inward, "the language imports HTTP internals:\n" + "\n".join(inward)
