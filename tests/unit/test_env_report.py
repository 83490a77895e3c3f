"""ze_report: the environment report and the --estimate table."""
import json

import pytest

from zeroengine import env_report
from zeroengine.estimate import estimate_memory


def test_json_report_has_the_environment_and_the_op_table(capsys):
    assert env_report.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("torch", "cuda_available", "gloo", "nccl", "simd", "memory_total_gib", "ninja", "ops"):
        assert key in report
    assert {op["name"] for op in report["ops"]} >= {"cpu_adam", "fused_adam"}


def test_estimate_table_matches_estimate_memory(capsys):
    assert env_report.main(["--estimate", "1e9", "--world", "8"]) == 0
    out = capsys.readouterr().out
    stage2_offload = [line for line in out.splitlines() if line.startswith("2") and "optimizer" in line][0]
    fp32 = estimate_memory(10**9, 8, 2, offload_optimizer=True)
    assert f"{fp32['device'] / 2**30:.2f}" in stage2_offload and f"{fp32['cpu'] / 2**30:.2f}" in stage2_offload


def test_estimate_rejects_nonsense():
    with pytest.raises(SystemExit):
        env_report.main(["--estimate", "-5"])


@pytest.mark.parametrize("argv", [["--estimate", "nan"], ["--estimate", "inf"], ["--estimate", "0.5"],
                                  ["--world", "2"], ["--estimate", "1e6", "--json"]])
def test_estimate_arguments_that_cannot_mean_anything_are_usage_errors(argv, capsys):
    from zeroengine.env_report import main
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "ze_report: error:" in capsys.readouterr().err


@pytest.mark.parametrize("simd,switch,shown", [
    ("avx2", "1", "small-row GEMMs: on"),
    ("scalar", "1", "small-row GEMMs: off, ATen's GEMMs instead (SIMD scalar)"),
    ("avx2", "0", "small-row GEMMs: off, ATen's GEMMs instead (ZEROENGINE_MOE_SMALL_GEMM=0)")])
def test_report_says_whether_the_moe_small_row_gemms_are_in_use(simd, switch, shown, monkeypatch, capsys):
    # a forced SIMD level changes the build hash: nothing is built here, the report never builds
    monkeypatch.setenv("ZEROENGINE_SIMD", simd)
    monkeypatch.setenv("ZEROENGINE_MOE_SMALL_GEMM", switch)
    assert env_report.main(["--no-color"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("moe_dispatch "))
    assert shown in line


def test_coloured_op_table_lines_up_like_the_plain_one():
    # the colour codes used to count as column width, so a terminal saw "[OKAY][OKAY]/path"
    import re

    report = env_report.collect()
    plain = env_report.render(report, color=False)
    coloured = env_report.render(report, color=True)
    assert "\x1b[" in coloured
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured) == plain


def test_the_report_says_whether_the_as_deepspeed_switch_can_work(capsys):
    report = env_report.collect()["as_deepspeed"]
    assert report["hook"] is not None and report["hook"].endswith("zeroengine_as_deepspeed.pth")
    assert report["requested"] is report["active"] is False  # (the tests run without the switch)
    missing = env_report._switch_line(dict(report, hook=None), color=False)
    assert missing.startswith("[NO]") and "switches nothing" in missing
