"""ZEROENGINE_AS_DEEPSPEED: an unchanged script's ``import deepspeed`` (and transformers' and accelerate's
availability and version checks) get zeroengine with the variable set, through the start-up hook pip installs,
and the real DeepSpeed (or an ImportError) without it."""
import json
import site
import sys

import pytest
from runner import launch, run, script

from zeroengine.integrations import as_deepspeed


def _probe(switch: bool, *flags: str) -> dict:
    return json.loads(run(launch("python", 1, [script("probe_switch.py"), *flags]), switch=switch).stdout.splitlines()[-1])


def test_the_start_up_hook_is_installed_with_the_package():
    path = as_deepspeed.startup_hook_installed()
    assert path is not None, "zeroengine_as_deepspeed.pth missing from site-packages: reinstall zeroengine"
    with open(path) as f:
        hook = f.read()
    # The hook reads the variable itself (importing zeroengine only when it is on): as requested() does.
    off_values = "not in (" + ", ".join(f'"{v}"' for v in as_deepspeed.OFF_VALUES) + ")"
    assert "ZEROENGINE_AS_DEEPSPEED" in hook and off_values in hook


def test_without_the_switch_deepspeed_is_the_real_package_or_missing():
    seen = _probe(False)
    assert seen["spec_origin"] is None or "zeroengine" not in seen["spec_origin"]
    if seen["file"] is None:  # not installed: the plain ImportError
        assert "deepspeed" in seen["import_error"] and seen["version"] is None
    else:  # installed (the benchmark extra): the real one, at its own version
        assert "zeroengine" not in seen["file"] and seen["version"] == seen["dunder_version"]


def test_with_the_switch_every_path_the_integrations_import_is_zeroengine():
    seen = _probe(True, "--paths")
    assert "zeroengine/integrations/ds_compat" in seen["spec_origin"] and "ds_compat" in seen["file"]
    assert seen["version"] == seen["dunder_version"] == as_deepspeed.DEEPSPEED_VERSION  # ahead of any real install
    assert seen["engine_is_zeroengine"] and seen["zero_is_zeroengine"] and seen["same_module_both_names"]
    assert seen["initialize"] == "zeroengine.integrations.ds_compat.entry"
    assert set(seen["schedules"]) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"}
    assert seen["logger"] == "zeroengine" and seen["comm_initialized"] is False
    assert seen["accelerator"] == ["cpu", "gloo"] or seen["accelerator"][1] == "nccl"
    assert seen["cpu_adam"][:2] == ["DeepSpeedCPUAdam", "CPUAdam"] and seen["optimizer_base"] == "ZeroOptimizer"
    # a copy: its own storage (a view's clone no longer holds its base), the same values, and writing it leaves
    # the original as it was
    assert seen["clone"] == {"own_storage": True, "equal": True, "original_unchanged": True,
                             "view_trimmed": True, "nested": True}
    assert seen["transformers_sees_it"] and seen["accelerate_sees_it"]
    assert "deepspeed.no_such_module" in seen["missing_module"]  # a name zeroengine lacks is an ImportError


@pytest.mark.parametrize("value", [*as_deepspeed.OFF_VALUES, "FALSE", "No", " Off ", "\t0\n"])
def test_the_switch_off_values_switch_nothing(value):
    """0, false, no, off and empty (in any case, spaces around ignored) are off, as docs/integrations.md says."""
    assert set(as_deepspeed.OFF_VALUES) == {"", "0", "false", "no", "off"}
    assert not as_deepspeed.requested({"ZEROENGINE_AS_DEEPSPEED": value})
    assert not as_deepspeed.requested({})


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "TRUE"])
def test_the_switch_on_values_switch_it_on(value):
    assert as_deepspeed.requested({"ZEROENGINE_AS_DEEPSPEED": value})


def _site_dirs(monkeypatch, site_packages, user_site):
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(site_packages)])
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(user_site))
    monkeypatch.setattr(site, "ENABLE_USER_SITE", True)


def test_a_hook_only_on_sys_path_is_not_installed(tmp_path, monkeypatch):
    """site runs .pth files from site directories only: one in the current directory or on PYTHONPATH never
    runs, so it does not count as installed."""
    plain, site_packages, user_site = (tmp_path / name for name in ("on_path", "site-packages", "user-site"))
    for folder in (plain, site_packages, user_site):
        folder.mkdir()
    (plain / as_deepspeed.HOOK_NAME).write_text("# not run\n")
    _site_dirs(monkeypatch, site_packages, user_site)
    monkeypatch.setattr(sys, "path", [str(plain), ""])
    monkeypatch.chdir(plain)
    assert as_deepspeed.startup_hook_installed() is None


@pytest.mark.parametrize("where", ["site-packages", "user-site"])
def test_a_hook_in_a_site_directory_is_installed(tmp_path, monkeypatch, where):
    site_packages, user_site = tmp_path / "site-packages", tmp_path / "user-site"
    for folder in (site_packages, user_site):
        folder.mkdir()
    hook = tmp_path / where / as_deepspeed.HOOK_NAME
    hook.write_text("# run at start-up\n")
    _site_dirs(monkeypatch, site_packages, user_site)
    monkeypatch.setattr(sys, "path", [])
    assert as_deepspeed.startup_hook_installed() == str(hook)
    if where == "user-site":  # python -s (or an environment that disables the user site) runs none of it
        monkeypatch.setattr(site, "ENABLE_USER_SITE", False)
        assert as_deepspeed.startup_hook_installed() is None


def test_the_launcher_flag_switches_the_ranks(tmp_path):
    out = tmp_path / "seen"
    program = tmp_path / "where.py"
    program.write_text("import os, deepspeed\n"
                       f"open(r'{out}' + os.environ['RANK'], 'w').write(deepspeed.__file__)\n")
    run(launch("zeroengine", 2, [str(program)]), switch=False)
    for rank in (0, 1):
        assert "zeroengine" in (tmp_path / f"seen{rank}").read_text()


def test_the_launcher_flag_is_passed_to_remote_nodes():
    from zeroengine.launcher.commands import EXPORT_NAMES

    assert "ZEROENGINE_AS_DEEPSPEED" in EXPORT_NAMES
