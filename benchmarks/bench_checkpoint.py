"""What a checkpoint costs the training loop, synchronous against ``async_save``; and what a restart costs.

    python benchmarks/bench_checkpoint.py [--params 100e6] [--saves 3] [--out benchmarks/results/checkpoint.json]
    python benchmarks/bench_checkpoint.py --quick     # a 2M-parameter smoke run

**Stall.** 2 gloo ranks train an MLP of ``--params`` parameters (fp32, AdamW, ZeRO stage 1: each rank writes
half the fp32 values and Adam moments, 6 bytes a parameter) and save every ``--every`` steps into a fresh folder.
Per mode, over ``--saves`` saves after one warm-up save (the first async save allocates its host buffers):

- ``call_s``: the time ``save_checkpoint`` blocks the loop (async: the tag agreement and the host snapshot);
- ``stall_s``: what the save adds to the wall time of the window from the save to the next one, against the
  median of as many windows with no save (async: the writer thread shares the cores and the disk with training,
  so this is the cost the loop sees, not only the call; ``baseline_spread_s``, the spread of the windows without
  a save, is the noise it is measured against);
- ``write_s`` (async): from the call to the commit (``latest`` names the tag).

The target: async ``stall_s`` at most 10% of the synchronous save's.

**Restart.** ``zeroengine --max_restarts 1`` runs a 2-rank job that saves after every step; rank 1 dies
(``os._exit``) after step 4's checkpoint. ``restart_s``: from the moment it dies to the end of the first step the
restarted job trains (the launcher's stop and restart, the interpreters' start and imports, initialize,
load_checkpoint, one step), against ``first_run_first_step_s``, the same span from the first launch's start (what
a restart costs beyond starting afresh is the load).

Writes ``benchmarks/results/checkpoint.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)


def _model(params: float, width: int):
    import torch

    depth = max(1, round(params / (width * width)))
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(depth)])


def _stall(rank, world, params: float, width: int, every: int, saves: int, folder: str):
    import torch

    import zeroengine

    torch.manual_seed(0)
    model = _model(params, width)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": None, "gradient_clipping": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1}}
    engine, _, _, _ = zeroengine.initialize(model=model, config=config)
    x = torch.randn(4, width)

    def step():
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    def window(save_mode: str | None, tag: str) -> dict:
        zeroengine.comm.barrier()
        start = time.perf_counter()
        called = 0.0
        if save_mode is not None:
            engine.save_checkpoint(os.path.join(folder, save_mode), tag=tag, async_save=save_mode == "async")
            called = time.perf_counter() - start
        for _ in range(every):
            step()
        zeroengine.comm.barrier()
        end = time.perf_counter()
        write = None
        if save_mode == "async":
            engine.wait_for_checkpoint()
            zeroengine.comm.barrier()
            write = time.perf_counter() - start
        return {"window_s": end - start, "call_s": called, "write_s": write}

    for _ in range(3):
        step()
    plain = [window(None, "")["window_s"] for _ in range(saves + 1)]
    baseline = statistics.median(plain)
    # the windows' own spread: a stall smaller than this is not told apart from noise
    out = {"baseline_window_s": baseline, "baseline_spread_s": max(plain) - min(plain), "step_s": baseline / every}
    for mode in ("sync", "async"):
        window(mode, "warmup")
        runs = [window(mode, f"save{i}") for i in range(saves)]
        out[mode] = {"call_s": statistics.median(r["call_s"] for r in runs),
                     "stall_s": statistics.median(r["window_s"] - baseline for r in runs),
                     "write_s": statistics.median(r["write_s"] for r in runs) if mode == "async" else None}
    out["checkpoint_bytes_per_rank"] = sum(os.path.getsize(os.path.join(root, f))
                                           for root, _, files in os.walk(os.path.join(folder, "sync", "save0"))
                                           for f in files if f.startswith(f"shard_{rank:05d}"))
    out["buffers_bytes"] = engine.memory_breakdown()["buffers"]  # the host snapshot, and gloo's scratch
    engine.destroy()
    return out


RESTART_SCRIPT = r'''
import json, os, sys, time
import torch
import zeroengine
out, crash_at, width, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
attempt = int(os.environ["ZEROENGINE_RESTART_COUNT"])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                              for _ in range(depth)])
config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": None, "gradient_clipping": 0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1}}
engine, _, _, _ = zeroengine.initialize(model=model, config=config)
engine.load_checkpoint(os.path.join(out, "ckpt"))
x = torch.randn(4, width)
first = True
while engine.global_steps < crash_at + 2:
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    if first and engine.global_rank == 0:
        with open(os.path.join(out, f"first_step_{attempt}"), "w") as f:
            f.write(repr(time.time()))
    first = False
    engine.save_checkpoint(os.path.join(out, "ckpt"))
    if attempt == 0 and engine.global_steps == crash_at and engine.global_rank == 1:
        with open(os.path.join(out, "died"), "w") as f:
            f.write(repr(time.time()))
        os._exit(1)
'''


def _restart(width: int, depth: int, port: int) -> dict:
    work = tempfile.mkdtemp(prefix="ze_restart_bench_")
    try:
        script = os.path.join(work, "train.py")
        with open(script, "w") as f:
            f.write(RESTART_SCRIPT)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env["OMP_NUM_THREADS"] = "1"
        launched = time.time()
        done = subprocess.run([sys.executable, "-m", "zeroengine.launcher.main", "--num_procs", "2",
                               "--master_port", str(port), "--max_restarts", "1", script, work, "4", str(width),
                               str(depth)], env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"the restart run failed:\n{done.stderr[-3000:]}")

        def read(name):
            with open(os.path.join(work, name)) as f:
                return float(f.read())

        return {"restart_s": read("first_step_1") - read("died"),
                "first_run_first_step_s": read("first_step_0") - launched}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--every", type=int, default=10, help="training steps between saves")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a 2M-parameter smoke run")
    parser.add_argument("--no-restart", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "checkpoint.json"))
    args = parser.parse_args()
    if args.quick:
        args.params, args.width, args.every, args.saves = 2e6, 512, 3, 1
    from zeroengine.testing import free_port, run_distributed

    folder = tempfile.mkdtemp(prefix="ze_ckpt_bench_", dir=os.environ.get("ZEROENGINE_BENCH_DIR"))
    try:
        stall = run_distributed(_stall, 2, args.params, args.width, args.every, args.saves, folder,
                                timeout_s=3600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {"params": args.params, "width": args.width, "every": args.every, "saves": args.saves,
              "ranks": [r for r in stall]}
    r0 = stall[0]
    sync_stall = max(r["sync"]["stall_s"] for r in stall)
    async_stall = max(r["async"]["stall_s"] for r in stall)
    result["async_stall_fraction_of_sync"] = async_stall / sync_stall if sync_stall > 0 else None
    result["async_call_fraction_of_sync"] = (max(r["async"]["call_s"] for r in stall)
                                             / max(r["sync"]["call_s"] for r in stall))
    print(f"model: {args.params / 1e6:.0f}M parameters; each rank writes {r0['checkpoint_bytes_per_rank'] / 2**20:.0f} "
          f"MiB a save; {args.every} steps between saves, step {r0['step_s'] * 1e3:.0f} ms")
    print(f"{'mode':<6} {'call (s)':>9} {'stall (s)':>10} {'commit after (s)':>17}")
    for mode in ("sync", "async"):
        m = r0[mode]
        write = f"{m['write_s']:.2f}" if m["write_s"] is not None else "-"
        print(f"{mode:<6} {m['call_s']:>9.3f} {m['stall_s']:>10.3f} {write:>17}")
    print(f"async / sync (slowest rank): call {result['async_call_fraction_of_sync']:.3f}, stall "
          f"{result['async_stall_fraction_of_sync']:.3f} (target <= 0.10; windows without a save spread over "
          f"{r0['baseline_spread_s']:.2f} s)")
    if not args.no_restart:
        depth = 2 if args.quick else 8
        result["restart"] = _restart(args.width, depth, free_port())
        print(f"restart: {result['restart']['restart_s']:.1f} s from the rank's death to the first resumed step "
              f"(a first launch: {result['restart']['first_run_first_step_s']:.1f} s to its first step)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
