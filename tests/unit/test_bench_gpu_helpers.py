"""bench_gpu's arithmetic that runs before any GPU is touched: the parameter count it sizes models by and
the share of the optimizer it offloads (``--offload_ratio auto``)."""
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_gpu  # noqa: E402
import gpu_worker  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


@pytest.mark.parametrize("shape", [dict(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=100),
                                   dict(n_layer=3, n_embd=96, n_head=6, block_size=48, vocab_size=257)])
def test_parameter_count_without_building_matches_the_model(shape):
    cfg = GPTConfig(**shape, dropout=0.0)
    assert gpu_worker.gpt_params(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_auto_ratio_offloads_what_the_host_holds(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(gpu_worker, "_meminfo_bytes", lambda key: 120 * gib)
    params = 10_680_000_000  # 52 layers at width 4096: 3.1x the largest model that fits without offload
    ratio = gpu_worker.auto_ratio(params, offload_param=False)
    assert ratio * params * 12 <= 0.9 * 120 * gib < (ratio + 0.01) * params * 12  # 12 host bytes per parameter
    assert gpu_worker.auto_ratio(params, offload_param=True) < ratio  # 16-bit shards take host memory too
    assert gpu_worker.auto_ratio(1_000_000, offload_param=False) == 1.0
    monkeypatch.setattr(gpu_worker, "_meminfo_bytes", lambda key: 1 * gib)
    assert gpu_worker.auto_ratio(params, offload_param=False) == 0.0  # not even zero.Init's fp32 values fit


def test_largest_runs_build_offloaded_models_under_init_with_the_ratio_given():
    runs = bench_gpu.largest_runs({False: [16], True: [52]}, offload_ratio="auto")
    plain, offloaded = runs
    assert not plain["offload_optimizer"] and "init" not in plain
    assert offloaded["offload_optimizer"] and offloaded["init"] and offloaded["ratio"] == "auto"
    assert offloaded["model"]["n_layer"] == 52 and offloaded["stage"] == 3


def test_only_selects_runs_by_label_and_names_the_labels_when_nothing_matches():
    runs = bench_gpu.throughput_runs(["350m", "1.3b"], micro=8)
    labels = [bench_gpu.run_label(r) for r in runs]
    assert "1.3b/s3/bf16/offload@0.5" in labels and "350m/s3/bf16/offload/params" in labels
    assert "1.3b/s3/bf16/compile" in labels and "350m/s3/bf16/blocks" in labels
    assert "1.3b/s3/bf16/deepspeed" in labels and "1.3b/s3/bf16/offload/deepspeed" in labels
    # the patterns' order (a lease cut short keeps the runs named first), each run once
    chosen = bench_gpu.select(runs, "1.3b/s0/*,*/s2/fp16,1.3b/s0/bf16")
    assert [bench_gpu.run_label(r) for r in chosen] == ["1.3b/s0/bf16", "1.3b/s0/bf16/compile",
                                                        "1.3b/s0/bf16/deepspeed", "350m/s2/fp16", "1.3b/s2/fp16"]
    assert bench_gpu.select(runs, "") == runs
    with pytest.raises(SystemExit, match="350m/s0/bf16"):
        bench_gpu.select(runs, "2.7b/*")
    largest = bench_gpu.largest_runs({False: [24], True: [52]})
    assert [bench_gpu.run_label(r) for r in largest] == ["w4096-L24/s3/bf16", "w4096-L52/s3/bf16/offload@auto"]
