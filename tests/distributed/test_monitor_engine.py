"""The monitors through the engine on 2 ranks: rank 0 alone writes one row / event per optimizer step.

The CSV's loss must be the global-batch loss of a plain single-process torch run
(same model, data, AdamW and LambdaLR schedule), its lr the rate each step
applied, its comm bytes what the counters saw (less the monitor's own scalar
all-reduce), and its memory what memory_breakdown() reports.
"""
import csv
import glob
import math
import os

import torch
from parity import ADAM_EPS, base_config, global_batches, make_model

import zeroengine
from zeroengine.comm import counters, ring_wire_bytes
from zeroengine.monitor import read_scalars
from zeroengine.testing import run_distributed

STEPS, GAS, MICRO, WORLD, LR = 4, 2, 2, 2, 1e-2


def _lr_factor(step):
    return 1.0 / (step + 1)


def _reference_losses():
    """(global-batch losses, lr applied) per step of plain torch on the same batches."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=ADAM_EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)
    losses, lrs = [], []
    for step in global_batches(STEPS, GAS, WORLD, MICRO):
        x = torch.cat([xr for micro_step in step for xr, _ in micro_step])
        y = torch.cat([yr for micro_step in step for _, yr in micro_step])
        lrs.append(opt.param_groups[0]["lr"])
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, lrs


def train(rank, world, out_dir, off_dir):
    cfg = base_config(MICRO, GAS, world, clip=0.0, lr=LR, stage=2)
    # DeepSpeed's top-level spellings; the nested monitor {csv, tensorboard} shape is covered by unit tests.
    cfg["csv_monitor"] = {"enabled": True, "output_path": out_dir, "job_name": "job"}
    cfg["tensorboard"] = {"enabled": True, "output_path": out_dir, "job_name": "job"}
    engine, _, _, _ = zeroengine.initialize(
        model=make_model(), config=cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor))
    wire_before = counters.total_wire_bytes()
    for step in global_batches(STEPS, GAS, world, MICRO):
        for micro_step in step:
            x, y = micro_step[rank]
            engine.backward(engine(x, y))
            engine.step()
    wire_used = counters.total_wire_bytes() - wire_before
    memory = engine.memory_breakdown()
    engine.monitor.close()

    # Disabled (explicitly, with a path given): no recorder, no files, no extra collective.
    cfg_off = base_config(MICRO, 1, world, clip=0.0, stage=2)
    cfg_off["monitor"] = {"csv": {"enabled": False, "output_path": off_dir}}
    engine_off, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg_off)
    x, y = global_batches(1, 1, world, MICRO)[0][0][rank]
    engine_off.backward(engine_off(x, y))
    engine_off.step()
    return {"pid": os.getpid(), "wire_used": wire_used, "memory": memory, "monitor_off": engine_off.monitor}


def test_rank0_writes_one_row_and_event_per_step(tmp_path):
    out_dir, off_dir = tmp_path / "runs", tmp_path / "off"
    ref_losses, ref_lrs = _reference_losses()
    results = run_distributed(train, WORLD, str(out_dir), str(off_dir))
    assert all(r["monitor_off"] is None for r in results) and not off_dir.exists()

    job = out_dir / "job"
    events = glob.glob(str(job / "events.out.tfevents.*"))
    assert sorted(os.listdir(job)) == sorted(["metrics.csv", os.path.basename(events[0])])  # rank 1 wrote nothing
    assert events[0].endswith(f".{results[0]['pid']}.0")  # rank 0's file

    with open(job / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert [int(r["samples"]) for r in rows] == [MICRO * GAS * WORLD * s for s in range(1, STEPS + 1)]
    losses = [float(r["train/loss"]) for r in rows]
    assert all(math.isfinite(v) for v in losses)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0)
    assert [float(r["train/lr"]) for r in rows] == ref_lrs
    assert {float(r["train/loss_scale"]) for r in rows} == {1.0}
    assert all(float(r["train/samples_per_sec"]) > 0 and float(r["train/grad_norm"]) > 0 for r in rows)

    # Every step of stage 2 moves the same bytes; together they are all the traffic but the monitor's own
    # per-step scalar all-reduce (8 bytes of float64).
    wire = [int(r["comm/wire_bytes"]) for r in rows]
    assert len(set(wire)) == 1 and wire[0] > 0
    assert sum(wire) == results[0]["wire_used"] - STEPS * ring_wire_bytes("all_reduce", 8, WORLD)
    assert {k: int(rows[-1][f"memory/{k}"]) for k in results[0]["memory"]} == results[0]["memory"]

    scalars = read_scalars(events[0])
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, STEPS + 1))
    f32 = torch.tensor(losses, dtype=torch.float32).tolist()
    assert [v for _, v in scalars["train/loss"]] == f32
    assert set(scalars) == set(rows[0]) - {"step", "samples", "wall_time"}


def _train_around_a_checkpoint(rank, world, out_dir, ckpt_dir):
    cfg = base_config(MICRO, 1, world, clip=0.0, lr=LR, stage=2)
    cfg["monitor"] = {"csv": {"enabled": True, "output_path": out_dir, "job_name": "job"}}
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    for i, step in enumerate(global_batches(3, 1, world, MICRO)):
        x, y = step[0][rank]
        engine.backward(engine(x, y))
        engine.step()
        if i == 0:
            engine.save_checkpoint(ckpt_dir, tag="t")
            engine.load_checkpoint(ckpt_dir, tag="t")  # all-gathers the loaded parameters
    engine.monitor.close()


def test_a_checkpoint_between_steps_is_not_counted_in_the_next_steps_traffic(tmp_path):
    # Before, the load's all-gathers were added to the next step's comm bytes.
    run_distributed(_train_around_a_checkpoint, WORLD, str(tmp_path / "runs"), str(tmp_path / "ckpt"))
    with open(tmp_path / "runs" / "job" / "metrics.csv", newline="") as f:
        wire = [int(r["comm/wire_bytes"]) for r in csv.DictReader(f)]
    assert len(wire) == 3 and len(set(wire)) == 1, wire  # every stage-2 step moves the same bytes
