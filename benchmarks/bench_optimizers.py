"""Memory-efficient optimizers side by side: optimizer-state bytes per parameter and the held-out loss of the
main job's model, per optimizer and seed.

    python benchmarks/bench_optimizers.py [--steps 300] [--seeds 0,1,2] [--optimizers AdamW,Adafactor,SM3,Muon]
                                          [--out benchmarks/results/optimizers.json] [--plot ...png] [--quick]
    python benchmarks/bench_optimizers.py --optimizers AdamW-bf16,AdamW-bf16-masters,AdamW-bf16-states --seeds 0,1
    python benchmarks/bench_optimizers.py --optimizers SM3@0.1,SM3@0.2 --seeds 0 --out ... --plot ...
    python benchmarks/bench_optimizers.py --optimizers AdamW-bf16 --seeds 2 --append   # add runs to --out

``NAME@LR`` runs NAME at another peak rate (Muon: its matrices' ``muon_lr``): a learning-rate sweep.
``--append`` keeps the runs already in ``--out`` (those of another optimizer or seed) and summarises all of them.
``--replot A.json,B.json`` trains nothing: it draws the runs of earlier outputs in one plot (--plot), e.g. the
fp32 optimizers beside AdamW with bf16 states (docs/figures/optimizers.png).

examples/gpt's GPT (4 layers, width 128, bytes of the Python standard library's source, the main job's data)
at ZeRO stage 2 on 2 gloo ranks, every optimizer on the same batches per seed, with the same schedule shape: a
linear warm-up over 10 steps to the optimizer's own peak rate, then a linear decay to 0 (LambdaLR on each
group's rate, so Muon's two halves keep their ratio and Adafactor's rate stays a cap on its relative step).
Peak rates: AdamW 3e-3 (the main job's), Adafactor 1e-2 (torch's default), SM3 0.05 with momentum 0.9, Muon
0.02 for its matrices and 3e-3 for its Adam half (DeepSpeed's defaults for Muon's momentum, 0.95). Not tuned
beyond a check that each trains: the comparison is of what a user gets from each at sensible settings.

Reported per run: the held-out loss (64 windows after the training text) every ``--eval-every`` steps and at
the end, the training loss, the optimizer-state bytes per parameter that ``engine.memory_breakdown()`` counts on
the two ranks together, the resident-memory growth of the first optimizer step (where the state is created; both
ranks; blocks of 64 KiB or more are mapped and returned to the system one by one, glibc's mmap threshold set
by mallopt, so resident memory follows what is live) per parameter, and the mean step time. Writes JSON and a plot of held-out loss against steps (mean over seeds,
the band the seeds span).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "gpt"))

OPTIMIZERS = {
    "AdamW": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "Adafactor": {"type": "Adafactor", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "SM3": {"type": "SM3", "params": {"lr": 0.05, "momentum": 0.9}},
    "Muon": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01}},
}
# bf16 training with AdamW: fp32 masters and moments, bf16 masters (bf16.bf16_master_weights_and_grads), and
# bf16 masters and moments (+ bf16_optimizer_states): what the lean states cost. Not in the default set (bf16
# matmuls are slow on CPUs without bf16 units): --optimizers AdamW,AdamW-bf16,AdamW-bf16-masters,AdamW-bf16-states
BF16 = {"AdamW-bf16": {}, "AdamW-bf16-masters": {"bf16_master_weights_and_grads": True},
        "AdamW-bf16-states": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
for _name in BF16:
    OPTIMIZERS[_name] = OPTIMIZERS["AdamW"]
DEFAULT = "AdamW,Adafactor,SM3,Muon"
BLOCK, MICRO, HELD_OUT, WARMUP = 128, 8, 64, 10
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def optimizer_config(name: str) -> dict:
    """The ``optimizer`` section a run name stands for: ``NAME`` or ``NAME@LR`` (NAME at peak rate LR)."""
    base, _, lr = name.partition("@")
    if base not in OPTIMIZERS:
        raise SystemExit(f"unknown optimizer {base!r}: expected one of {', '.join(OPTIMIZERS)}")
    section = {"type": OPTIMIZERS[base]["type"], "params": dict(OPTIMIZERS[base]["params"])}
    if lr:
        section["params"]["muon_lr" if section["type"] == "Muon" else "lr"] = float(lr)
    return section


def merge_runs(earlier: list[dict], new: list[dict]) -> tuple[list[str], list[dict]]:
    """``--append``: the earlier runs (an earlier output's) with the new ones, a new run replacing an earlier one of
    the same optimizer and seed; (the optimizer names in order of first appearance, the runs by seed, then name)."""
    replaced = {(r["optimizer"], r["seed"]) for r in new}
    kept = [r for r in earlier if (r["optimizer"], r["seed"]) not in replaced]
    names = list(dict.fromkeys(r["optimizer"] for r in kept + new))
    return names, sorted(kept + new, key=lambda r: (r["seed"], names.index(r["optimizer"])))


def _train(rank, world, name: str, seed: int, steps: int, eval_every: int):
    import torch
    from model import GPT, GPTConfig
    from text_data import PythonSourceBytes

    import zeroengine

    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=256, block_size=BLOCK, n_layer=4, n_head=4, n_embd=128))
    params = model.num_params()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "steps_per_print": None, "optimizer": optimizer_config(name), "zero_optimization": {"stage": 2}}
    if name.partition("@")[0] in BF16:
        config["bf16"] = {"enabled": True, **BF16[name.partition("@")[0]]}
    engine, _, _, _ = zeroengine.initialize(model=model, config=config)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer.optimizer, lambda s: min((s + 1) / WARMUP, max(0.0, (steps - s) / (steps - WARMUP))))
    data = PythonSourceBytes(BLOCK)
    held_out = range(len(data) - HELD_OUT, len(data))
    order = torch.randperm(len(data) - HELD_OUT, generator=torch.Generator().manual_seed(1000 + seed))

    def evaluate() -> float:
        engine.eval()
        with torch.no_grad():
            x, y = data.batch(held_out)
            loss = float(engine(x, y))
        engine.train()
        return loss

    losses, times, evals, rss_growth = [], [], [], None
    for step in range(steps):
        picked = order[(step * world + rank) * MICRO:(step * world + rank + 1) * MICRO]
        x, y = data.batch(picked)
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        before = _rss_bytes()
        engine.step()
        schedule.step()
        times.append(time.perf_counter() - start)
        if step == 0:
            rss_growth = _rss_bytes() - before
        losses.append(zeroengine.comm.all_reduce_scalar(loss.item()) / world)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            evals.append((step + 1, evaluate()))
    state = zeroengine.comm.all_reduce_scalar(engine.memory_breakdown()["optimizer_states"])
    rss = zeroengine.comm.all_reduce_scalar(rss_growth)
    return {"losses": losses, "evals": evals, "params": params, "state_bytes_per_param": state / params,
            "first_step_rss_bytes_per_param": rss / params, "step_s": statistics.mean(times[min(10, steps - 1):])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--optimizers", default=DEFAULT, help=f"comma list of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="12 steps, one seed (a smoke test)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "optimizers.json"))
    parser.add_argument("--plot", default=os.path.join(HERE, "results", "optimizers.png"))
    parser.add_argument("--append", action="store_true", help="keep the other runs already in --out")
    parser.add_argument("--replot", default=None, help="comma list of earlier outputs to plot together (no runs)")
    args = parser.parse_args()
    if args.replot:
        runs = []
        for path in args.replot.split(","):
            with open(path) as f:
                runs += json.load(f)["runs"]
        names = [n for n in dict.fromkeys(r["optimizer"] for r in runs) if n in args.optimizers.split(",")]
        _plot(runs, names, args.plot)
        print(f"wrote {args.plot}")
        return 0
    if args.quick:
        args.steps, args.seeds, args.eval_every = 12, "0", 6
    from zeroengine.testing import run_distributed

    names = args.optimizers.split(",")
    for name in names:
        optimizer_config(name)  # an unknown name stops here, not after the first runs
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in names:  # interleaved: every optimizer of a seed before the next seed
            r = run_distributed(_train, 2, name, seed, args.steps, args.eval_every, timeout_s=3600)[0]
            runs.append({"optimizer": name, "seed": seed, **r})
            print(f"seed {seed} {name:10s} held-out {r['evals'][-1][1]:.4f} train {statistics.mean(r['losses'][-10:]):.4f} "
                  f"state {r['state_bytes_per_param']:.3f} B/param (first-step RSS {r['first_step_rss_bytes_per_param']:.2f}) "
                  f"step {r['step_s'] * 1e3:.1f} ms", flush=True)
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            names, runs = merge_runs(json.load(f)["runs"], runs)
    summary = {}
    for name in names:
        mine = [r for r in runs if r["optimizer"] == name]
        held = [r["evals"][-1][1] for r in mine]
        summary[name] = {"held_out_mean": statistics.mean(held), "held_out_min": min(held), "held_out_max": max(held),
                         "state_bytes_per_param": mine[0]["state_bytes_per_param"],
                         "first_step_rss_bytes_per_param": statistics.mean(r["first_step_rss_bytes_per_param"]
                                                                          for r in mine),
                         "step_ms": 1e3 * statistics.mean(r["step_s"] for r in mine)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "world": 2, "stage": 2,
                   "optimizers": {name: optimizer_config(name) for name in names}, "summary": summary,
                   "runs": runs}, f, indent=1)
    _plot(runs, names, args.plot)
    print(f"{'optimizer':10s} | held-out (mean, min-max) | state B/param | step ms")
    for name, s in summary.items():
        print(f"{name:10s} | {s['held_out_mean']:.4f} ({s['held_out_min']:.4f}-{s['held_out_max']:.4f}) | "
              f"{s['state_bytes_per_param']:.3f} | {s['step_ms']:.1f}")
    print(f"wrote {args.out} and {args.plot}")
    return 0


def _plot(runs, names, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        mine = [r for r in runs if r["optimizer"] == name]
        steps = [s for s, _ in mine[0]["evals"]]
        values = [[r["evals"][i][1] for r in mine] for i in range(len(steps))]
        ax.plot(steps, [statistics.mean(v) for v in values], label=f"{name} ({mine[0]['state_bytes_per_param']:.2f} B/param)")
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (bytes of Python source)")
    ax.set_title("examples/gpt, ZeRO 2 on 2 ranks: optimizers (mean of seeds, band: min-max)")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
