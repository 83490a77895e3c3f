"""Every hang bound inside the tests fires before pytest-timeout's, so a hung test fails naming what hung.

run_distributed's bound names the rank that did not report, subprocess.run's the command; pytest-timeout's
(``timeout`` in pyproject.toml, or a ``pytest.mark.timeout`` on the test or its module) names only the test.
So every ``timeout=`` / ``timeout_s=`` given as a number in tests/ (and every such parameter's default, as in
``run_distributed`` and tests/integrations/runner.py's ``run``) must be below the pytest timeout that applies
where it stands, by a margin for the harness to stop the ranks and report. A helper's bound is held to its
module's mark or the global timeout (it cannot know which test calls it). Read from the source (ast).

Checked per call: a test that runs several bounded calls one after another needs a mark covering their sum
(the integration modules and tests/distributed/test_migration.py carry one, sized by hand)."""
from __future__ import annotations

import ast
from pathlib import Path

from zeroengine.testing import harness

TESTS = Path(__file__).resolve().parents[1]
BOUND_NAMES = ("timeout", "timeout_s")
# After its bound the harness kills the ranks and collects their reports (seconds), subprocess.run kills and
# reaps its child: the test must still be running to report it.
MARGIN_S = 30


def _number(node) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    return None


def _timeout_marks(node) -> list[float]:
    """The N of every ``pytest.mark.timeout(N)`` (or ``timeout=N``) in an expression: a decorator, a list."""
    found = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "timeout" \
                and isinstance(call.func.value, ast.Attribute) and call.func.value.attr == "mark":
            values = [_number(a) for a in call.args[:1]] + [_number(k.value) for k in call.keywords
                                                            if k.arg == "timeout"]
            found += [v for v in values if v is not None]
    return found


def _module_mark(tree: ast.Module) -> float | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            marks = _timeout_marks(node.value)
            if marks:
                return marks[0]
    return None


def _bounds(tree: ast.Module, outer: float):
    """(line, what, seconds, the pytest timeout that applies) for every numeric bound in a module."""
    module_outer = _module_mark(tree) or outer

    def visit(node, applies):
        for child in ast.iter_child_nodes(node):
            here = applies
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                marks = [m for d in child.decorator_list for m in _timeout_marks(d)]
                if child.name.startswith("test") and marks and applies == module_outer:
                    here = marks[0]
                arguments = child.args
                positional = arguments.posonlyargs + arguments.args
                defaults = list(zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults))
                defaults += [(a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is not None]
                for argument, default in defaults:
                    seconds = _number(default)
                    if argument.arg in BOUND_NAMES and seconds is not None:
                        yield child.lineno, f"default {argument.arg}= of {child.name}()", seconds, here
            if isinstance(child, ast.Call):
                for keyword in child.keywords:
                    seconds = _number(keyword.value)
                    if keyword.arg in BOUND_NAMES and seconds is not None:
                        yield child.lineno, f"{ast.unparse(child.func)}({keyword.arg}=...)", seconds, here
            yield from visit(child, here)

    yield from visit(tree, module_outer)


def _scan(paths, outer: float):
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, what, seconds, applies in _bounds(tree, outer):
            yield f"{path}:{line}", what, seconds, applies


def _offenders(found):
    return [f"{where}: {what} is {seconds:.0f} s, but pytest-timeout stops the test at {applies:.0f} s "
            f"(keep it at most {applies - MARGIN_S:.0f} s, or mark the test or module "
            f"@pytest.mark.timeout({seconds + MARGIN_S:.0f}) or more)"
            for where, what, seconds, applies in found if seconds + MARGIN_S > applies]


def test_every_inner_bound_fires_before_pytest_timeout(pytestconfig):
    outer = float(pytestconfig.getini("timeout"))
    assert outer > 0, "pyproject.toml's [tool.pytest.ini_options] timeout is what bounds every test"
    found = list(_scan([*sorted(TESTS.rglob("*.py")), Path(harness.__file__)], outer))
    # the scan sees the bounds that matter (a scan that finds nothing passes anything)
    seen = {what for _, what, _, _ in found}
    assert {"default timeout_s= of run_distributed()", "default timeout= of run()",
            "run_distributed(timeout_s=...)", "subprocess.run(timeout=...)"} <= seen, sorted(seen)
    assert not _offenders(found), "\n".join(_offenders(found))


def test_the_scan_holds_a_bound_to_the_mark_that_applies_where_it_stands(tmp_path):
    source = tmp_path / "test_example.py"
    source.write_text(
        "import pytest, subprocess\n"
        "from zeroengine.testing import run_distributed\n"
        "pytestmark = [pytest.mark.slow, pytest.mark.timeout(500)]\n"
        "def helper(timeout=420):\n"
        "    subprocess.run(['true'], timeout=timeout)\n"
        "def test_module_mark():\n"
        "    run_distributed(print, 2, timeout_s=480)\n"
        "@pytest.mark.timeout(900)\n"
        "def test_own_mark():\n"
        "    def inner():\n"
        "        run_distributed(print, 2, timeout_s=850)\n"
        "    subprocess.run(['true'], timeout=880)\n")
    assert [(where.rsplit(":", 1)[1], seconds, applies) for where, _, seconds, applies in _scan([source], 300)] == \
        [("4", 420, 500), ("7", 480, 500), ("11", 850, 900), ("12", 880, 900)]
    offenders = _offenders(_scan([source], 300))
    assert len(offenders) == 2 and ":7: run_distributed(timeout_s=...) is 480 s" in offenders[0]
    assert ":12: subprocess.run(timeout=...) is 880 s" in offenders[1]
    source.write_text(source.read_text().replace("pytestmark = [pytest.mark.slow, pytest.mark.timeout(500)]\n", ""))
    assert [applies for *_, applies in _scan([source], 300)] == [300, 300, 900, 900]
