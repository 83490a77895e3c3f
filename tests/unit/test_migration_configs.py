"""Configs and script habits that DeepSpeed 0.19.8 refuses, crashes on or silently ignores, and what
zeroengine does with each (docs/migrating-from-deepspeed.md, "Where DeepSpeed refuses or crashes").

Each test checks zeroengine's behaviour: it trains correctly, or raises a ConfigError whose key path
and message say what to change. DeepSpeed's side of each row was observed with DS_ACCELERATOR=cpu
in a scratch script and is recorded in the docs, not here (the package never imports deepspeed).
"""
import argparse
import copy
import os

import pytest
import torch
import torch.nn as nn

import zeroengine
from zeroengine.config import ConfigError, load_config

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(n, micro=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(micro, 6, generator=g), torch.randint(3, (micro,), generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _config(stage=0, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage}}
    cfg.update(extra)
    return cfg


def _train(engine, batches):
    for x, y in batches:
        engine.backward(_loss(engine, x, y))
        engine.step()


def _reference_sgd(batches):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for x, y in batches:
        _loss(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # gradient_clipping's default (DeepSpeed >= 0.19.3)
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


# -- DeepSpeed refuses; zeroengine does the right thing ------------------------------------------

@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("how", ["config", "instance"])
def test_sgd_under_zero_trains_like_torch_sgd(stage, how):
    """DeepSpeed: AssertionError 'You are using an untested ZeRO Optimizer' for SGD at stages 1-3.
    SGD's update is elementwise, so stepping shards is exact: zeroengine runs it."""
    batches = _batches(3)
    model = _model()
    cfg = _config(stage)
    optimizer = None
    if how == "instance":
        del cfg["optimizer"]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    engine, *_ = zeroengine.initialize(model=model, optimizer=optimizer, config=cfg)
    _train(engine, batches)
    for got, want in zip(model.parameters(), _reference_sgd(batches)):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)


def test_optimizer_that_is_not_elementwise_is_refused_with_what_to_change():
    """Both refuse an optimizer they do not know; zeroengine says why and names the ways out."""
    model = _model()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1)  # looks at whole tensors: shards would differ
    cfg = _config(2)
    del cfg["optimizer"]
    with pytest.raises(ConfigError) as err:
        zeroengine.initialize(model=model, optimizer=optimizer, config=cfg)
    assert err.value.key_path == "zero_allow_untested_optimizer"
    assert "LBFGS" in str(err.value) and "zero_allow_untested_optimizer: true" in str(err.value)


def test_fp16_on_cpu_trains_with_dynamic_loss_scaling():
    """DeepSpeed (cpu accelerator): ValueError 'Type fp16 is not supported on your device.'
    zeroengine trains fp16 on CPU (slowly: no native half matmuls) with fp32 masters and loss scaling."""
    model = _model()
    engine, *_ = zeroengine.initialize(model=model, config=_config(1, fp16={"enabled": True,
                                                                           "initial_scale_power": 8}))
    assert all(p.dtype == torch.float16 for p in model.parameters())
    before = [p.detach().float().clone() for p in model.parameters()]
    _train(engine, [(x.half(), y) for x, y in _batches(2)])
    assert engine.was_step_applied() and engine.loss_scale == 2.0 ** 8
    assert all(not torch.equal(a, p.detach().float()) for a, p in zip(before, model.parameters()))


def test_auto_batch_sizes_outside_a_trainer_resolve():
    """DeepSpeed: TypeError "unsupported operand type(s) for //: 'str' and 'str'" when the batch keys
    are "auto" (HuggingFace's Trainer fills them; plain scripts reusing its template crash).
    zeroengine resolves them as a default Trainer would: micro-batch 1, no accumulation."""
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                       "gradient_accumulation_steps": "auto"}, world_size=2)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (1, 1, 2)
    # HuggingFace's ZeRO-2 template, "auto" everywhere, loads as it stands.
    hf = load_config(os.path.join(CONFIGS, "hf_ds_config_zero2.json"), world_size=2, hidden_size=64)
    assert hf.zero_optimization.stage == 2 and hf.precision_dtype == torch.float32
    assert (hf.train_batch_size, hf.gradient_clipping, dict(hf.optimizer.params)["lr"]) == (2, 1.0, 1e-3)


def test_auto_that_cannot_be_inferred_names_what_to_set():
    cfg = _config(0, scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}})
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert err.value.key_path == "scheduler.params.total_num_steps"
    assert "set the number of optimizer steps" in str(err.value)


# -- DeepSpeed silently ignores; zeroengine names the key and the fix -----------------------------

@pytest.mark.parametrize("key,value,path,suggestion", [
    # DeepSpeed trains without clipping.
    ("gradient_clipin", 1.0, "gradient_clipin", "gradient_clipping"),
    # DeepSpeed trains without ZeRO at all.
    ("zero_optimisation", {"stage": 2}, "zero_optimisation", "zero_optimization"),
    # DeepSpeed never prints.
    ("steps_per_prnt", 10, "steps_per_prnt", "steps_per_print"),
    # DeepSpeed trains without the section's settings.
    ("activation_checkpoint", {"partition_activations": True}, "activation_checkpoint", "activation_checkpointing"),
])
def test_top_level_typo_deepspeed_ignores_is_an_error_with_the_right_spelling(key, value, path, suggestion):
    cfg = _config(0)
    cfg[key] = value
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert err.value.key_path == path and f"did you mean '{suggestion}'" in str(err.value)


@pytest.mark.parametrize("change,path,fix", [
    # DeepSpeed trains at stage 0 with the optimizer on the device: the block is silently ignored.
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer", "set zero_optimization.stage"),
    # DeepSpeed trains without clipping.
    ({"gradient_clipping": -1.0}, "gradient_clipping", ">= 0"),
])
def test_settings_deepspeed_accepts_without_effect_are_errors(change, path, fix):
    with pytest.raises(ConfigError) as err:
        load_config(_config(0, **change))
    assert err.value.key_path == path and fix in str(err.value)


def test_stage_written_as_a_string_is_refused_with_the_fix():
    """DeepSpeed coerces "2" to 2; zeroengine does not guess at types, and says so (documented as 'different')."""
    with pytest.raises(ConfigError) as err:
        load_config(_config(0, zero_optimization={"stage": "2"}))
    assert err.value.key_path == "zero_optimization.stage" and "expected an integer" in str(err.value)


def test_scheduler_and_optimizer_names_are_case_insensitive():
    """DeepSpeed refuses "WarmupLr" (AssertionError: does not recognize LR scheduler); both accept "adam"."""
    cfg = load_config(_config(0, optimizer={"type": "adam", "params": {"lr": 1e-3}},
                              scheduler={"type": "WarmupLr", "params": {"warmup_num_steps": 2}}))
    assert (cfg.optimizer.type, cfg.scheduler.type) == ("Adam", "WarmupLR")


def test_optimizer_param_typo_is_a_config_error_not_a_constructor_crash():
    """DeepSpeed: TypeError from the optimizer's constructor ("unexpected keyword argument 'weight_decy'")."""
    cfg = _config(0, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "weight_decy": 0.1}})
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert err.value.key_path == "optimizer.params.weight_decy" and "'weight_decay'" in str(err.value)


def test_deepspeed_feature_switched_on_is_refused_not_ignored():
    """A DeepSpeed-only feature switched on would train differently from what was asked: refused, by name.
    Switched off (as templates write it), the same key is accepted."""
    with pytest.raises(ConfigError) as err:
        load_config(_config(0, flops_profiler={"enabled": True}))
    assert err.value.key_path == "flops_profiler" and "enabled=false" in str(err.value)
    load_config(_config(0, flops_profiler={"enabled": False}))


def test_numbers_written_as_floats_are_accepted_for_sizes():
    """DeepSpeed configs commonly write bucket sizes as 5e7 (a JSON float)."""
    cfg = load_config(_config(2, zero_optimization={"stage": 2, "reduce_bucket_size": 5e7,
                                                    "allgather_bucket_size": 5e8}))
    assert cfg.zero_optimization.reduce_bucket_size == 50_000_000


# -- script habits -----------------------------------------------------------------------------------

def test_script_that_declares_local_rank_and_reads_args_deepspeed_config():
    """DeepSpeed's add_config_arguments does not add --local_rank, so scripts declare it themselves,
    and they read args.deepspeed / args.deepspeed_config back."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = zeroengine.add_config_arguments(parser)
    args = parser.parse_args(["--local_rank=1", "--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.local_rank, args.deepspeed, args.deepspeed_config) == (1, True, "ds.json")
    assert (args.zeroengine, args.zeroengine_config) == (True, "ds.json")
    defaults = parser.parse_args([])
    assert (defaults.deepspeed, defaults.deepspeed_config) == (False, None)


def test_script_declared_local_rank_defaults_to_the_launchers_local_rank(monkeypatch):
    """zeroengine's launcher sets LOCAL_RANK rather than passing --local_rank=N (DeepSpeed's does), so a
    script's own --local_rank with default -1 must still read its rank; an explicit argument wins."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = zeroengine.add_config_arguments(parser)
    assert parser.parse_args([]).local_rank == 3
    assert parser.parse_args(["--local_rank=1"]).local_rank == 1
    monkeypatch.delenv("LOCAL_RANK")
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    assert zeroengine.add_config_arguments(parser).parse_args([]).local_rank == -1  # no launcher: as declared


def test_engine_answers_deepspeeds_accessors():
    batches = _batches(2)
    model = _model()
    engine, optimizer, _, scheduler = zeroengine.initialize(model=model, config=_config(2, gradient_clipping=0.5))
    assert engine.get_global_grad_norm() is None and not engine.was_step_applied()
    assert engine.zero_optimization_stage() == 2 and engine.gradient_clipping() == 0.5
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.optimizer is optimizer and engine.lr_scheduler is scheduler
    _train(engine, batches[:1])
    reference = _model()
    _loss(reference, *batches[0]).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    assert engine.get_global_grad_norm() == pytest.approx(norm.item(), rel=1e-6)
    assert engine.was_step_applied() and engine.global_samples == 4 and engine.global_steps == 1


def test_deepspeed_engine_methods_it_lacks_and_model_attributes_say_what_to_use():
    engine, *_ = zeroengine.initialize(model=_model(), config=_config(2))
    assert engine.get_mom() == [0.9]  # DeepSpeed's get_mom: SGD's momentum (Adam's betas where it has them)
    adam, *_ = zeroengine.initialize(model=_model(), config=_config(0, optimizer={"type": "AdamW",
                                                                                  "params": {"lr": 1e-3}}))
    assert [tuple(b) for b in adam.get_mom()] == [(0.9, 0.999)]
    with pytest.raises(AttributeError, match="no_sync.*not supported.*set_gradient_accumulation_boundary"):
        engine.no_sync()
    # An nn.Module wrapping the model, as DeepSpeed's engine: the model's attributes are found through it.
    assert isinstance(engine, torch.nn.Module) and engine.append.__self__ is engine.module
    assert [n for n, _ in engine.named_parameters()] == ["module." + n for n, _ in engine.module.named_parameters()]
    with pytest.raises(RuntimeError, match="the training dtype comes from the config"):
        engine.half()
    assert engine.to(engine.device) is engine  # moving to where it already is: a no-op (Lightning does it)
    with pytest.raises(RuntimeError, match="the training dtype comes from the config"):
        engine.to(torch.float64)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        engine.no_such_thing
    assert not hasattr(engine, "offload_states")  # hasattr still works: the errors are AttributeErrors


def test_set_gradient_accumulation_boundary_steps_once_after_the_last_micro_batch():
    """DeepSpeed's manual boundary: backward on each micro-batch, the last one marked, one step() call."""
    batches = _batches(4)
    results = []
    for manual in (False, True):
        model = _model()
        engine, *_ = zeroengine.initialize(model=model, config=_config(1, gradient_accumulation_steps=2,
                                                                       train_batch_size=8))
        for i, (x, y) in enumerate(batches):
            if manual:
                engine.set_gradient_accumulation_boundary(i % 2 == 1)
            engine.backward(_loss(engine, x, y))
            if not manual or i % 2 == 1:
                engine.step()
        assert engine.global_steps == 2
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_zero_init_takes_deepspeeds_config_keyword():
    stage3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    stage2 = copy.deepcopy(stage3)
    stage2["zero_optimization"]["stage"] = 2
    assert zeroengine.zero.Init(config_dict_or_path=stage3).enabled
    assert not zeroengine.zero.Init(config_dict_or_path=stage2).enabled


def test_load_checkpoint_takes_load_module_strict(tmp_path):
    """HuggingFace's Trainer calls load_checkpoint(path, load_module_strict=..., ...)."""
    model = _model()
    engine, *_ = zeroengine.initialize(model=model, config=_config(1))
    _train(engine, _batches(1))
    engine.save_checkpoint(str(tmp_path), client_state={"k": 1})
    _, client = engine.load_checkpoint(str(tmp_path), load_module_strict=True, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    assert client["k"] == 1
    _, client = engine.load_checkpoint(str(tmp_path), load_module_strict=False)  # PEFT models pass False
    assert client["k"] == 1


@pytest.mark.parametrize("stage", [0, 2])
def test_was_step_applied_follows_each_step_call_and_a_step_without_backward_is_refused(stage):
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=_config(stage, gradient_accumulation_steps=2))
    applied = []
    for x, y in _batches(4):
        engine.backward(_loss(engine, x, y))
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, True, False, True]  # between boundaries step() is a no-op (as DeepSpeed says)
    engine.step()  # not a boundary: nothing to do, no error
    before = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.raises(RuntimeError, match="no engine.backward\\(\\) since the last optimizer step"):
        engine.step()  # the boundary, with no gradients: stages 1-3 moved weights with zero gradients
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_load_checkpoint_flags_after_tag_are_keyword_only(tmp_path):
    # DeepSpeed's positional order (load_dir, tag, load_module_strict, load_optimizer_states, ...) would
    # silently mean other flags here
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=_config())
    with pytest.raises(TypeError):
        engine.load_checkpoint(str(tmp_path), None, True, False)
