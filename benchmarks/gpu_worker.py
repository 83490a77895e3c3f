"""One GPU benchmark run in a fresh process (see bench_gpu.py): build, train a few steps, print one JSON line.

    python benchmarks/gpu_worker.py '{"model": {...}, "stage": 2, "dtype": "bf16", ...}'

A fresh process per run keeps CUDA memory statistics, the allocator and any
out-of-memory failure to that run alone.

Spec keys besides the model: ``stage``, ``dtype``, ``micro``, ``compile`` (engine.compile()), ``fetch_blocks``
(stage3_fetch_unit "block"), ``offload_optimizer``,
``offload_param``, ``ratio`` (offload_optimizer.ratio, or "auto": the share of
the Adam state the host's available memory holds, see ``auto_ratio``) and
``init`` (build under zero.Init on the GPU with the slices in CPU memory, so
the whole fp32 model never sits on the GPU). ``engine: "deepspeed"`` runs the same model and config through
DeepSpeed (importable from ``$ZEROENGINE_DEEPSPEED_PATH``, e.g. the git-ignored .deepspeed_anchor/) instead:
the side-by-side anchor. Without offload its optimizer is torch's AdamW (``torch_adam``, foreach), so its
FusedAdam is not JIT-built inside a short lease (the step is a few percent of a 1.3B step either way); with
optimizer offload it is DeepSpeedCPUAdam, JIT-built by the run (counted in ``build_s``, not in the steps).
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


def gpt_params(cfg: GPTConfig) -> int:
    """Parameters of examples/gpt's GPT (tied head) without building it."""
    d, layers = cfg.n_embd, cfg.n_layer
    per_layer = 12 * d * d + 13 * d  # attention 4d^2+4d, MLP 8d^2+5d, two LayerNorms 4d
    return cfg.vocab_size * d + cfg.block_size * d + layers * per_layer + 2 * d


def auto_ratio(params: int, offload_param: bool) -> float:
    """The share of the optimizer the host can take: each offloaded parameter costs 12 bytes of host memory
    (fp32 master, Adam m and v; the 16-bit copy-out is two staging buckets), offload_param adds 2 per
    parameter, and the fp32 values zero.Init kept (4 per parameter) are held while initialize() cuts the
    masters from them; 10% of the available memory is left for everything else."""
    available = _meminfo_bytes("MemAvailable") * 0.9 - (2 * params if offload_param else 0)
    return max(0.0, min(1.0, available / (12 * params), (available - 4 * params) / (4 * params)))


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def run(spec: dict) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPTConfig(**spec["model"], dropout=0.0)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    zero = {"stage": spec["stage"], "reduce_bucket_size": spec.get("bucket", 200_000_000),
            "allgather_bucket_size": spec.get("bucket", 200_000_000), "overlap_comm": True}
    if spec.get("offload_optimizer"):
        ratio = spec.get("ratio", 1.0)
        if ratio == "auto":
            ratio = spec["ratio_used"] = round(auto_ratio(gpt_params(cfg), bool(spec.get("offload_param"))), 3)
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": ratio}
    if spec.get("offload_param"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if spec.get("init"):  # one full parameter at a time on the GPU; slices and fp32 values in CPU memory
        with zeroengine.zero.Init(config={"zero_optimization": zero}, remote_device="cpu"), torch.device("cuda"):
            model = GPT(cfg)
    else:
        with torch.device("cuda"):
            model = GPT(cfg)
    params = model.num_params()
    config = {
        "train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "bf16": {"enabled": spec["dtype"] == "bf16"}, "fp16": {"enabled": spec["dtype"] == "fp16"},
        "zero_optimization": zero,
    }
    if spec.get("fetch_blocks"):  # stage 3: gather each block's parameters as one fetch (what compile does)
        zero["stage3_fetch_unit"] = "block"
    if spec.get("engine") == "deepspeed":
        engine = _deepspeed_engine(model, config)
    else:
        engine, _, _, _ = zeroengine.initialize(model=model, config=config)
    if spec.get("compile"):  # each block's forward under torch.compile; the first step compiles
        engine.compile()

    build_s = time.perf_counter() - t0
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(cfg.vocab_size, (spec["micro"], cfg.block_size), device="cuda", generator=g)
    y = torch.randint(cfg.vocab_size, (spec["micro"], cfg.block_size), device="cuda", generator=g)
    times, losses, first_step_s = [], [], None
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
        elif i == 0:
            first_step_s = time.perf_counter() - start  # with compile: mostly compiling
    times.sort()
    step_s = times[len(times) // 2]
    tokens = spec["micro"] * cfg.block_size
    mem = {} if spec.get("engine") == "deepspeed" else engine.memory_breakdown()  # (DeepSpeed's is a config flag)
    return {
        **spec, "params": params, "build_s": round(build_s, 2), "first_step_s": first_step_s and round(first_step_s, 2),
        "step_s": step_s,
        "tokens_per_s": tokens / step_s, "model_tflops": flops_per_token(cfg, params) * tokens / step_s / 1e12,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30, "losses": losses,
        "finite": all(l == l and abs(l) != float("inf") for l in losses),
        "skipped_steps": engine.skipped_steps,
        "memory_breakdown_gib": {k: v / 2**30 for k, v in mem.items()}, "gpu": torch.cuda.get_device_name(),
    }


def _deepspeed_engine(model, config: dict):
    """DeepSpeed 0.19.8 on the same model and config (its keys are DeepSpeed's); import path from the env."""
    path = os.environ.get("ZEROENGINE_DEEPSPEED_PATH")
    if path:
        sys.path.insert(0, path)
    import deepspeed

    config = json.loads(json.dumps(config))
    if "offload_optimizer" not in config["zero_optimization"]:
        config["optimizer"]["params"].update(torch_adam=True, foreach=True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        result = run(spec)
    except torch.OutOfMemoryError as err:
        result = {**spec, "error": f"CUDA out of memory: {str(err).splitlines()[0]}"}
    except MemoryError as err:
        result = {**spec, "error": f"host out of memory: {err}"}
    print("RESULT " + json.dumps(result), flush=True)
    if spec.get("engine") == "deepspeed":
        torch.distributed.destroy_process_group()
    else:
        zeroengine.comm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
