"""What offload's delayed parameter update (DPU) does to convergence, and to the step time, side by side.

    python benchmarks/bench_delayed_update.py [--steps 300] [--seeds 0,1] [--out benchmarks/results/delayed_update.json]

examples/gpt's GPT learns the Python standard library's source, byte by byte (the main job's data), at
ZeRO stage 2 with ``offload_optimizer`` on 2 gloo ranks, with the example's schedule (linear warm-up to
3e-3, then decay). Five variants run on the same batches per seed: no delay, ``delayed_update`` with the
default 40 warm-up steps, and with none; and at a third of the peak rate (1e-3), no delay and the default
delay. A one-step-stale update is stable only for about half the step size of a fresh one (on a quadratic,
x' = x - lr*h*x_prev diverges past lr*h = 1 where x' = x - lr*h*x does past 2), so the delay's cost is
expected to depend on how close the rate is to the edge of stability. Reported per run: the training loss averaged over the last 10%
of the steps, the loss on held-out text (bytes after the training windows) at the end, and the mean
step time after the first 10 steps. The seed-to-seed spread of the undelayed runs is the yardstick: a
delayed run within it converges as the undelayed one does.

On this machine (2 cores, one per rank) the background Adam and the next step's compute share a core, so
the time column shows the mode's overhead here, not the overlap it buys on an accelerator.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "gpt"))

# name -> (delayed_update_warmup_steps or None for no delay, peak learning rate)
VARIANTS = {"undelayed": (None, 3e-3), "delayed (warm-up 40)": (40, 3e-3), "delayed (no warm-up)": (0, 3e-3),
            "undelayed, lr 1e-3": (None, 1e-3), "delayed (warm-up 40), lr 1e-3": (40, 1e-3)}
BLOCK, MICRO = 128, 8


def _train(rank, world, seed: int, warmup, lr: float, steps: int):
    import torch
    from model import GPT, GPTConfig
    from text_data import PythonSourceBytes

    import zeroengine

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=256, block_size=BLOCK, n_layer=4, n_head=4, n_embd=128))
    offload = {"device": "cpu"}
    if warmup is not None:
        offload.update(delayed_update=True, delayed_update_warmup_steps=warmup)
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": None,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": lr,
                                                          "warmup_num_steps": 10, "total_num_steps": steps,
                                                          "warmup_type": "linear"}},
        "zero_optimization": {"stage": 2, "offload_optimizer": offload},
    }
    engine, _, _, _ = zeroengine.initialize(model=model, config=config)
    data = PythonSourceBytes(BLOCK)
    held_out = range(len(data) - 64, len(data))  # never trained on: steps * MICRO * world windows come first
    order = torch.randperm(len(data) - 64, generator=torch.Generator().manual_seed(1000 + seed))
    losses, times = [], []
    for step in range(steps):
        picked = order[(step * world + rank) * MICRO:(step * world + rank + 1) * MICRO]
        x, y = data.batch(picked)
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(zeroengine.comm.all_reduce_scalar(loss.item()) / world)
    engine.optimizer.land_delayed_update()
    engine.eval()
    with torch.no_grad():
        x, y = data.batch(held_out)
        held = float(engine(x, y))
    return {"losses": losses, "held_out_loss": held, "step_s": statistics.mean(times[10:])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--variants", default=None,
                        help="semicolon-separated variant names (default: all); each needs its rate's undelayed run")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "delayed_update.json"))
    args = parser.parse_args()
    variants = VARIANTS if args.variants is None else {n: VARIANTS[n] for n in args.variants.split(";")}
    from zeroengine.testing import run_distributed

    tail = max(1, args.steps // 10)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name, (warmup, lr) in variants.items():  # interleaved: every variant of a seed before the next seed
            result = run_distributed(_train, 2, seed, warmup, lr, args.steps, timeout_s=3600)[0]
            runs.append({"variant": name, "seed": seed, "final_train_loss": statistics.mean(result["losses"][-tail:]),
                         "held_out_loss": result["held_out_loss"], "step_s": result["step_s"],
                         "losses": [round(v, 5) for v in result["losses"]]})
            print(f"seed {seed} {name:22s} train {runs[-1]['final_train_loss']:.4f} "
                  f"held-out {result['held_out_loss']:.4f} step {result['step_s'] * 1e3:.1f} ms", flush=True)
    summary = {}
    for name, (_, lr) in variants.items():
        mine = [r for r in runs if r["variant"] == name]
        base = [r for r in runs if VARIANTS[r["variant"]] == (None, lr)]  # the undelayed run at the same rate
        summary[name] = {
            "held_out_loss_mean": statistics.mean(r["held_out_loss"] for r in mine),
            "held_out_vs_undelayed": statistics.mean(r["held_out_loss"] / b["held_out_loss"]
                                                     for r, b in zip(mine, base)),
            "final_train_loss_mean": statistics.mean(r["final_train_loss"] for r in mine),
            "step_time_vs_undelayed": statistics.mean(r["step_s"] / b["step_s"] for r, b in zip(mine, base)),
        }
    for name, (warmup, _) in variants.items():
        undelayed = [r["held_out_loss"] for r in runs if r["variant"] == name]
        if warmup is None and len(undelayed) > 1:
            summary[f"{name}: seed spread (held-out, max - min)"] = max(undelayed) - min(undelayed)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "world": 2, "stage": 2, "summary": summary, "runs": runs}, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
