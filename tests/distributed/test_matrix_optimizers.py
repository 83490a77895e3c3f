"""Adafactor and SM3 (matrix-wise second moments) at ZeRO stages 0-3, with optimizer offload, and through
checkpoints that reshard, in gloo worlds: each run equals the same optimizer on whole tensors in one process
(torch.optim.Adafactor; the paper's SM3 in tests/sm3_reference.py) within 1e-5 in fp32. ZeRO hands the
optimizer flat pieces of parameters (the tiny model's small buckets cut matrices mid-row across ranks); the
row and column statistics are reduced over the ranks (zeroengine/optim/partitioned.py)."""
import pytest
import torch
from optimizer_references import ReferenceMuon, ReferenceSM3
from parity import ADAM_EPS, base_config, engine_losses, global_batches, make_model, reference_run
from test_checkpoint_reshard import MORE, SAVE_AT, config, full_state, train

import zeroengine
from zeroengine.config import ConfigError
from zeroengine.testing import run_distributed

STEPS = 5
MUON = {"muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.01, "eps": ADAM_EPS}


def _reference_muon(params):
    """DeepSpeed's grouping on the reference model: matrices not named embed / lm_head train with Muon."""
    params = list(params)
    names = [n for n, _ in make_model().named_parameters()]  # (the same model, the same order)
    muon = [p for n, p in zip(names, params) if p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
    adam = [p for p in params if all(p is not q for q in muon)]
    return ReferenceMuon([
        {"params": muon, "use_muon": True, "lr": 0.02, "momentum": 0.9, "weight_decay": 0.01, "ns_method": "gram"},
        {"params": adam, "use_muon": False, "lr": 3e-3, "betas": (0.9, 0.95), "eps": ADAM_EPS, "weight_decay": 0.01}])


OPTIMIZERS = {
    "Adafactor": ({"lr": 2e-2, "weight_decay": 0.01},
                  lambda params: torch.optim.Adafactor(params, lr=2e-2, weight_decay=0.01)),
    # eps as parity.ADAM_EPS, for the same reason: the attention's key bias has a gradient of pure rounding noise
    # (softmax ignores a shift of every key), which g / sqrt(nu) would blow up to lr-sized steps of random sign
    "SM3": ({"lr": 3e-2, "momentum": 0.5, "eps": ADAM_EPS},
            lambda params: ReferenceSM3(params, lr=3e-2, momentum=0.5, eps=ADAM_EPS)),
    "Muon": (MUON, _reference_muon),
}


def _config(name, micro, gas, world, stage, offload=None):
    cfg = base_config(micro, gas, world, 0.5, stage=stage)
    cfg["optimizer"] = {"type": name, "params": OPTIMIZERS[name][0]}
    if offload is not None:  # 1.0, or a ratio: partial offload
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": offload}
    return cfg


def train_matrix(rank, world, name, stage, offload=None):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=_config(name, 2, 2, world, stage, offload))
    assert type(engine.optimizer.optimizer).__name__ == name
    engine.optimizer.optimizer.ns_dtype = torch.float32  # (Muon: the reference's; a no-op for the others)
    if stage > 0:  # the pieces really are cut mid-matrix somewhere (else the test would prove little)
        partition = engine.optimizer.optimizer.partition
        assert any(len(p.shape) > 1 and not p.whole and (name != "Muon" or p.key in partition.muon_keys)
                   for p in partition.places.values())
    losses = engine_losses(engine, global_batches(STEPS, 2, world, 2), rank, world)
    return losses, full_state(engine)


def _check(results, name, world):
    ref_losses, ref_params = reference_run(STEPS, 2, world, micro=2, clip=0.5, make_optimizer=OPTIMIZERS[name][1])
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0)
        for key, ref in ref_params.items():
            torch.testing.assert_close(params[key], ref, atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
    for key in ref_params:  # every rank ends with identical weights
        assert all(torch.equal(r[1][key], results[0][1][key]) for r in results)


# 4 ranks for Adafactor (SM3 reduces through the same layout) and Muon (whole matrices from four pieces)
@pytest.mark.parametrize("name,stage,world", [(n, s, 2) for n in sorted(OPTIMIZERS) for s in range(4)]
                         + [("Adafactor", 3, 4), ("Muon", 3, 4)])
def test_matches_whole_tensor_optimizer_in_one_process(name, stage, world):
    _check(run_distributed(train_matrix, world, name, stage), name, world)


# each optimizer offloaded once, each stage and both kinds of offload (whole, partial) covered among them
@pytest.mark.parametrize("name,stage,offload", [("Adafactor", 1, 1.0), ("SM3", 2, 0.5), ("Muon", 3, 1.0),
                                                ("Adafactor", 3, 0.5)])
def test_with_the_optimizer_offloaded(name, stage, offload):
    """Offloaded buckets step one at a time in host memory (the streamed CPU step), resident ones together on
    the parameters' side: each call reduces the statistics of its own buckets."""
    _check(run_distributed(train_matrix, 2, name, stage, offload), name, 2)


def _matrix_config(name, world, stage):
    cfg = config(world, stage)
    cfg["optimizer"] = {"type": name, "params": OPTIMIZERS[name][0]}
    return cfg


def save_matrix(rank, world, name, stage, save_dir):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=_matrix_config(name, world, stage))
    train(engine, rank, world, 0, SAVE_AT)
    engine.save_checkpoint(save_dir, tag="t")
    losses = train(engine, rank, world, SAVE_AT, MORE)
    return losses, full_state(engine)


def resume_matrix(rank, world, name, stage, save_dir):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=_matrix_config(name, world, stage))
    engine.load_checkpoint(save_dir, tag="t")
    state = engine.optimizer.optimizer.state
    assert state and all(float(s["step"]) == SAVE_AT for s in state.values() if "step" in s)
    assert all(s for s in state.values())
    losses = train(engine, rank, world, SAVE_AT, MORE)
    return losses, full_state(engine)


@pytest.mark.parametrize("name,saved,resumed", [("Adafactor", (2, 3), (1, 0)), ("Adafactor", (1, 0), (2, 2)),
                                                ("SM3", (2, 2), (2, 3)), ("Muon", (2, 3), (1, 0))])
def test_a_checkpoint_resumes_in_another_world_and_stage(tmp_path, name, saved, resumed):
    """(world, stage) saved -> (world, stage) resumed: the row/column statistics are whole in the checkpoint and
    given to every piece of their matrix, whatever the new cut; training goes on as if never stopped."""
    (w0, s0), (w1, s1) = saved, resumed
    uninterrupted = run_distributed(save_matrix, w0, name, s0, str(tmp_path))
    resumed_runs = run_distributed(resume_matrix, w1, name, s1, str(tmp_path))
    want_losses, want_params = uninterrupted[0]
    for losses, params in resumed_runs:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), atol=1e-6, rtol=0)
        for key, want in want_params.items():
            torch.testing.assert_close(params[key], want, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")


def refused(rank, world, cfg):
    try:
        zeroengine.initialize(model=make_model(), config=cfg)
    except ConfigError as err:
        return str(err)
    return None


def test_what_is_not_built_is_refused_by_name(tmp_path):
    delayed = _config("Adafactor", 2, 1, 2, 2, offload=1.0)
    delayed["zero_optimization"]["offload_optimizer"]["delayed_update"] = True
    nvme = _config("SM3", 2, 1, 2, 2)
    nvme["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    for cfg, key in ((delayed, "delayed_update"), (nvme, "offload_optimizer.device")):
        messages = run_distributed(refused, 2, cfg)
        assert all(m is not None and key in m for m in messages), messages



def state_bytes_after_a_step(rank, world, name, stage):
    from zeroengine.optim.state_bytes import state_bytes

    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=_config(name, 2, 1, world, stage))
    engine_losses(engine, global_batches(1, 1, world, 2), rank, world)
    measured = engine.memory_breakdown()["optimizer_states"]
    params = OPTIMIZERS[name][0]
    estimate = zeroengine.estimate_memory(make_model(), world, stage, optimizer=name, optimizer_params=params)
    if stage == 0 or name == "Muon":  # (Muon's state is all per element: partitioned like Adam's)
        return measured, estimate["optimizer_states"], 0, {}
    # what this rank holds: a matrix piece keeps its matrix's whole row/column statistics, a vector piece its
    # elements' (and SM3's momentum is per element of the piece)
    held, matrices = 0, {}
    for place in engine.optimizer.optimizer.partition.places.values():
        piece = place.end - place.start
        if len(place.shape) > 1:
            matrices[place.key] = state_bytes(name, place.shape, {**params, "momentum": 0})
            held += matrices[place.key] + (4 * piece if params.get("momentum") else 0)
        else:
            held += state_bytes(name, (piece,), params)
    return measured, estimate["optimizer_states"], held, matrices


def test_muon_state_is_4_bytes_per_muon_parameter_and_partitions_evenly():
    (m0, e0, _, _), _ = run_distributed(state_bytes_after_a_step, 2, "Muon", 0)
    assert m0 == e0
    model = make_model()
    muon = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n)
    assert e0 == 4 * muon + 8 * (sum(p.numel() for p in model.parameters()) - muon)
    results = run_distributed(state_bytes_after_a_step, 2, "Muon", 2)
    assert sum(r[0] for r in results) == e0 and all(r[1] == e0 / 2 for r in results)


@pytest.mark.parametrize("name", ["Adafactor", "SM3"])
def test_memory_breakdown_counts_the_state_the_formulas_predict(name):
    (m0, e0, _, _), _ = run_distributed(state_bytes_after_a_step, 2, name, 0)
    assert m0 == e0  # unpartitioned: exactly the formula (docs/concepts.md)
    results = run_distributed(state_bytes_after_a_step, 2, name, 2)
    for measured, estimate, held, _ in results:
        assert measured == held  # each rank: its pieces' state, a cut matrix's statistics whole
        assert estimate == e0 / 2
    # over the ranks: the whole model's state once, and the statistics of each matrix cut between the two ranks
    # once more (the estimate's even split leaves that out)
    shared = set(results[0][3]) & set(results[1][3])
    assert shared  # (the tiny model's small buckets do cut matrices)
    assert sum(r[0] for r in results) == e0 + sum(results[0][3][k] for k in shared)


def _llama_muon_config(world, stage):
    from test_real_models import MICRO

    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "steps_per_print": 1000, "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
            "optimizer": {"type": "Muon", "params": {**MUON, "per_head_muon": True}}}


def train_llama_per_head(rank, world, stage):
    from test_real_models import MICRO, build, global_batches, loss_of

    engine, _, _, _ = zeroengine.initialize(model=build("llama"), config=_llama_muon_config(world, stage))
    engine.optimizer.optimizer.ns_dtype = torch.float32
    heads = {n: p.muon_num_heads for n, p in engine.module.named_parameters() if p.muon_num_heads}
    for (ids,) in global_batches("llama"):
        loss = loss_of(engine, (ids[rank * MICRO:(rank + 1) * MICRO],))
        engine.backward(loss)
        engine.step()
    return heads, full_state(engine)


def test_per_head_muon_on_a_llama_orthogonalises_each_attention_head():
    """per_head_muon: q_proj splits into the config's 4 heads, k_proj and v_proj into its 2 key-value heads (of
    8 rows each); partitioned at stage 2 on 2 ranks it equals the whole-tensor reference within 1e-5."""
    from test_real_models import CLIP, build, global_batches, loss_of

    from zeroengine.optim.muon import tag_muon_parameters

    results = run_distributed(train_llama_per_head, 2, 2)
    model = build("llama")
    tagged = tag_muon_parameters(model, per_head=True)
    assert {n.split(".")[-2]: h for n, h in tagged.items()} == {"q_proj": 4, "k_proj": 2, "v_proj": 2}
    opt = _reference_groups(model)
    for (ids,) in global_batches("llama"):
        loss_of(model, (ids,)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    want = {k: v.detach() for k, v in model.state_dict().items()}
    for heads, params in results:
        assert heads == tagged
        for key, value in want.items():
            torch.testing.assert_close(params[key], value, atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")


def _reference_groups(model):
    muon = [p for p in model.parameters() if p.use_muon]
    adam = [p for p in model.parameters() if not p.use_muon]
    return ReferenceMuon([
        {"params": muon, "use_muon": True, "lr": MUON["muon_lr"], "momentum": MUON["momentum"],
         "weight_decay": MUON["weight_decay"], "ns_method": "gram"},
        {"params": adam, "use_muon": False, "lr": MUON["adam_lr"], "betas": (0.9, 0.95), "eps": MUON["eps"],
         "weight_decay": MUON["weight_decay"]}])
