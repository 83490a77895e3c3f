"""Checkpoints outlive their world: save with N ranks at stage s, resume with M ranks at stage t.

The global batch is the same in every world (8 samples a step), so an
uninterrupted run and a resumed one see identical data; after loading, the
weights must be bit-identical to those saved, and training must continue as
if it had never stopped.
"""
import os
import subprocess
import sys

import pytest
import torch
from parity import ADAM_EPS, TINY, make_model

import zeroengine
from zeroengine.checkpoint import (
    CheckpointError,
    convert_zero_checkpoint_to_16bit_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
)
from zeroengine.testing import run_distributed
from zeroengine.zero import GatheredParameters

GLOBAL_BATCH = 8
SAVE_AT, MORE = 3, 3


def config(world, stage, dtype="fp32", offload=False):
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_clipping": 0.5,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": ADAM_EPS}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 10}},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        "bf16": {"enabled": dtype == "bf16"},
        # persistence 0: at stage 3 every parameter of the tiny model is partitioned, not kept whole
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0},
    }
    if offload:  # True, or a float: offload_optimizer.ratio (partial offload)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": float(offload)}
    return cfg


def batch(step, rank, world):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(TINY.vocab_size, (GLOBAL_BATCH, TINY.block_size), generator=g)
    y = torch.randint(TINY.vocab_size, (GLOBAL_BATCH, TINY.block_size), generator=g)
    per_rank = GLOBAL_BATCH // world
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def train(engine, rank, world, first, count):
    losses = []
    for step in range(first, first + count):
        x, y = batch(step, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(zeroengine.comm.all_reduce_scalar(loss.item()) / world)
    return losses


def full_state(engine):
    with GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def save_then_continue(rank, world, stage, save_dir, dtype="fp32", offload=False):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=config(world, stage, dtype, offload))
    train(engine, rank, world, 0, SAVE_AT)
    engine.save_checkpoint(save_dir, tag="step3", client_state={"epoch": 1, "note": "hi", "t": torch.ones(2)})
    saved = full_state(engine)
    losses = train(engine, rank, world, SAVE_AT, MORE)
    return saved, losses, full_state(engine), engine.get_lr()


def load_then_continue(rank, world, stage, load_dir, dtype="fp32", offload=False):
    engine, _, _, _ = zeroengine.initialize(model=make_model(seed=7), config=config(world, stage, dtype, offload))
    path, client_state = engine.load_checkpoint(load_dir)
    loaded = full_state(engine)
    steps = engine.global_steps
    losses = train(engine, rank, world, SAVE_AT, MORE)
    return path, client_state, steps, loaded, losses, full_state(engine), engine.get_lr()


@pytest.fixture(scope="module")
def stage3_checkpoint(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("ckpt") / "run")
    results = run_distributed(save_then_continue, 2, 3, save_dir)
    return save_dir, results[0]


@pytest.mark.parametrize("world,stage", [(1, 0), (2, 1), (4, 2)])
def test_stage3_checkpoint_resumes_in_another_world_and_stage(stage3_checkpoint, world, stage):
    save_dir, (saved, losses, final, lr) = stage3_checkpoint
    for path, client_state, steps, loaded, got_losses, got_final, got_lr in run_distributed(
            load_then_continue, world, stage, save_dir):
        assert path == os.path.join(save_dir, "step3") and steps == SAVE_AT
        assert client_state["epoch"] == 1 and client_state["note"] == "hi" and torch.equal(client_state["t"],
                                                                                          torch.ones(2))
        for name, value in saved.items():  # the very values saved, not approximately
            assert torch.equal(loaded[name], value), name
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), atol=1e-6, rtol=0)
        for name, value in final.items():
            torch.testing.assert_close(got_final[name], value, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
        assert got_lr == lr  # the scheduler resumed where it was


def test_ze_to_fp32_equals_the_gathered_model(stage3_checkpoint, tmp_path):
    save_dir, (saved, _, _, _) = stage3_checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert set(state) == set(saved)
    for name, value in saved.items():
        assert torch.equal(state[name], value), name
    out = tmp_path / "model.pt"
    tag = os.path.basename(open(os.path.join(save_dir, "latest")).read().strip())
    done = subprocess.run([sys.executable, "-m", "zeroengine.checkpoint", save_dir, str(out), "-t", tag],
                          capture_output=True, text=True, timeout=120)  # DeepSpeed's short flag for --tag
    assert done.returncode == 0, done.stderr
    model = make_model(seed=5)
    model.load_state_dict(torch.load(out, weights_only=True))  # strict: every key, tied head included
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    # DeepSpeed's converter takes an output directory (and writes pytorch_model.bin there) and more keywords
    from zeroengine.checkpoint import convert_zero_checkpoint_to_fp32_state_dict
    (tmp_path / "hf").mkdir()
    written = convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "hf"), tag=None,
                                                         exclude_frozen_parameters=False, safe_serialization=False,
                                                         max_shard_size="5GB")
    with pytest.raises(TypeError):  # DeepSpeed's positional order (its third is max_shard_size) is refused
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "hf"), "5GB")
    assert set(get_fp32_state_dict_from_zero_checkpoint(save_dir, exclude_frozen_parameters=False,
                                                        lazy_mode=False)) == set(saved)
    assert written == str(tmp_path / "hf" / "pytorch_model.bin")
    assert convert_zero_checkpoint_to_fp32_state_dict(save_dir, tmp_path / "hf") == written  # a pathlib.Path too
    assert set(torch.load(written, weights_only=True)) == set(saved)
    with pytest.raises(CheckpointError, match="safe_serialization=True is not supported"):
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "hf"), safe_serialization=True)
    blocked = tmp_path / "file"
    blocked.write_text("")
    done = subprocess.run([sys.executable, "-m", "zeroengine.checkpoint", save_dir, str(blocked / "model.pt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "ze_to_fp32: cannot write" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("save,load", [
    ((2, 0, "fp32", False), (2, 3, "fp32", True)),
    ((2, 2, "bf16", True), (2, 3, "bf16", False)),
    ((2, 1, "fp16", False), (2, 1, "fp16", False)),
    ((2, 2, "fp32", 0.5), (2, 2, "fp32", 0.5)),  # Adam state half in host memory, half beside the params
])
def test_every_stage_precision_and_offload_resumes(tmp_path, save, load):
    save_world, save_stage, dtype, save_offload = save
    world, stage, _, offload = load
    save_dir = str(tmp_path / "run")
    saved, losses, final, _ = run_distributed(save_then_continue, save_world, save_stage, save_dir, dtype,
                                              save_offload)[0]
    for _, _, _, loaded, got_losses, got_final, _ in run_distributed(load_then_continue, world, stage, save_dir,
                                                                     dtype, offload):
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name
        # Same world and stage: the resumed run is the uninterrupted one, bit for bit.
        # Another stage reduces in another order: 16-bit rounding of the same sums.
        if (world, stage) == (save_world, save_stage):
            assert got_losses == losses
            assert all(torch.equal(got_final[k], v) for k, v in final.items())
        elif dtype == "fp32":
            torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), atol=1e-6, rtol=0)
        else:
            torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), atol=0.02 * losses[0], rtol=0)


def save_16bit(rank, world, stage, gather_on_save, out_dir):
    cfg = config(world, stage, "bf16")
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather_on_save
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    train(engine, rank, world, 0, 1)
    saved = engine.save_16bit_model(out_dir, "model16.bin")
    return saved, {k: v.clone() for k, v in full_state(engine).items()}


@pytest.mark.parametrize("stage,gather_on_save", [(2, False), (3, True), (3, False)])
def test_save_16bit_model_writes_the_full_model_on_rank0(tmp_path, stage, gather_on_save):
    out = tmp_path / "export"
    results = run_distributed(save_16bit, 2, stage, gather_on_save, str(out))
    expect_saved = stage < 3 or gather_on_save  # DeepSpeed's rule: stage 3 gathers only when asked to
    assert [r[0] for r in results] == [expect_saved] * 2
    if not expect_saved:
        assert not (out / "model16.bin").exists()
        return
    state = torch.load(out / "model16.bin", weights_only=True)
    model = make_model()
    model.load_state_dict(state)  # strict: buffers and the tied head included
    for name, value in state.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value.float(), results[0][1][name]), name


def test_16bit_consolidation_for_inference(stage3_checkpoint, tmp_path):
    save_dir, (saved, _, _, _) = stage3_checkpoint
    out = tmp_path / "model_bf16.pt"
    convert_zero_checkpoint_to_16bit_state_dict(save_dir, str(out), dtype=torch.bfloat16)
    state = torch.load(out, weights_only=True)
    for name, value in saved.items():
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], value.bfloat16()), name


def frozen_model():
    model = make_model()
    model.wpe.weight.requires_grad_(False)  # frozen: partitioned at stage 3, never in the optimizer
    return model


def save_frozen(rank, world, stage, save_dir):
    engine, _, _, _ = zeroengine.initialize(model=frozen_model(), config=config(world, stage))
    train(engine, rank, world, 0, 2)
    engine.save_checkpoint(save_dir)
    return full_state(engine)


def load_frozen(rank, world, stage, save_dir):
    model = frozen_model()
    with torch.no_grad():
        model.wpe.weight.zero_()  # must come back from the checkpoint
    engine, _, _, _ = zeroengine.initialize(model=model, config=config(world, stage))
    engine.load_checkpoint(save_dir)
    return full_state(engine)


def test_frozen_parameters_round_trip_from_stage3(tmp_path):
    save_dir = str(tmp_path / "run")
    saved = run_distributed(save_frozen, 2, 3, save_dir)[0]
    for world, stage in [(1, 0), (2, 3)]:
        for loaded in run_distributed(load_frozen, world, stage, save_dir):
            for name, value in saved.items():
                assert torch.equal(loaded[name], value), (world, stage, name)


# -- DeepSpeed's exclude_frozen_parameters / load_module_strict=False (adapters over a frozen base) ----------

def save_without_frozen(rank, world, stage, save_dir):
    engine, _, _, _ = zeroengine.initialize(model=frozen_model(), config=config(world, stage))
    train(engine, rank, world, 0, 2)
    engine.save_checkpoint(save_dir, exclude_frozen_parameters=True)
    return full_state(engine)


def _load_strict_then_not(model, world, stage, save_dir):
    """An engine for ``model`` that tried a strict load of ``save_dir`` (returns its refusal, or "") and then
    loaded it with load_module_strict=False."""
    engine, _, _, _ = zeroengine.initialize(model=model, config=config(world, stage))
    try:
        engine.load_checkpoint(save_dir)
        refused = ""
    except CheckpointError as err:
        refused = str(err)
    engine.load_checkpoint(save_dir, load_module_strict=False)
    return engine, refused


def load_without_frozen(rank, world, stage, save_dir):
    model = frozen_model()
    with torch.no_grad():
        model.wpe.weight.fill_(0.25)  # this model's own frozen values: kept by a non-strict load
    engine, refused = _load_strict_then_not(model, world, stage, save_dir)
    loaded = full_state(engine)
    losses = train(engine, rank, world, 2, 1)  # and training goes on from there
    return refused, loaded, losses


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_parameters_excluded_from_a_checkpoint_keep_the_loading_model_s_values(tmp_path, stage):
    save_dir = str(tmp_path / "run")
    saved = run_distributed(save_without_frozen, 2, stage, save_dir)[0]
    for refused, loaded, losses in run_distributed(load_without_frozen, 2, stage, save_dir):
        assert "saved with exclude_frozen_parameters=True; pass load_module_strict=False" in refused, refused
        for name, value in saved.items():
            if name == "wpe.weight":
                assert torch.equal(loaded[name], torch.full_like(value, 0.25))
            else:
                assert torch.equal(loaded[name], value), name
        assert len(losses) == 1 and losses[0] == losses[0]
    # the converter leaves them out on request, and gives every other value as saved
    without = get_fp32_state_dict_from_zero_checkpoint(save_dir, exclude_frozen_parameters=True)
    assert "wpe.weight" not in without and set(without) == set(saved) - {"wpe.weight"}
    assert all(torch.equal(without[n], saved[n]) for n in without)
    from zeroengine.checkpoint.consolidate import main as ze_to_fp32

    assert ze_to_fp32([save_dir, str(tmp_path / "out.pt"), "--exclude_frozen_parameters"]) == 0
    assert set(torch.load(tmp_path / "out.pt", weights_only=True)) == set(without)


def load_with_an_adapter(rank, world, stage, save_dir):
    """A model with one more trainable parameter than the checkpoint (an adapter added after saving)."""
    model = frozen_model()
    model.adapter = torch.nn.Linear(TINY.n_embd, 2)
    with torch.no_grad():
        model.adapter.weight.fill_(0.5)
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("zeroengine").addHandler(handler)
    engine, refused = _load_strict_then_not(model, world, stage, save_dir)
    with GatheredParameters([model.adapter.weight]):
        adapter = model.adapter.weight.detach().clone()
    told = [r for r in records if r.startswith("load_module_strict=False")]
    return refused, adapter, full_state(engine), told


def test_a_non_strict_load_keeps_parameters_the_checkpoint_lacks(tmp_path):
    save_dir = str(tmp_path / "run")
    saved = run_distributed(save_frozen, 2, 2, save_dir)[0]
    for rank, (refused, adapter, loaded, told) in enumerate(run_distributed(load_with_an_adapter, 2, 2, save_dir)):
        assert "has no values for ['adapter.bias', 'adapter.weight']" in refused, refused
        # rank 0 says what the non-strict load left alone
        assert told == ([] if rank else ["load_module_strict=False: 2 entries (adapter.bias, adapter.weight) kept "
                                         "this model's values (not in the checkpoint); no entries of the checkpoint "
                                         "skipped (not in this model)"]), told
        assert "load_module_strict=False keeps this model's values" in refused
        assert torch.equal(adapter, torch.full_like(adapter, 0.5))
        assert all(torch.equal(loaded[n], saved[n]) for n in saved)
