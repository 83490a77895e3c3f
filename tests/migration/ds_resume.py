"""Real DeepSpeed 0.19.8 resumes checkpoints ``ze_to_deepspeed`` wrote (tests/distributed/test_ze_to_deepspeed.py).

    PYTHONPATH=<repo>/.deepspeed_anchor DS_ACCELERATOR=cpu python tests/migration/ds_resume.py SPEC.json OUT.pt

SPEC: ``{"world": N, "port": P, "first_step": S, "steps": K, "cases": [{"name", "dir", "stage", "dtype",
"universal"}, ...]}``. One process per rank (gloo); every rank goes through the cases in one process, each with
a fresh model and engine: ``deepspeed.initialize`` with the case's stage and precision, ``load_checkpoint``,
then K steps on global batches S, S+1, ... . Rank 0 writes ``{name: {"losses", "lr", "params",
"zero_to_fp32"}}`` to OUT (losses averaged over ranks, lr after each step, the full module parameters after
the last, and what DeepSpeed's own zero_to_fp32 reads from the checkpoint before training).

The model, param groups, config and batches are defined here, with no DeepSpeed import at module level, and
the test imports them for zeroengine's side: both sides train the same thing on the same data.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn

GLOBAL_BATCH = 8


class Net(nn.Module):
    """Two param groups (decayed matrices; biases and norm), sizes that leave padding at 1 and 2 ranks, a frozen
    parameter and a buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.n = nn.LayerNorm(16)
        self.b = nn.Linear(16, 5)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x):
        return self.b(torch.tanh(self.n(self.a(x)))) * self.scale


def make_model() -> Net:
    torch.manual_seed(0)
    model = Net()
    model.n.weight.requires_grad_(False)
    return model


def param_groups(model: nn.Module) -> list[dict]:
    """The trainable parameters (at stage 0 DeepSpeed's torch optimizer indexes every parameter it holds)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for _, p in named if p.dim() > 1]},
            {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0}]


def config(world: int, stage: int, dtype: str = "fp32", universal: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def batch(step: int, rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    per_rank = GLOBAL_BATCH // world
    return x[rank * per_rank:(rank + 1) * per_rank].to(dtype)


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def _resume(case: dict, spec: dict, rank: int, world: int) -> dict:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidated = None
    if rank == 0 and case["stage"] > 0 and not case["universal"]:
        consolidated = get_fp32_state_dict_from_zero_checkpoint(case["dir"])
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=config(world, case["stage"], case["dtype"], case["universal"]))
    path, _ = engine.load_checkpoint(case["dir"])
    assert path is not None, f"DeepSpeed found no checkpoint in {case['dir']}"
    dtype = next(engine.module.parameters()).dtype
    losses, lrs = [], []
    for step in range(spec["first_step"], spec["first_step"] + spec["steps"]):
        loss = loss_of(engine(batch(step, rank, world, dtype)))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
        lrs.append(engine.get_lr()[0])
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=case["stage"] == 3):
        full = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "lr": lrs, "params": full, "zero_to_fp32": consolidated}


def _worker(rank: int, spec: dict, out: str) -> None:
    world = spec["world"]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(spec["port"]), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import logging

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from ds_checkpoint_common import skip_shared_memory_op

    deepspeed.utils.logger.setLevel(logging.WARNING)
    skip_shared_memory_op(deepspeed)
    # DeepSpeed's CPU accelerator refuses fp16, which torch runs on CPU: let it train to test the fp16 layout
    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: [torch.float32, torch.float16, torch.bfloat16]
    deepspeed.init_distributed(dist_backend="gloo")
    results = {case["name"]: _resume(case, spec, rank, world) for case in spec["cases"]}
    if rank == 0:
        torch.save(results, out)
    torch.distributed.barrier()
    # Exit at once: the interpreter's normal exit tears gloo down in C++ destructors that now and then abort
    # ("terminate called without an active exception") or wait out a peer's timeout (results are saved above).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(spec_path: str, out: str) -> None:
    import torch.multiprocessing as mp

    with open(spec_path) as f:
        spec = json.load(f)
    mp.spawn(_worker, args=(spec, out), nprocs=spec["world"])


if __name__ == "__main__":
    main(*sys.argv[1:3])
