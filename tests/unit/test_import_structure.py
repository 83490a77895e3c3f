"""The package's import graph, read from the source (ast): no cycles between zeroengine modules, and no private
name (or private module) used from outside where it lives. Imports inside functions count: a lazy import
that breaks a cycle hides the cycle, it does not remove it. A lower module that must reach a higher one
takes it as an argument, or a watcher registers with it (zero/external.py)."""
from __future__ import annotations

import ast
import os
from collections import defaultdict

import zeroengine

PACKAGE_DIR = os.path.dirname(zeroengine.__file__)


def _package_sources() -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (source, is a package's __init__), for every module of zeroengine."""
    found = {}
    root = os.path.dirname(PACKAGE_DIR)
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                with open(path, encoding="utf-8") as f:
                    found[dotted.removesuffix(".__init__")] = (f.read(), name == "__init__.py")
    return found


def _imports(module: str, source: str, is_package: bool, modules):
    """(imported module, imported name or None) for every import in ``module``, wherever it stands."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield (submodule, None) if submodule in modules else (base, alias.name)


def _owning_module(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _graph(sources: dict[str, tuple[str, bool]]):
    """(edges between the package's modules, the private imports found)."""
    edges: dict[str, set[str]] = defaultdict(set)
    private = []
    for module, (source, is_package) in sources.items():
        for target, name in _imports(module, source, is_package, sources):
            owner = _owning_module(target, sources)
            if owner is None or owner == module:
                continue  # another package's, or itself
            edges[module].add(owner)
            if name is not None and _is_private(name):
                private.append(f"{module} imports {name} from {owner}")
            if _is_private(owner.rpartition(".")[2]) and not module.startswith(owner.rpartition(".")[0] + "."):
                private.append(f"{module} imports the private module {owner}")
    return edges, private


def _cycles(nodes, edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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
                found.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules():
    sources = _package_sources()
    edges, _ = _graph(sources)
    assert len(sources) > 100 and sum(map(len, edges.values())) > 200  # it read the package
    assert _cycles(sorted(sources), edges) == []


def test_no_private_name_is_imported_from_another_module():
    assert _graph(_package_sources())[1] == []


def test_the_checks_find_what_they_look_for():
    fake = {
        "pkg": ("", True),
        "pkg.a": ("from .b import thing\n", False),
        "pkg.b": ("def f():\n    from pkg.a import _hidden  # lazy: still an edge\n", False),
        "pkg.inner": ("", True),
        "pkg.inner._private": ("", False),
        "pkg.inner.d": ("from ._private import x\nimport torch\n", False),  # its own package: fine
        "pkg.sub": ("", True),
        "pkg.sub.c": ("from pkg.inner import _private\nfrom ..inner._private import y\n", False),
    }
    edges, private = _graph(fake)
    assert _cycles(sorted(fake), edges) == [["pkg.a", "pkg.b"]]
    assert private == ["pkg.b imports _hidden from pkg.a", "pkg.sub.c imports the private module pkg.inner._private",
                       "pkg.sub.c imports the private module pkg.inner._private"]
