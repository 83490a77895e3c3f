"""The DeepSpeed version the alias reports (``as_deepspeed.DEEPSPEED_VERSION``) against the version gates of the
installed transformers and accelerate, read from their sources: it is the DeepSpeed whose behaviour the alias gives
(0.19.8, whose defaults zeroengine follows: gradient_clipping 1.0 since 0.19.3), it passes every gate, and no gate
lies between the highest one and it (a path gated on a DeepSpeed feature of 0.19 would need a look first);
docs/integrations.md lists every gate with what zeroengine does there. A new release of either library that adds or
moves a gate fails here until the version and the list are reconsidered."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from packaging.version import Version

from zeroengine.integrations.as_deepspeed import DEEPSPEED_VERSION

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
PACKAGES = ("transformers", "accelerate")
COMPARE = re.compile(r'compare_versions\(\s*"deepspeed"\s*,\s*"([<>=!]=?)"\s*,\s*("[^"]+"|\w+)\s*\)')
REQUIREMENT = re.compile(r'"deepspeed"\s*:\s*"deepspeed(>=|==|<)([0-9.]+)"')
# every other way to read DeepSpeed's version, and where the libraries do so without gating anything
OTHER_READS = re.compile(r'deepspeed\.__version__|version\(\s*"deepspeed"\s*\)|RequirementCache\(\s*"deepspeed'
                         r'|is_deepspeed_available\(\s*min_version')
INFORMATIONAL = {"transformers/cli/system.py"}  # `transformers env` prints the version


def _sources():
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None:
            pytest.skip(f"{package} is not installed")
        root = Path(spec.origin).parent
        for path in sorted(root.rglob("*.py")):
            yield f"{package}/{path.relative_to(root).as_posix()}", path.read_text(encoding="utf-8")


def _gates() -> list[tuple[str, str, str]]:
    """(file, comparison, version) for every gate; a version held in a variable is its last assignment before."""
    gates = []
    for name, text in _sources():
        for match in COMPARE.finditer(text):
            operator, value = match.groups()
            if not value.startswith('"'):
                value = re.findall(rf'\b{value}\s*=\s*("[^"]+")', text[:match.start()])[-1]
            gates.append((name, operator, value.strip('"')))
        gates += [(name, operator, version) for operator, version in REQUIREMENT.findall(text)]
    return gates


def test_the_reported_version_is_the_behaviour_given_and_passes_every_gate():
    gates = _gates()
    assert len(gates) >= 10, gates  # (the scan finds them)
    reported = Version(DEEPSPEED_VERSION)
    assert reported == Version("0.19.8")  # the DeepSpeed the migration guide compares against
    assert reported >= Version("0.19.3")  # gradient_clipping defaults to 1.0 from 0.19.3 on, as zeroengine's
    assert all(Version(version) <= reported for _, _, version in gates), gates
    # nothing is gated on a 0.19 release: the highest gate is still 0.18.2's (Ulysses SP), which zeroengine serves
    assert max(Version(version) for _, _, version in gates) == Version("0.18.2")


def test_the_docs_list_every_gate():
    rows = [line for line in DOCS.read_text(encoding="utf-8").splitlines() if line.startswith("| `")]
    missing = [gate for gate in _gates()
               if not any(f"`{gate[0]}`" in row and f"`{gate[1]} {gate[2]}`" in row for row in rows)]
    assert not missing, f"docs/integrations.md's gate table lacks {missing}"
    assert f"**{DEEPSPEED_VERSION}**" in DOCS.read_text(encoding="utf-8")


def test_nothing_else_reads_the_deepspeed_version():
    found = sorted({name for name, text in _sources() if OTHER_READS.search(text)})
    assert set(found) <= INFORMATIONAL, found
