"""What the DeepSpeed-checkpoint tests train, identically under DeepSpeed and zeroengine: pure torch.

The model, the config (DeepSpeed's JSON keys, read by both engines), and the data: global step k's batch is
the same 8 rows at every world size, each rank taking its consecutive share, so the same global batch (and
the same averaged gradient) goes into every step whatever the world size.
"""
import torch
import torch.nn as nn

GLOBAL_BATCH = 8
TRAIN_STEPS = 3  # before the checkpoint
CONTINUE_STEPS = 3  # after it


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 5)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x)))) * self.scale


def join_world(rank: int, world: int, port: int):
    """A DeepSpeed-side rank (spawned by its script): the rendezvous variables, the CPU accelerator, one thread;
    returns the deepspeed module (imported only here, in DeepSpeed's processes)."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    skip_shared_memory_op(deepspeed)
    return deepspeed


def skip_shared_memory_op(deepspeed) -> None:
    """Keep DeepSpeed's CPU backend on plain gloo collectives: otherwise its first process group JIT-compiles
    its shared-memory all-reduce (deepspeed_shm_comm, ~40 s on 2 cores, again for every checkout path since the
    build records its include paths), which these tests do not need."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def leave_world() -> None:
    """The end of a DeepSpeed-side rank: once every rank is done, exit at once. The interpreter's normal exit
    tears gloo down in C++ destructors that now and then abort ("terminate called without an active exception")
    or wait out a peer's timeout; os._exit skips them (results are written and flushed before)."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def param_groups(model: Net) -> list[dict]:
    """Two groups, decay and no-decay (the usual split): the checkpoint must keep each group's settings and
    state, and a stage-0 file, which names parameters by position only, must be read group by group."""
    matrices = [model.a.weight, model.b.weight]
    return [{"params": matrices},
            {"params": [p for p in model.parameters() if all(p is not m for m in matrices)], "weight_decay": 0.0}]


def config(stage: int, precision: str, world: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
           "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, "steps_per_print": 1000}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


def batch(step: int, rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    rows = torch.randn(GLOBAL_BATCH, 8, generator=torch.Generator().manual_seed(100 + step))
    share = GLOBAL_BATCH // world
    return rows[rank * share:(rank + 1) * share].to(dtype)


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def train(engine, first_step: int, steps: int, rank: int, world: int) -> dict:
    """``steps`` optimizer steps from global step ``first_step``: the global loss and the lr after each."""
    import torch.distributed as dist

    dtype = next(engine.module.parameters()).dtype
    losses, lrs = [], []
    for step in range(first_step, first_step + steps):
        loss = loss_of(engine(batch(step, rank, world, dtype)))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        lrs.append(engine.get_lr()[0])
    return {"losses": losses, "lrs": lrs}


def loaded_masters(engine, full_fp32) -> dict:
    """Right after loading: every trained parameter's fp32 master, full (``full_fp32``: the engine's
    safe_get_full_fp32_param, DeepSpeed's name)."""
    return {name: full_fp32(p).reshape(-1).tolist() for name, p in engine.module.named_parameters()}


def full_parameters(engine, gathered) -> dict:
    """Every parameter's full values (``gathered``: the engine's GatheredParameters), as lists of floats."""
    params = dict(engine.module.named_parameters())
    with gathered(list(params.values())):
        return {name: p.detach().float().reshape(-1).tolist() for name, p in params.items()}


# -- a pipeline run (DeepSpeed's PipelineModule and zeroengine's take the same layer list) -------------------------
PIPE_MICRO, PIPE_ACCUMULATION = 2, 2


def pipeline_layers(layer_spec) -> list:
    import torch.nn as nn

    return [layer_spec(nn.Linear, 8, 16), layer_spec(nn.Tanh), layer_spec(nn.Linear, 16, 16),
            layer_spec(nn.Linear, 16, 4)]


def pipeline_loss(output, target):
    return (output - target).pow(2).mean()


def pipeline_config(stage: int) -> dict:
    """No clipping at ZeRO 0: DeepSpeed 0.19.8's ZeRO-0 pipeline takes the clipping norm from the first stage's
    parameters only (its clip_grad_norm_ counts a parameter on model-parallel rank 0 only, and a pipeline grid's
    model-parallel rank is the stage), so the later stages' gradients are never clipped; zeroengine clips by
    the global norm, as one process does. At ZeRO 1 DeepSpeed clips by the global norm and so does the test."""
    return {"train_micro_batch_size_per_gpu": PIPE_MICRO, "gradient_accumulation_steps": PIPE_ACCUMULATION,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
            "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0 if stage > 0 else 0.0,
            "steps_per_print": 1000}


def pipeline_batches(first_step: int, steps: int) -> list:
    """The micro-batches (input, target) of global steps ``first_step`` .. (one data-parallel replica)."""
    out = []
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(500 + step)
        out += [(torch.randn(PIPE_MICRO, 8, generator=g), torch.randn(PIPE_MICRO, 4, generator=g))
                for _ in range(PIPE_ACCUMULATION)]
    return out


def pipeline_train(engine, first_step: int, steps: int) -> list[float]:
    batches = iter(pipeline_batches(first_step, steps))
    return [float(engine.train_batch(batches)) for _ in range(steps)]


def pipeline_parameters(engine) -> dict:
    """Every stage's parameters, full, gathered to every rank (lists of floats)."""
    import torch.distributed as dist

    mine = {name: p.detach().float().reshape(-1).tolist() for name, p in engine.module.named_parameters()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: values for stage in everyone for name, values in stage.items()}
