"""One GPU benchmark run in a fresh process (see bench_gpu.py): build, train a few steps, print one JSON line.

    python benchmarks/gpu_worker.py '{"model": {...}, "stage": 2, "dtype": "bf16", ...}'

A fresh process per run keeps CUDA memory statistics, the allocator and any
out-of-memory failure to that run alone.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "gpt"))
from model import GPT, GPTConfig  # noqa: E402

import zeroengine  # noqa: E402


def flops_per_token(cfg: GPTConfig, params: int) -> float:
    """Model FLOPs of forward + backward per token: 6 per weight (PaLM's count; the position embedding is a
    lookup, the tied head a real matmul) plus causal attention's 6·L·T·d (QK^T and AV, halved by the mask)."""
    dense = params - cfg.block_size * cfg.n_embd
    return 6 * dense + 6 * cfg.n_layer * cfg.block_size * cfg.n_embd


def run(spec: dict) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPTConfig(**spec["model"], dropout=0.0)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = GPT(cfg)
    params = model.num_params()
    zero = {"stage": spec["stage"], "reduce_bucket_size": spec.get("bucket", 200_000_000),
            "allgather_bucket_size": spec.get("bucket", 200_000_000), "overlap_comm": True}
    if spec.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if spec.get("offload_param"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "bf16": {"enabled": spec["dtype"] == "bf16"}, "fp16": {"enabled": spec["dtype"] == "fp16"},
        "zero_optimization": zero,
    }
    engine, _, _, _ = zeroengine.initialize(model=model, config=config)
    build_s = time.perf_counter() - t0
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(cfg.vocab_size, (spec["micro"], cfg.block_size), device="cuda", generator=g)
    y = torch.randint(cfg.vocab_size, (spec["micro"], cfg.block_size), device="cuda", generator=g)
    times, losses = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))  # synchronizes
        torch.cuda.synchronize()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - start)
    times.sort()
    step_s = times[len(times) // 2]
    tokens = spec["micro"] * cfg.block_size
    mem = engine.memory_breakdown()
    return {
        **spec, "params": params, "build_s": round(build_s, 2), "step_s": step_s,
        "tokens_per_s": tokens / step_s, "model_tflops": flops_per_token(cfg, params) * tokens / step_s / 1e12,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30, "losses": losses,
        "finite": all(l == l and abs(l) != float("inf") for l in losses),
        "skipped_steps": engine.skipped_steps,
        "memory_breakdown_gib": {k: v / 2**30 for k, v in mem.items()}, "gpu": torch.cuda.get_device_name(),
    }


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        result = run(spec)
    except torch.OutOfMemoryError as err:
        result = {**spec, "error": f"CUDA out of memory: {str(err).splitlines()[0]}"}
    except MemoryError as err:
        result = {**spec, "error": f"host out of memory: {err}"}
    print("RESULT " + json.dumps(result), flush=True)
    zeroengine.comm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
