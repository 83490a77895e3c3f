"""Where an offloaded optimizer step spends its time (one GPU, one rank): the phases of ZeroOptimizer.step timed.

    python benchmarks/profile_offload.py [--model 1.3b] [--stage 2] [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_gpu import MODELS, free_port  # noqa: E402
from gpu_worker import GPT, GPTConfig  # noqa: E402

import zeroengine  # noqa: E402
from zeroengine.zero.sharded import ShardedOptimizer  # noqa: E402

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(cls, name):
    real = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = real(self, *args, **kwargs)
        torch.cuda.synchronize()
        TIMES[name].append(time.perf_counter() - start)
        return out

    setattr(cls, name, wrapper)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1.3b")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro", type=int, default=8)
    args = p.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name in ("_unscaled_fp32_grads", "_grad_norm", "_optimizer_step", "_refresh_model_params", "zero_grad"):
        timed(ShardedOptimizer, name)
    cfg = GPTConfig(**MODELS[args.model])
    with torch.device("cuda"):
        model = GPT(cfg)
    engine, _, _, _ = zeroengine.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": args.micro, "gradient_clipping": 1.0, "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 200_000_000,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}}})
    x = torch.randint(cfg.vocab_size, (args.micro, cfg.block_size), device="cuda")
    phases = defaultdict(list)
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(x, x)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        engine.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        phases["forward"].append(t1 - t0)
        phases["backward"].append(t2 - t1)
        phases["step"].append(t3 - t2)
    report = {"threads": torch.get_num_threads(), "cpu_adam_backend": getattr(engine.optimizer.optimizer, "backend",
                                                                              None),
              "phases_s": {k: v[1:] for k, v in phases.items()}, "step_parts_s": {k: v[1:] for k, v in TIMES.items()}}
    print(json.dumps(report, indent=1))
    zeroengine.comm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
