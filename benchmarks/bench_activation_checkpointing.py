"""Activation checkpointing side by side: peak activation memory and step time of the example GPT.

    python benchmarks/bench_activation_checkpointing.py [--quick] [--device cpu|cuda] [--out FILE.json]

Method
------
For each (depth L, sequence length T) the same GPT (examples/gpt/model.py,
dropout 0.1, fp32, torch AdamW) is trained in three variants, one model
instance switched between them:

* ``none``: plain autograd, every block's activations kept;
* ``checkpoint``: every Block checkpointed (``checkpoint_modules(model, Block)``);
* ``checkpoint+cpu``: the same with ``cpu_checkpointing`` (saved inputs in host memory).

Peak activation memory is the most bytes alive during forward + backward
above what was alive before the forward (parameters, gradients, which exist
from the warm-up, and optimizer state), so the optimizer's own temporaries
are not counted. On CUDA it is ``torch.cuda.max_memory_allocated`` (after
``reset_peak_memory_stats``); on CPU, which has no allocator statistics, it
is :class:`zeroengine.activation_checkpointing.memory_probe.LiveTensorBytes` (every
storage created, followed until freed) in one extra untimed step. Host bytes
of the GPU run come from the same probe. ``predicted`` is what the issue
promises: one block's activations plus L saved inputs, with one block's
activations taken from the plain runs (slope of peak over L at this T).

Step time: forward + backward + optimizer step, variants interleaved
(``--rounds`` rounds of ``--steps`` steps each, starting variant rotated) so
machine drift hits all alike; the ratio to ``none`` is per round, median over
rounds. Recompute should cost at most one extra forward: ratio <= ~1.33.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

from model import GPT, Block, GPTConfig  # noqa: E402

from zeroengine import checkpointing  # noqa: E402
from zeroengine.activation_checkpointing.memory_probe import LiveTensorBytes  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "activation_checkpointing.json"
VARIANTS = ("none", "checkpoint", "checkpoint+cpu")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 depths, 1 length (a smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--depths", default=None, help="comma-separated L (default 4,8,16; quick 2,4)")
    p.add_argument("--lengths", default=None, help="comma-separated T (default cpu 128,256 / cuda 512,1024)")
    p.add_argument("--embd", type=int, default=None, help="hidden size (default cpu 128 / cuda 1024)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default cpu 4 / cuda 8)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant per round (default 2)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    defaults = dict(depths="2,4" if args.quick else "4,8,16",
                    lengths="32" if args.quick else ("512,1024" if cuda else "128,256"),
                    embd=32 if args.quick else (1024 if cuda else 128),
                    heads=2 if args.quick else (16 if cuda else 4),
                    batch=2 if args.quick else (8 if cuda else 4),
                    rounds=1 if args.quick else 3, steps=2)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.depths = [int(x) for x in str(args.depths).split(",")]
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    return args


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _use(variant: str, model) -> None:
    checkpointing.uncheckpoint_modules(model)
    checkpointing.reset()
    if variant != "none":
        checkpointing.configure(checkpoint_in_cpu=variant == "checkpoint+cpu")
        checkpointing.checkpoint_modules(model, Block)


def _fwd_bwd(model, x, y):
    model(x, y).backward()


def _peak_activation_bytes(model, x, y, device) -> dict:
    """Peak bytes above the pre-step baseline during forward + backward, by device type."""
    out = {}
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _fwd_bwd(model, x, y)
        _sync(device)
        out["allocator_device_peak"] = torch.cuda.max_memory_allocated(device) - before
    with LiveTensorBytes() as probe:
        _fwd_bwd(model, x, y)
        _sync(device)
    out["probe_peak"] = dict(probe.peak)
    return out


def run_config(L, T, args, device) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=T, n_layer=L, n_head=args.heads, n_embd=args.embd, dropout=0.1)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(cfg.vocab_size, (args.batch, T), generator=g).to(device)
    y = torch.randint(cfg.vocab_size, (args.batch, T), generator=g).to(device)

    def step():
        _fwd_bwd(model, x, y)
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: they are model state, not activations

    rows = {v: {"variant": v} for v in VARIANTS}
    for v in VARIANTS:  # warm-up (allocates grads and optimizer state), then memory
        _use(v, model)
        step()
        step()
        mem = _peak_activation_bytes(model, x, y, device)
        rows[v]["peak_activation_bytes"] = mem.get("allocator_device_peak", mem["probe_peak"].get(device.type, 0))
        rows[v]["probe_peak_bytes"] = mem["probe_peak"]
        opt.zero_grad(set_to_none=False)
    times = {v: [] for v in VARIANTS}
    ratios = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        per_round = {}
        for v in order:
            _use(v, model)
            samples = []
            for _ in range(args.steps):
                _sync(device)
                t0 = time.perf_counter()
                step()
                _sync(device)
                samples.append(time.perf_counter() - t0)
            per_round[v] = statistics.median(samples)
            times[v] += samples
        for v in VARIANTS:
            ratios[v].append(per_round[v] / per_round["none"])
    _use("none", model)
    saved_input = args.batch * T * args.embd * 4
    for v in VARIANTS:
        rows[v]["median_step_s"] = statistics.median(times[v])
        rows[v]["step_time_ratio"] = statistics.median(ratios[v])
        rows[v]["memory_ratio"] = rows[v]["peak_activation_bytes"] / rows["none"]["peak_activation_bytes"]
    return {"L": L, "T": T, "num_params": sum(p.numel() for p in model.parameters()),
            "saved_input_bytes": saved_input, "variants": [rows[v] for v in VARIANTS]}


def add_predictions(results: list[dict]) -> None:
    """One block's activations (slope of the plain peak over L, per T) + L saved inputs + the non-block part."""
    by_t = {}
    for res in results:
        by_t.setdefault(res["T"], []).append(res)
    for group in by_t.values():
        if len(group) < 2:
            continue
        group.sort(key=lambda r: r["L"])
        a, b = group[0], group[-1]
        plain = {r["L"]: r["variants"][0]["peak_activation_bytes"] for r in group}
        per_block = (plain[b["L"]] - plain[a["L"]]) / (b["L"] - a["L"])
        outside = plain[a["L"]] - a["L"] * per_block
        for res in group:
            res["per_block_activation_bytes"] = per_block
            res["predicted_checkpoint_peak"] = outside + per_block + res["L"] * res["saved_input_bytes"]
            for row in res["variants"][1:]:
                row["over_prediction"] = row["peak_activation_bytes"] / res["predicted_checkpoint_peak"]


def print_table(results, device) -> None:
    print(f"{'L':>3} {'T':>5} {'variant':<15} {'peak act MiB':>12} {'x none':>7} {'pred MiB':>9} "
          f"{'host MiB':>9} {'step ms':>9} {'x none':>7}")
    for res in results:
        for row in res["variants"]:
            pred = res.get("predicted_checkpoint_peak") if row["variant"] != "none" else None
            host = row["probe_peak_bytes"].get("cpu", 0) if device.type == "cuda" else float("nan")
            print(f"{res['L']:>3} {res['T']:>5} {row['variant']:<15} {row['peak_activation_bytes'] / 2**20:>12.1f} "
                  f"{row['memory_ratio']:>7.3f} {(pred or float('nan')) / 2**20:>9.1f} {host / 2**20:>9.1f} "
                  f"{1e3 * row['median_step_s']:>9.1f} {row['step_time_ratio']:>7.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    results = [run_config(L, T, args, device) for T in args.lengths for L in args.depths]
    add_predictions(results)
    print_table(results, device)
    machine = {"device": device.type, "torch": torch.__version__, "python": platform.python_version(),
               "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
        machine["tf32"] = True
    settings = {k: getattr(args, k) for k in ("depths", "lengths", "embd", "heads", "batch", "rounds", "steps")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "settings": settings, "results": results}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
