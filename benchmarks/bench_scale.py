"""What one training step costs in collectives as the world grows: counts where time cannot be shown here.

    python benchmarks/bench_scale.py [--worlds 2,4,8] [--depths 2,8] [--out benchmarks/results/scale.json]

For each world size (gloo ranks on this machine) and model depth (examples/gpt's GPT, width 64), one
steady-state optimizer step (after two that record stage 3's fetch order and warm up) is counted per ZeRO
stage, from zeroengine.comm's counters: calls and bytes of every collective, and *latency-bound host
round trips*: exchanges whose cost is a round trip over the world, not bandwidth (the small ``control``
exchanges, the gradient norm's all-reduce, and the gathers stage 3 waits for on demand). A ring's latency
grows with the world size, so these are what must stay constant per step; the data collectives' bytes
follow the ZeRO formulas. Stage 3 is also run with ``ZEROENGINE_STAGE3_ORDER_CHECK=event`` (every fetch
compared before it happens, the default before this benchmark existed) to show the per-module cost the
per-pass comparison removed. Nothing is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "gpt"))


def _count_step(rank, world, stage: int, depth: int, order_check: str):
    os.environ["ZEROENGINE_STAGE3_ORDER_CHECK"] = order_check
    import torch
    from model import GPT, GPTConfig

    import zeroengine
    from zeroengine import comm

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=depth, n_head=2, n_embd=64))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "steps_per_print": None, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000,
                                    "stage3_param_persistence_threshold": 1000}}
    engine, opt, _, _ = zeroengine.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        if step == 2:
            comm.counters.reset()
            if stage == 3:
                opt.reset_fetch_stats()
        x = torch.randint(256, (2, 32), generator=g)
        engine.backward(engine(x, x))
        engine.step()
    ops = comm.counters.snapshot()
    on_demand = opt.fetch_stats()["on_demand"] if stage == 3 else 0
    engine.destroy()
    return {"params": sum(p.numel() for p in model.parameters()), "ops": ops, "on_demand_gathers": on_demand}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--depths", default="2,8")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "scale.json"))
    args = parser.parse_args()
    from zeroengine.testing import run_distributed

    rows = []
    variants = [(int(s), "1") for s in args.stages.split(",")]
    if any(stage == 3 for stage, _ in variants):
        variants.append((3, "event"))
    print(f"{'world':>5} {'depth':>5} {'variant':>14} | {'collectives':>11} {'data MB':>8} | {'round trips':>11} "
          f"(control, norm, on-demand gathers)")
    for world in (int(w) for w in args.worlds.split(",")):
        for depth in (int(d) for d in args.depths.split(",")):
            for stage, check in variants:
                result = run_distributed(_count_step, world, stage, depth, check, timeout_s=300)[0]
                ops = result["ops"]
                control = int(ops.get("control", {}).get("calls", 0))
                norm = int(ops.get("all_reduce", {}).get("calls", 0)) if stage > 0 else 0
                calls = sum(int(o["calls"]) for o in ops.values())
                data_mb = sum(o["payload_bytes"] for k, o in ops.items() if k != "control") / 1e6
                trips = control + norm + result["on_demand_gathers"]
                variant = f"stage {stage}" + (" per-event" if check == "event" else "")
                rows.append({"world": world, "depth": depth, "stage": stage, "order_check": check,
                             "params": result["params"], "ops": ops, "collectives": calls,
                             "control_calls": control, "norm_all_reduces": norm,
                             "on_demand_gathers": result["on_demand_gathers"], "round_trips": trips})
                print(f"{world:>5} {depth:>5} {variant:>14} | {calls:>11} {data_mb:>8.2f} | {trips:>11} "
                      f"({control}, {norm}, {result['on_demand_gathers']})", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
