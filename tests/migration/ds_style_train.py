"""A training script written against DeepSpeed's engine API, as DeepSpeed users write them.

Run with DeepSpeed:   deepspeed  --num_gpus 2 ds_style_train.py --deepspeed --deepspeed_config ds_config.json
Run with zeroengine:  zeroengine --num_gpus 2 ds_style_train.py --deepspeed --deepspeed_config ds_config.json
after changing the single line ``import deepspeed`` to ``import zeroengine as deepspeed``; nothing else.
tests/distributed/test_migration.py makes exactly that one-line change and runs the result.

What it touches: argparse + ``add_config_arguments`` (reading ``args.deepspeed_config`` itself, as
many scripts do), ``init_distributed``, ``zero.Init``, ``zero.GatheredParameters`` (rank 0 edits a
parameter), ``checkpointing.checkpoint``, ``moe.layer.MoE``, the ``comm`` calls
(``get_rank``/``get_world_size``/``all_reduce``/``barrier``), ``initialize(args=..., model=...,
model_parameters=..., training_data=...)``, forward/backward/step, the engine's accessors, and
``save_checkpoint``/``load_checkpoint`` with ``client_state``.

MoE is used with a stage-0 config: DeepSpeed's ZeRO 1/2 additionally demand that the optimizer's
parameter groups be split with ``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``
(see docs/migrating-from-deepspeed.md).

Prints one ``LOSS <step> <value>`` line per optimizer step (rank 0) and ``RESUMED <client_state>``
after a load, which the test reads.
"""
import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

D_IN, HIDDEN, CLASSES, SAMPLES = 16, 32, 4, 4096


def parse_args():
    parser = argparse.ArgumentParser(description="DeepSpeed-style training")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps to train to")
    parser.add_argument("--save_dir", default=None, help="checkpoint directory")
    parser.add_argument("--save_at", type=int, default=0, help="save a checkpoint after this many steps")
    parser.add_argument("--resume", action="store_true", help="load the latest checkpoint from --save_dir")
    parser.add_argument("--moe", action="store_true", help="add a Mixture-of-Experts layer")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, moe_experts=0, ep_size=1):
        super().__init__()
        self.embed = nn.Linear(D_IN, HIDDEN)
        self.blocks = nn.ModuleList([Block(HIDDEN) for _ in range(2)])
        self.moe = None
        if moe_experts:
            expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
            self.moe = deepspeed.moe.layer.MoE(hidden_size=HIDDEN, expert=expert, num_experts=moe_experts,
                                               ep_size=ep_size, k=1, capacity_factor=2.0, min_capacity=4)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = deepspeed.checkpointing.checkpoint(block, h)
        aux = h.new_zeros(())
        if self.moe is not None:
            out, aux, _ = self.moe(h)
            h = h + out
        return F.cross_entropy(self.head(h), y) + 0.01 * aux


class TeacherData(torch.utils.data.Dataset):
    """Labels from a fixed random linear teacher: learnable, so the loss falls."""

    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, D_IN, generator=g)
        self.y = (self.x @ torch.randn(D_IN, CLASSES, generator=g)).argmax(-1)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    with open(args.deepspeed_config) as f:
        stage = json.load(f).get("zero_optimization", {}).get("stage", 0)
    world = deepspeed.comm.get_world_size()

    torch.manual_seed(42)
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config, enabled=stage == 3):
        model = Net(moe_experts=2 * world if args.moe else 0, ep_size=world)
    # The usual way to set a (possibly partitioned) parameter before training: rank 0 edits, all receive.
    with deepspeed.zero.GatheredParameters(model.head.bias, modifier_rank=0):
        if deepspeed.comm.get_rank() == 0:
            model.head.bias.data.zero_()

    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=TeacherData())
    assert engine.zero_optimization_stage() == stage

    start = 0
    if args.resume:
        _, client_state = engine.load_checkpoint(args.save_dir)
        start = client_state["step"]
        print(f"RESUMED {json.dumps(client_state, sort_keys=True)}", flush=True)

    gas = engine.gradient_accumulation_steps()
    batches = iter(loader)
    for _ in range(start * gas):  # skip what the checkpointed run already consumed
        next(batches)
    for step in range(start, args.steps):
        total = torch.zeros(())
        for _ in range(gas):
            x, y = next(batches)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().cpu()
        assert engine.global_steps == step + 1 and engine.was_step_applied()
        total /= gas
        deepspeed.comm.all_reduce(total)
        total /= world
        if deepspeed.comm.get_rank() == 0:
            print(f"LOSS {step + 1} {total.item():.8f} lr {engine.get_lr()[0]:.6g} "
                  f"grad_norm {engine.get_global_grad_norm():.4f} samples {engine.global_samples}", flush=True)
        if args.save_dir and step + 1 == args.save_at:
            engine.save_checkpoint(args.save_dir, client_state={"step": step + 1, "note": "ds-style"})
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
