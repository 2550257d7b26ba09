"""No import cycle among the project's modules, imports inside functions included.

The graph is read from the source (AST), so a lazy import that would close a loop only at run
time counts too. An edge A -> B means A's file imports B: `import B`, or `from B import x`, where
x is a submodule when one of that name exists. A package's parents are not edges: Python runs
them first whatever the order.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("nsa_titan", "components")


def project_modules() -> dict[str, str]:
    """Dotted module name -> file path, for every .py under the project's packages."""
    modules = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = path
    return modules


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: str, modules: dict[str, str]) -> set[str]:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    is_package = os.path.basename(path) == "__init__.py"
    found = set()
    for node in ast.walk(tree):  # every import, at module level or inside a function
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_package, node)
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.add(child if child in modules else target)
    return {name for name in found if name in modules and name != module}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {node: WHITE for node in graph}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color[nxt] == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if color[nxt] == WHITE:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    assert "components.nsa.op" in graph["components.nsa"]
    # doctor imports its checks inside a function; the graph must still see it
    assert "nsa_titan.doctor.checks" in graph["nsa_titan.doctor.command"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_components_never_import_the_engine():
    graph = import_graph()
    offenders = {(a, b) for a, edges in graph.items() if a.startswith("components") for b in edges
                 if b.startswith("nsa_titan")}
    assert not offenders, offenders


# What the engine may read of components: the records and helpers every part shares, the part packages
# it registers, and sampling. The attention math and the transformer's insides stay behind the hooks.
ENGINE_MAY_IMPORT = {
    "components.errors", "components.install_hint", "components.problems", "components.model_hooks",
    "components.sequence_shard",
    "components.optim", "components.data", "components.data.hf_files", "components.models",
    "components.models.generate",
    "components.nsa",  # only the backend table, for the registry's attention_backend kind
}


def test_the_engine_knows_no_model_insides():
    graph = import_graph()
    offenders = {(a, b) for a, edges in graph.items() if a.startswith("nsa_titan") for b in edges
                 if b.startswith("components") and b not in ENGINE_MAY_IMPORT}
    assert not offenders, offenders
    nsa_users = {a for a, edges in graph.items() if a.startswith("nsa_titan") and "components.nsa" in edges}
    assert nsa_users == {"nsa_titan.registry"}, nsa_users


def test_only_toml_io_imports_tomllib():
    """pyproject admits Python 3.10, which has no tomllib (new in 3.11): toml_io falls back to tomli
    there, so every other module takes tomllib from it."""
    offenders = []
    for folder in (*PACKAGES, "bench", "tests", "scripts"):
        for where, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in (n for n in files if n.endswith(".py")):
                path = os.path.join(where, name)
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read(), path)
                for node in ast.walk(tree):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
                    if "tomllib" in names:
                        offenders.append(os.path.relpath(path, ROOT))
    assert offenders == [os.path.join("nsa_titan", "config", "toml_io.py")], offenders
