"""3D parallelism: data × tensor × pipeline on 8 gloo ranks, and checkpoints that move between layouts.

The model is a PipelineModule of tensor-parallel blocks (column-parallel up, row-parallel down), a
vocabulary-parallel embedding tied to the LM head across the first and last stage, and the vocabulary-parallel
cross-entropy. At dp=2 × tp=2 × pp=2 (ZeRO 1, 1F1B, 4 micro-batches) it must follow one process training the
same layers whole on every replica's micro-batches (fp32 within 1e-5). Its checkpoint must load exactly at one
rank and at dp=2 under ZeRO stage 3, and consolidate with ze_to_fp32 into the one-rank model's state_dict.
GPT-2 under AutoTP likewise saves at dp=2 × tp=2 and loads at tp=1 and into the plain model.
"""
import os

import pytest
import torch
from pipe_models import batches, config, tp_pipe_model, tp_reference
from test_tensor_parallel import assert_matches, full_state, local_state

import zeroengine
from zeroengine.testing import run_distributed

STEPS = 3


def train_3d(rank, world, stages, tp, micro_batches, stage=1, steps=STEPS, save=None, load=None):
    dp = world // (stages * tp)
    cfg = config(dp, micro_batches, stage=stage)
    cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = zeroengine.initialize(model=tp_pipe_model(stages, tp), config=cfg)
    if load:
        engine.load_checkpoint(load)
    losses = [float(engine.train_batch(iter(per_rank[engine.mesh.dp_rank])))
              for per_rank in batches(steps, micro_batches, dp)]
    if save:
        engine.save_checkpoint(save, tag="3d")
    if stage == 3:
        with zeroengine.zero.GatheredParameters(list(engine.module.parameters())):
            state = local_state(engine.module)
    else:
        state = local_state(engine.module)
    return {"losses": losses, "state": state, "mesh": engine.mesh.describe(), "norm": engine.get_global_grad_norm()}


@pytest.mark.timeout(720)  # above its run_distributed bounds in sequence (400 + 2 x 120 s), so a hang names the rank
def test_dp2_tp2_pp2_matches_one_process(tmp_path):
    results = run_distributed(train_3d, 8, 2, 2, 4, save=str(tmp_path), timeout_s=400)
    ref_losses, ref_state = tp_reference(STEPS, 4, 2)
    assert_matches(results, ref_losses, ref_state)
    state = full_state([r["state"] for r in results])
    assert len({r["norm"] for r in results}) == 1
    assert results[7]["mesh"].startswith("pp=2 × dp=2 × tp=2 (rank 7: pipe 1, data 1, tensor 1)")

    # the checkpoint, at one rank and at dp=2 under ZeRO 3: exact
    for world, stage in [(1, 1), (2, 3)]:
        loaded = run_distributed(train_3d, world, 1, 1, 4, stage=stage, steps=0, load=str(tmp_path), timeout_s=120)
        got = full_state([r["state"] for r in loaded])
        assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state), world

    out = str(tmp_path / "model.pt")
    assert os.system(f"ze_to_fp32 {tmp_path} {out} --tag 3d > /dev/null 2>&1") == 0
    consolidated = torch.load(out)
    tp_pipe_model(1, 1).load_state_dict(consolidated)
    assert all(torch.equal(consolidated[k], state[k]) for k in state)


def _hf(rank, world, name, tp, steps, save=None, load=None, stage=1):
    from parity import base_config
    from test_real_models import build, loss_of
    from test_tensor_parallel import MICRO, global_batches

    dp = world // tp
    model = build(name)
    cfg = base_config(MICRO, 1, dp, 1.0, lr=1e-3, stage=stage)
    cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = zeroengine.initialize(model=model, config=cfg)
    loaded = None
    if load:
        engine.load_checkpoint(load)
        with zeroengine.zero.GatheredParameters(list(model.parameters())):
            loaded = local_state(model)  # as loaded, before any step
    losses = []
    for ids in global_batches(dp)[:steps]:
        d = engine.mesh.dp_rank
        loss = loss_of(engine, (ids[d * MICRO:(d + 1) * MICRO],))
        engine.backward(loss)
        engine.step()
        losses.append(zeroengine.comm.all_reduce_scalar(loss.item()) / world)
    if save:
        engine.save_checkpoint(save, tag="tp")
    with zeroengine.zero.GatheredParameters(list(model.parameters())):  # (stage 3: this rank's tensor slices)
        return {"losses": losses, "state": local_state(model), "loaded": loaded}


@pytest.mark.parametrize("name", ["gpt2", "mixtral"])
def test_autotp_checkpoint_loads_at_other_tensor_sizes(tmp_path, name):
    """GPT-2 and Mixtral saved at dp=2 × tp=2 (ZeRO 1) resume at tp=1 on 2 ranks exactly as at their own
    layout: GPT-2's fused query-key-value matrix (three blocks) and Mixtral's stacked experts' [gate; up]
    matrices (two blocks) are merged and re-cut, values and Adam moments."""
    saved = full_state([r["state"] for r in run_distributed(_hf, 4, name, 2, 2, save=str(tmp_path))])
    losses = {}
    for world, tp, steps in [(2, 1, 1), (4, 2, 1)]:  # each loads, then trains one more step
        loaded = run_distributed(_hf, world, name, tp, steps, load=str(tmp_path))
        got = full_state([r["loaded"] for r in loaded])
        assert all(torch.equal(got[k], saved[k]) for k in saved), (world, tp)
        losses[world, tp] = loaded[0]["losses"]
    assert losses[2, 1] == pytest.approx(losses[4, 2], abs=1e-5) and len(losses[2, 1]) == 1
    out = str(tmp_path / f"{name}.pt")
    assert os.system(f"ze_to_fp32 {tmp_path} {out} --tag tp > /dev/null 2>&1") == 0
    from test_real_models import build

    plain = build(name)
    plain.load_state_dict(torch.load(out), strict=False)  # (GPT-2's causal-mask buffers are not saved)
    assert all(torch.equal(plain.state_dict()[k].float(), saved[k]) for k in saved)


def test_autotp_at_stage3_checkpoint_loads_at_stage1_and_one_rank(tmp_path):
    """Llama-style at dp=2 × tp=2 under ZeRO 3 (each tensor slice partitioned over the data group): its
    checkpoint resumes at tp=1 on 2 ranks under ZeRO 1, on one rank, and at its own layout, with the same
    weights and the same next loss."""
    saved = full_state([r["state"] for r in run_distributed(_hf, 4, "llama", 2, 2, save=str(tmp_path), stage=3)])
    losses = {}
    for world, tp, stage, steps in [(4, 2, 3, 1), (2, 1, 1, 1), (1, 1, 0, 0)]:  # load, then (maybe) one more step
        loaded = run_distributed(_hf, world, "llama", tp, steps, load=str(tmp_path), stage=stage)
        got = full_state([r["loaded"] for r in loaded])
        assert set(got) == set(saved) and all(torch.equal(got[k], saved[k]) for k in saved), (world, tp, stage)
        losses[world] = loaded[0]["losses"]
    assert losses[2] == pytest.approx(losses[4], abs=1e-5) and len(losses[2]) == 1


def _stage3_memory(rank, world):
    from parity import base_config
    from test_real_models import build, loss_of
    from test_tensor_parallel import global_batches

    model = build("llama")
    cfg = base_config(2, 1, 2, 1.0, lr=1e-3, stage=3)
    cfg["tensor_parallel"] = {"autotp_size": 2}
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
    engine, *_ = zeroengine.initialize(model=model, config=cfg)
    d = engine.mesh.dp_rank
    engine.backward(loss_of(engine, (global_batches(2)[0][2 * d:2 * d + 2],)))
    engine.step()
    return {"mem": engine.memory_breakdown(), "psi": engine.optimizer.layout.param_numel,
            "padded": engine.optimizer.layout.total_numel, "tp_rank": engine.mesh.tp_rank}


def test_autotp_at_stage3_memory_follows_the_divided_formula():
    """fp32 ZeRO 3 at dp=2 × tp=2: each rank keeps 1/N of its tensor slice's parameters, gradients and Adam
    state (16 Ψ_rank / N), where Ψ_rank is Ψ/T plus the norms every tensor rank holds alike; estimate_memory's
    16 Ψ/(T·N) is that up to the replicated norms."""
    from test_real_models import build

    n, t = 2, 2
    total = sum(p.numel() for p in build("llama").parameters())
    results = run_distributed(_stage3_memory, 4)
    for r in results:
        mem, padded = r["mem"], r["padded"]
        assert mem["params"] == mem["grads"] == 4 * padded // n
        assert mem["optimizer_states"] == 8 * padded // n
        assert total / t <= r["psi"] <= total / t + total / 100  # the slice, plus a few replicated norms
    predicted = zeroengine.estimate_memory(total, n, 3, tensor_parallel_size=t)["total"]
    assert predicted == pytest.approx(16 * total / (t * n))
    measured = results[0]["mem"]["params"] + results[0]["mem"]["grads"] + results[0]["mem"]["optimizer_states"]
    assert predicted <= measured <= predicted * 1.01


def _memory(rank, world):
    from zeroengine.tensor_parallel import split_of
    from zeroengine.zero.optimizer import reduced_elsewhere

    engine, *_ = zeroengine.initialize(model=tp_pipe_model(2, 2), config=config(2, 4, stage=1))
    engine.train_batch(iter(batches(1, 4, 2)[0][engine.mesh.dp_rank]))
    layout = engine.optimizer.layout
    copies = sum(p.numel() for p in engine.module.parameters() if reduced_elsewhere(p))
    replicated = sum(p.numel() for p in engine.module.parameters() if split_of(p) is None and not reduced_elsewhere(p))
    return {"psi": layout.param_numel, "padded": layout.total_numel, "mem": engine.memory_breakdown(),
            "copies": copies, "replicated": replicated, "coords": engine.mesh.coords()}


def test_memory_per_rank_follows_the_divided_formula():
    """fp32 ZeRO 1 at dp2 × tp2 × pp2: each rank holds its slice's parameters and gradients whole and 1/N of
    its Adam state (8 Ψ_rank + 8 Ψ_rank / N); a replica's slices add up to the model, with the replicated norms
    and biases once per tensor rank; estimate_memory's Ψ/(T·P) is the per-rank mean up to that excess."""
    results = run_distributed(_memory, 8)
    n, t, p = 2, 2, 2
    for r in results:
        mem, psi, padded = r["mem"], r["psi"], r["padded"]
        assert mem["params"] == 4 * (padded + r["copies"])  # the flat buffer, and a tied weight's copy
        assert mem["grads"] == 4 * padded
        assert 8 * psi // n - 8 * (padded - psi) <= mem["optimizer_states"] <= 8 * padded // n
    replica = [r for r in results if r["coords"][1] == 0]
    total = sum(q.numel() for q in tp_pipe_model(1, 1).parameters())
    replicated = sum(r["replicated"] for r in replica if r["coords"][2] == 0)
    assert sum(r["psi"] for r in replica) == total + (t - 1) * replicated
    predicted = zeroengine.estimate_memory(total, n, 1, tensor_parallel_size=t, pipeline_parallel_size=p)
    assert predicted["total"] == pytest.approx(8 * total / (t * p) + 8 * total / (t * p * n))
    measured = sum(r["mem"]["params"] - 4 * r["copies"] + r["mem"]["grads"] + r["mem"]["optimizer_states"]
                   for r in results) / len(results)
    excess = 16 * (t - 1) * replicated / (t * p) + 16 * max(r["padded"] - r["psi"] for r in results)
    assert predicted["total"] - 16 * max(r["padded"] - r["psi"] for r in results) <= measured
    assert measured <= predicted["total"] + excess


def _overflow(rank, world, kind):
    """fp16 at pp=2 or tp=2, an inf put into one gradient on one rank (the last stage, or tensor rank 1) at the
    second step: what each rank saw at each step."""
    from parity import base_config
    from test_real_models import build, loss_of
    from test_tensor_parallel import global_batches

    if kind == "pipe":
        cfg = config(1, 4, dtype="fp16")
        engine, *_ = zeroengine.initialize(model=tp_pipe_model(2, 1), config=cfg)
        poisoned_here = engine.stage_id == 1
    else:
        cfg = base_config(2, 1, 1, 1.0, lr=1e-3, dtype="fp16", stage=1)
        cfg["tensor_parallel"] = {"autotp_size": 2}
        engine, *_ = zeroengine.initialize(model=build("gpt2"), config=cfg)
        poisoned_here = engine.mesh.tp_rank == 1
    poison = {"on": False}
    if poisoned_here:  # a parameter this rank alone holds (a later stage's, or a tensor-parallel slice)
        from zeroengine.tensor_parallel import split_of

        p = next(p for p in engine.module.parameters() if kind == "pipe" or split_of(p) is not None)
        p.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    seen = []
    for step in range(3):
        poison["on"] = step == 1
        before = [p.detach().clone() for p in engine.module.parameters()]
        if kind == "pipe":
            engine.train_batch(iter(batches(1, 4, 1, seed=step)[0][0]))
        else:
            engine.backward(loss_of(engine, (global_batches(1)[step][:2],)))
            engine.step()
        moved = any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
        seen.append({"moved": moved, "scale": engine.loss_scale, "skipped": engine.skipped_steps})
    return seen


@pytest.mark.parametrize("kind", ["pipe", "tensor"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(kind):
    """fp16 overflow checks run over the model group: an inf in a gradient only the last pipeline stage (or
    only tensor rank 1) holds makes every rank skip that step, with the same loss scale afterwards (had each
    rank checked alone, the poisoned one would skip while the others stepped); the steps before and after
    apply everywhere."""
    seen = run_distributed(_overflow, 2, kind)
    assert seen[0] == seen[1]
    assert [s["moved"] for s in seen[0]] == [True, False, True]
    assert [s["skipped"] for s in seen[0]] == [0, 1, 1]
