"""The committed config reference is exactly what the models generate, so docs never drift."""
import subprocess
import sys
from pathlib import Path

from zeroengine.config import docs
from zeroengine.config.auto import AUTO_RULES
from zeroengine.config.root import ZeroEngineConfig
from zeroengine.config.translate import section_model
from zeroengine.config.unsupported import UNSUPPORTED

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "config-reference.md"
REGENERATE = "python -m zeroengine.config.docs --write docs/config-reference.md"


def test_committed_reference_is_up_to_date():
    assert REFERENCE.read_text(encoding="utf-8") == docs.render(), f"stale reference: run `{REGENERATE}`"


def test_every_key_has_a_description():
    def walk(model, path):
        for name, field in model.model_fields.items():
            assert field.description, f"{path}{name} has no description"
            inner = section_model(field.annotation)
            if inner is not None:
                walk(inner, f"{path}{name}.")
    walk(ZeroEngineConfig, "")


def test_reference_lists_every_key_auto_rule_and_unsupported_feature():
    text = docs.render()
    for name in ZeroEngineConfig.model_fields:
        assert f"| `{name}` |" in text
    for rule in AUTO_RULES:
        assert f"`{rule.path}`" in text
    for section, entries in UNSUPPORTED.items():
        for entry in entries:
            assert f"`{section + '.' if section else ''}{entry.key}`" in text
    for name in ("`optimizer.params` for type `CPUAdam`", "`scheduler.params` for type `OneCycle`",
                 "`zero_optimization.offload_param`", "## Batch size"):
        assert name in text


def test_module_command_writes_the_reference(tmp_path):
    out = tmp_path / "ref.md"
    subprocess.run([sys.executable, "-m", "zeroengine.config.docs", "--write", str(out)], check=True, cwd=REPO)
    assert out.read_text(encoding="utf-8") == docs.render()


def test_main_prints_the_reference(capsys):
    assert docs.main([]) == 0
    assert capsys.readouterr().out == docs.render()
