"""The GPU tests' imports resolve on any machine. tests/gpu is skipped without CUDA, and many of its imports sit
inside test functions, so a helper that moves (tests/distributed/test_real_models.py once did) would only
fail inside a scarce GPU lease. Every import statement of every tests/gpu module is resolved here, with the
paths the suite's conftest adds and those the module adds itself (its ``IMPORT_PATHS``)."""
import ast
import importlib
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_TESTS = sorted(f for f in os.listdir(os.path.join(TESTS, "gpu")) if f.startswith("test_") and f.endswith(".py"))


def _imports(tree):
    """(module, names) of every absolute import in the file, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module, [alias.name for alias in node.names]


@pytest.mark.parametrize("name", GPU_TESTS)
def test_every_import_of_a_gpu_test_resolves(name, monkeypatch):
    path = os.path.join(TESTS, "gpu", name)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    spec = importlib.util.spec_from_file_location(f"gpu_{name[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (module level: pytest marks only, no CUDA work)
    monkeypatch.setattr(sys, "path", [*getattr(module, "IMPORT_PATHS", []), *sys.path])
    checked = 0
    for module_name, names in _imports(tree):
        imported = importlib.import_module(module_name)
        for attr in names:
            assert hasattr(imported, attr) or importlib.util.find_spec(f"{module_name}.{attr}") is not None, \
                f"{name}: from {module_name} import {attr}"
        checked += 1
    assert checked > 0
