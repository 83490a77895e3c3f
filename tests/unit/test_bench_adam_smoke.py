"""benchmarks/bench_adam.py on a small parameter: every candidate runs, and --lean's bf16-master rows report the
bytes they move (22 per parameter with fp32 moments, 14 with bf16 ones) and their ratios against torch's fused
step on bf16 params and against the fp32-master step; --as-avx2-cpu runs as a CPU without AVX-512 would."""
from bench_runs import run_benchmark


def test_bench_adam_lean_rows(tmp_path):
    _, result = run_benchmark("bench_adam.py", tmp_path / "adam.json", "--params", "100000", "--repeats", "2",
                              "--lean")
    rows = {r["name"]: r for r in result["results"]}
    level = next(n for n in rows if n.startswith("zeroengine CPUAdam (cpp-")).removeprefix("zeroengine CPUAdam (cpp-")
    level = level.rstrip(")")
    assert rows[f"zeroengine CPUAdam bf16 masters (cpp-{level})"]["bytes_per_param"] == 22
    assert rows[f"zeroengine CPUAdam bf16 masters+moments (cpp-{level})"]["bytes_per_param"] == 14
    assert rows["torch AdamW fused, bf16 params+moments"]["bytes_per_param"] == 14
    assert rows[f"zeroengine CPUAdam (cpp-{level})"]["bytes_per_param"] == 28
    for key in (f"cpuadam_{level}_vs_fastest_peer", f"bf16_states_{level}_vs_torch_fused_bf16",
                f"bf16_states_{level}_vs_fp32_masters"):
        assert result["ratios"][key] > 0


def test_bench_adam_as_an_avx2_cpu(tmp_path):
    """--as-avx2-cpu re-runs the script with torch's kernels dispatched at AVX2, times only the kernel's AVX2 build,
    and records both in the result; its ratios include the paired one."""
    _, result = run_benchmark("bench_adam.py", tmp_path / "adam.json", "--params", "100000", "--repeats", "2",
                              "--as-avx2-cpu")
    assert result["machine"]["as_avx2_cpu"] is True
    assert result["machine"]["torch_cpu_capability"] == "AVX2"
    kernels = [r["name"] for r in result["results"] if r["name"].startswith("zeroengine CPUAdam (cpp-")]
    assert kernels == ["zeroengine CPUAdam (cpp-avx2)"]
    assert result["ratios"]["cpuadam_avx2_vs_fastest_peer_paired"] > 0
