"""Pipeline parallelism on CPU ranks: the bubble and activations of GPipe, 1F1B and interleaved 1F1B; DeepSpeed's 1F1B.

    python benchmarks/bench_pipeline.py [--stages 2,4] [--micro-batches 4,8] [--steps 5] [--no-deepspeed]
                                        [--quick] [--out benchmarks/results/pipeline.json]

Method
------
The model is ``--blocks`` pre-norm residual MLP blocks (hidden -> ffn -> hidden, GELU) trained on an MSE loss
against random targets, ``--tokens`` rows per micro-batch, fp32, one torch thread per rank, split into p
stages of equal blocks (``partition_method="type:Block"``): per-stage compute far exceeds the activation
transfers (a few hundred KiB per micro-batch), so what stages wait for is mostly each other.

* One gloo world per p (``zeroengine.testing.run_distributed``) holds every engine at that p: zeroengine
  GPipe, 1F1B and interleaved 1F1B (``virtual_stages`` v = 2: the blocks cut into 2p chunks, rank s holding
  chunks s and s + p) at each m (``gradient_accumulation_steps``, ZeRO stage 1, torch AdamW), and at p = 2
  DeepSpeed 0.19.8's ``PipelineEngine`` (its 1F1B ``TrainSchedule``, the same ZeRO stage and optimizer) at
  the largest m. Every engine starts from the same weights (the same seeded layer list) and sees the same
  micro-batches at each step.
* Interleaved rounds: one warm-up round, then ``--steps`` rounds in which each engine runs one
  ``train_batch`` in turn (the first engine rotating), a barrier before each; so machine drift hits all
  engines alike. Step time is the slower rank's wall time of ``train_batch`` (schedule plus optimizer
  step), the median over rounds; ``paired`` ratios are the median over rounds of the ratio within a round.
* Bubble: each stage's ``engine.pipe_stats``: ``recv_wait_s / schedule_s`` (time blocked receiving from a
  neighbour, bubble plus transfers, over the forward/backward schedule), the median over rounds per
  stage; ``measured`` is the mean over stages. A stage's window runs from its own start to its own last
  backward, so idle time after that (the last stage waiting for the first to drain) is outside it: at
  equal pass times the mean over stages is below the textbook value. ``makespan`` is the textbook's own
  definition, 1 - (mean busy time) / (longest window), per round (windows start together after the
  barrier), median over rounds. Beside them: ``zeroengine.pipe.schedule.simulate`` (forward 1, backward 2,
  free communication) and the textbook (p - 1) / (m + p - 1), for interleaving (p - 1) / (v·m + p - 1).
  Interleaving sends v times the messages, so its measured bubble also holds v times the transfers.
* Activations: one more round with ``engine.measure_activations = True`` (its hooks cost time, so it is
  not timed): ``peak_saved_bytes`` (activation bytes autograd held saved for backward at once) and
  ``max_in_flight`` per stage; 1F1B holds min(p - s, m) micro-batches on stage s, GPipe m, interleaved
  min(2(p - s - 1) + (v - 1)p + 1, v·m) chunk-passes (each 1/v of the stage's layers).

p = 4 on a 2-core machine is oversubscribed (4 single-threaded ranks on 2 cores): a stage can wait on a
neighbour that is runnable but descheduled, so its bubble there is an upper bound; the table says so.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SCHEDULES = ("gpipe", "1f1b", "interleaved")
CHUNKS = {"interleaved": 2}  # virtual_stages per schedule (1 where not listed)
OPTIMIZER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def mse(outputs, labels):
    return F.mse_loss(outputs, labels)


def make_layers(spec: dict) -> list[nn.Module]:
    """The whole model, the same on every rank and for every engine (each PipelineModule keeps its stage's)."""
    torch.manual_seed(1234)
    return [Block(spec["hidden"], spec["ffn"]) for _ in range(spec["blocks"])]


def micro_batches(spec: dict, step: int, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    shape = (spec["tokens"], spec["hidden"])
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(m)]


def ze_engine(spec: dict, stages: int, m: int, schedule: str):
    import zeroengine
    from zeroengine.pipe import PipelineModule

    module = PipelineModule(make_layers(spec), num_stages=stages, loss_fn=mse, partition_method="type:Block",
                            virtual_stages=CHUNKS.get(schedule, 1))
    cfg = {"train_micro_batch_size_per_gpu": spec["tokens"], "gradient_accumulation_steps": m,
           "train_batch_size": spec["tokens"] * m, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {**OPTIMIZER, "torch_adam": True}},
           "zero_optimization": {"stage": 1}, "pipeline": {"schedule": schedule}}
    engine, *_ = zeroengine.initialize(model=module, config=cfg)
    return engine


def ds_engine(spec: dict, stages: int, m: int):
    """DeepSpeed's PipelineEngine on the CPU accelerator, its chatter (layer listing, op builds) swallowed."""
    import logging

    os.environ["DS_ACCELERATOR"] = "cpu"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import deepspeed
        from deepspeed.pipe import PipelineModule

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")  # wraps the world run_distributed made
        module = PipelineModule(make_layers(spec), num_stages=stages, loss_fn=mse, partition_method="type:Block")
        optimizer = torch.optim.AdamW(module.parameters(), **OPTIMIZER)
        cfg = {"train_micro_batch_size_per_gpu": spec["tokens"], "gradient_accumulation_steps": m,
               "train_batch_size": spec["tokens"] * m, "steps_per_print": 10 ** 9,
               "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg, dist_init_required=False)
    return engine, deepspeed.__version__


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc) or '-').splitlines()[0][:300]}"


def pipeline_worker(rank: int, world: int, spec: dict) -> dict:
    """Every engine at p = world, stepped in interleaved rounds; this rank's timings and stats per engine."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    engines = {f"{s}/m{m}": (ze_engine(spec, world, m, s), m) for m in spec["micro_batches"] for s in SCHEDULES}
    result = {"stage": None, "runs": {}, "deepspeed": None}
    if spec["deepspeed_m"]:
        try:
            ds, version = ds_engine(spec, world, spec["deepspeed_m"])
            ours = engines[f"1f1b/m{spec['deepspeed_m']}"][0].module.state_dict()
            theirs = ds.module.state_dict()
            result["deepspeed"] = {"version": version, "same_initial_weights": set(ours) == set(theirs) and all(
                torch.equal(ours[k], theirs[k]) for k in ours)}
            engines["deepspeed"] = (ds, spec["deepspeed_m"])
        except Exception as exc:  # not installed, or its pipeline cannot run here
            result["deepspeed"] = {"error": _error(exc)}
    names = list(engines)
    runs = {n: {"step_s": [], "schedule_s": [], "recv_wait_s": [], "losses": []} for n in names}
    for round_ in range(spec["steps"] + 1):  # round 0 warms up
        for n in names[round_ % len(names):] + names[:round_ % len(names)]:
            engine, m = engines[n]
            data = micro_batches(spec, round_, m)
            dist.barrier()
            start = time.perf_counter()
            try:
                loss = engine.train_batch(iter(data))
            except Exception as exc:
                if n != "deepspeed":
                    raise
                result["deepspeed"] = {"error": _error(exc)}
                names.remove(n)  # a failing rank may leave its peer blocked: the world's timeout then reports it
                continue
            elapsed = time.perf_counter() - start
            if round_:
                runs[n]["step_s"].append(elapsed)
                runs[n]["losses"].append(float(loss))
                if n != "deepspeed":
                    runs[n]["schedule_s"].append(engine.pipe_stats["schedule_s"])
                    runs[n]["recv_wait_s"].append(engine.pipe_stats["recv_wait_s"])
    for n in names:  # the untimed round with saved-activation accounting
        if n == "deepspeed":
            continue
        engine, m = engines[n]
        engine.measure_activations = True
        engine.train_batch(iter(micro_batches(spec, spec["steps"] + 1, m)))
        runs[n]["max_in_flight"] = engine.pipe_stats["max_in_flight"]
        runs[n]["peak_saved_bytes"] = engine.pipe_stats["peak_saved_bytes"]
        result["stage"] = engine.stage_id
    result["runs"] = {n: runs[n] for n in names}
    return result


# -- aggregation ------------------------------------------------------------------------------------------
def slowest_rank(per_rank: list[dict], name: str) -> list[float]:
    return [max(steps) for steps in zip(*(r["runs"][name]["step_s"] for r in per_rank))]


def summarise_world(per_rank: list[dict], spec: dict, stages: int) -> dict:
    from zeroengine.pipe.schedule import simulate

    per_rank = sorted(per_rank, key=lambda r: r["stage"])
    rows = []
    for m in spec["micro_batches"]:
        for s in SCHEDULES:
            runs = [r["runs"][f"{s}/m{m}"] for r in per_rank]
            bubble = [statistics.median(w / t for w, t in zip(r["recv_wait_s"], r["schedule_s"])) for r in runs]
            makespan = statistics.median(  # per round: 1 - mean busy time / the longest schedule window
                1 - statistics.mean(t - w for t, w in zip(sched, waits)) / max(sched)
                for sched, waits in zip(zip(*(r["schedule_s"] for r in runs)), zip(*(r["recv_wait_s"] for r in runs))))
            v = CHUNKS.get(s, 1)
            sim = simulate(s, stages, m, chunks=v)
            steps = slowest_rank(per_rank, f"{s}/m{m}")
            rows.append({"stages": stages, "micro_batches": m, "schedule": s, "virtual_stages": v,
                         "oversubscribed": stages > (os.cpu_count() or 1),
                         "bubble": {"measured": statistics.mean(bubble), "per_stage": bubble, "makespan": makespan,
                                    "simulated": sim["bubble"], "formula": (stages - 1) / (v * m + stages - 1)},
                         "step_s": statistics.median(steps), "step_s_runs": steps,
                         "schedule_s_per_stage": [statistics.median(r["schedule_s"]) for r in runs],
                         "recv_wait_s_per_stage": [statistics.median(r["recv_wait_s"]) for r in runs],
                         "max_in_flight": [r["max_in_flight"] for r in runs],
                         "expected_max_in_flight": sim["max_in_flight"],
                         "peak_saved_bytes": [r["peak_saved_bytes"] for r in runs],
                         "losses": runs[-1]["losses"]})
    memory = []
    for m in spec["micro_batches"]:
        g, o, v = (next(r for r in rows if r["micro_batches"] == m and r["schedule"] == s) for s in SCHEDULES)
        memory.append({"stages": stages, "micro_batches": m, "per_stage": [
            {"stage": i, "gpipe_bytes": g["peak_saved_bytes"][i], "1f1b_bytes": o["peak_saved_bytes"][i],
             "interleaved_bytes": v["peak_saved_bytes"][i],
             "ratio": g["peak_saved_bytes"][i] / max(o["peak_saved_bytes"][i], 1),
             "interleaved_over_1f1b": v["peak_saved_bytes"][i] / max(o["peak_saved_bytes"][i], 1),
             "gpipe_in_flight": g["max_in_flight"][i], "1f1b_in_flight": o["max_in_flight"][i],
             "interleaved_in_flight": v["max_in_flight"][i]}
            for i in range(stages)]})
    return {"rows": rows, "memory": memory}


def summarise_deepspeed(per_rank: list[dict], m: int) -> dict:
    first = per_rank[0]["deepspeed"]
    errors = [r["deepspeed"]["error"] for r in per_rank if "error" in (r["deepspeed"] or {})]
    if errors:
        return {"error": errors[0], "stages": 2, "micro_batches": m}
    ours, theirs = slowest_rank(per_rank, f"1f1b/m{m}"), slowest_rank(per_rank, "deepspeed")
    ze_losses, ds_losses = per_rank[-1]["runs"][f"1f1b/m{m}"]["losses"], per_rank[-1]["runs"]["deepspeed"]["losses"]
    return {"version": first["version"], "stages": 2, "micro_batches": m, "schedule": "1f1b (TrainSchedule)",
            "same_initial_weights": all(r["deepspeed"]["same_initial_weights"] for r in per_rank),
            "step_s": statistics.median(theirs), "step_s_runs": theirs,
            "zeroengine_1f1b_step_s": statistics.median(ours),
            "ze_over_ds": statistics.median(ours) / statistics.median(theirs),
            "ze_over_ds_paired": statistics.median(a / b for a, b in zip(ours, theirs)),
            "losses": ds_losses, "zeroengine_losses": ze_losses,
            "max_abs_loss_diff": max(abs(a - b) for a, b in zip(ze_losses, ds_losses))}


# -- report ------------------------------------------------------------------------------------------------
def print_tables(result: dict) -> None:
    steps = result["steps"]
    print(f"\nbubble: measured = recv_wait_s / schedule_s, median of {steps} steps per stage, mean over stages; "
          "step = slower rank's train_batch, median")
    print(f"{'p':>2} {'m':>2} {'schedule':>11} {'step ms':>8} {'measured':>8} {'per stage':>24} {'makespan':>8} "
          f"{'simulate':>8} {'formula':>7}  {'in flight (per stage)':>21} {'expected':>9}")
    for r in result["runs"]:
        b = r["bubble"]
        flag = " *" if r["oversubscribed"] else ""
        print(f"{r['stages']:>2} {r['micro_batches']:>2} {r['schedule']:>11} {r['step_s'] * 1e3:8.0f} "
              f"{b['measured']:8.3f} {'/'.join(f'{x:.2f}' for x in b['per_stage']):>24} {b['makespan']:8.3f} "
              f"{b['simulated']:8.3f} "
              f"{b['formula']:7.3f}  {'/'.join(map(str, r['max_in_flight'])):>21} "
              f"{'/'.join(map(str, r['expected_max_in_flight'])):>9}{flag}")
    if any(r["oversubscribed"] for r in result["runs"]):
        print(f"* oversubscribed: {max(r['stages'] for r in result['runs'])} single-threaded ranks on "
              f"{result['cpus']} cores; a stage also waits on runnable but descheduled neighbours")
    print("\npeak activation bytes saved for backward, per stage (measure_activations)")
    print(f"{'p':>2} {'m':>2} {'stage':>5} {'gpipe MiB':>10} {'1f1b MiB':>9} {'interl. MiB':>11} {'gpipe/1f1b':>10} "
          f"{'interl./1f1b':>12} {'in flight g/1/i':>15}")
    for mem in result["memory"]:
        for s in mem["per_stage"]:
            flight = f"{s['gpipe_in_flight']}/{s['1f1b_in_flight']}/{s['interleaved_in_flight']}"
            print(f"{mem['stages']:>2} {mem['micro_batches']:>2} {s['stage']:>5} {s['gpipe_bytes'] / 2**20:10.2f} "
                  f"{s['1f1b_bytes'] / 2**20:9.2f} {s['interleaved_bytes'] / 2**20:11.2f} {s['ratio']:10.2f} "
                  f"{s['interleaved_over_1f1b']:12.2f} {flight:>15}")
    ds = result["deepspeed"]
    print()
    if "error" in ds or "skipped" in ds:
        print(f"DeepSpeed: not run ({ds.get('error') or ds.get('skipped')})")
        return
    print(f"DeepSpeed {ds['version']} 1F1B vs zeroengine 1F1B, p = {ds['stages']}, m = {ds['micro_batches']}: "
          f"{ds['step_s'] * 1e3:.0f} ms vs {ds['zeroengine_1f1b_step_s'] * 1e3:.0f} ms per step, "
          f"zeroengine/DeepSpeed {ds['ze_over_ds']:.3f} (paired {ds['ze_over_ds_paired']:.3f}; < 1: zeroengine "
          f"faster)")
    print(f"  same initial weights: {ds['same_initial_weights']}; losses per step, zeroengine "
          f"{[round(x, 6) for x in ds['zeroengine_losses']]}, DeepSpeed {[round(x, 6) for x in ds['losses']]} "
          f"(max |diff| {ds['max_abs_loss_diff']:.2e})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--micro-batches", default="4,8")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="rows per micro-batch")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--quick", action="store_true", help="p = 2 only, a tiny model, 2 steps (smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.stages, args.steps, args.hidden, args.ffn, args.blocks, args.tokens = "2", 2, 32, 64, 4, 16
    stages = [int(p) for p in args.stages.split(",")]
    ms = [int(m) for m in args.micro_batches.split(",")]
    spec = {"hidden": args.hidden, "ffn": args.ffn, "blocks": args.blocks, "tokens": args.tokens,
            "micro_batches": ms, "steps": args.steps, "deepspeed_m": 0}
    params = args.blocks * (2 * args.hidden + 2 * args.hidden * args.ffn + args.ffn + args.hidden)
    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "cpus": os.cpu_count(), "threads_per_rank": 1, "steps": args.steps,
              "model": {k: spec[k] for k in ("hidden", "ffn", "blocks", "tokens")} | {"params": params},
              "load_average_start": os.getloadavg(), "runs": [], "memory": [],
              "deepspeed": {"skipped": "--no-deepspeed"} if args.no_deepspeed else
              {"skipped": "p = 2 not among --stages"}}
    from bench_pipeline import pipeline_worker as worker  # importable by name, as run_distributed needs

    from zeroengine.testing import run_distributed

    for p in stages:
        world_spec = spec | {"deepspeed_m": max(ms) if p == 2 and not args.no_deepspeed else 0}
        start = time.perf_counter()
        per_rank = run_distributed(worker, p, world_spec, timeout_s=1800)
        summary = summarise_world(per_rank, spec, p)
        result["runs"] += summary["rows"]
        result["memory"] += summary["memory"]
        if world_spec["deepspeed_m"]:
            result["deepspeed"] = summarise_deepspeed(per_rank, world_spec["deepspeed_m"])
        print(f"p = {p}: one world, {time.perf_counter() - start:.0f} s", flush=True)
    result["load_average_end"] = os.getloadavg()
    print_tables(result)
    print(f"\nload average (1, 5, 15 min) at start {result['load_average_start']}, at end {result['load_average_end']}")
    out = Path(args.out) if args.out else HERE / "results" / "pipeline.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
