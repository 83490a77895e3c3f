"""accelerate's own training loop with its DeepSpeed plugin, unchanged from what a DeepSpeed user writes:
``DeepSpeedPlugin(zero_stage=2)``, the optimizer and scheduler either the script's own torch objects or
accelerate's ``DummyOptim`` / ``DummyScheduler`` (the config builds them). Trains four micro-batches, saves
with ``save_state``, trains four more and takes ``get_state_dict``; with ``--resume`` a fresh process loads
the state with ``load_state`` and trains the same four. Rank 0 writes a JSON report."""
import argparse
import json
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import DummyOptim, DummyScheduler


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return model, torch.utils.data.DataLoader(data, batch_size=4)


def build(dummy: bool, stage: int):
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=2, gradient_clipping=1.0)
    if dummy:
        plugin.deepspeed_config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
        plugin.deepspeed_config["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model, loader = model_and_data()
    if dummy:
        optimizer = DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.0)
        scheduler = DummyScheduler(optimizer, warmup_num_steps=2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def train(accelerator, model, optimizer, loader, scheduler, batches):
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == batches:
            break
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dummy", action="store_true", help="optimizer and scheduler from the config")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--state_dir", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    accelerator, model, optimizer, loader, scheduler = build(args.dummy, args.stage)
    report = {"engine": type(model).__module__ + "." + type(model).__name__,
              "optimizer": type(optimizer.optimizer).__name__, "world": accelerator.num_processes}
    if args.resume:
        accelerator.load_state(args.state_dir)
        report["resumed"] = train(accelerator, model, optimizer, loader, scheduler, batches=4)
    else:
        report["first"] = train(accelerator, model, optimizer, loader, scheduler, batches=4)
        accelerator.save_state(args.state_dir)
        report["after_save"] = train(accelerator, model, optimizer, loader, scheduler, batches=4)
        full = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            report["state_dict"] = {k: v.flatten()[:3].tolist() for k, v in full.items()}
            report["state_dir"] = sorted(os.listdir(args.state_dir))
    accelerator.free_memory()  # (calls the engine's destroy())
    if accelerator.is_main_process:
        with open(args.report, "w") as f:
            json.dump(report, f)
    # End as a script should: a process group left for interpreter shutdown to tear down once aborted a rank
    # ("terminate called without an active exception") after a resumed run, under load.
    accelerator.end_training()


if __name__ == "__main__":
    main()
