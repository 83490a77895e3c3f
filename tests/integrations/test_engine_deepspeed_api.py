"""The engine as DeepSpeed's integrations use it (one process): an nn.Module wrapping the model,
backward(scale_wrt_gas=...), destroy(), engine.config read as a dict, the stage-3 16-bit state_dict, and the
``deepspeed`` names with DeepSpeed's signatures (init_distributed, DeepSpeedCPUAdam)."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from runner import environment, script

import zeroengine
from zeroengine.integrations.ds_compat import init_distributed
from zeroengine.integrations.ds_compat.ops.adam import DeepSpeedCPUAdam
from zeroengine.testing import free_port


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randint(3, (4,), generator=g)) for _ in range(n)]


def _config(stage, accumulation=1, **extra):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation, "steps_per_print": 0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": stage}, **extra}


def _engine(stage, accumulation=1, **extra):
    engine, *_ = zeroengine.initialize(model=_model(), config=_config(stage, accumulation, **extra))
    return engine


def _weights(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [0, 2])
def test_scale_wrt_gas_false_backpropagates_the_loss_as_given(stage):
    """Hugging Face's Trainer divides by the accumulation steps itself and passes scale_wrt_gas=False: the same
    gradients as the engine dividing (accepting the flag without honouring it halved them, unnoticed)."""
    runs = []
    for divided_by_caller in (False, True):
        engine = _engine(stage, accumulation=2)
        for x, y in _batches(4):
            loss = nn.functional.cross_entropy(engine(x), y)
            if divided_by_caller:
                engine.backward(loss / 2, scale_wrt_gas=False)
            else:
                engine.backward(loss)
            engine.step()
        runs.append((_weights(engine), engine.get_global_grad_norm()))
    (a, norm_a), (b, norm_b) = runs
    assert norm_a == pytest.approx(norm_b, rel=1e-6)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_the_engine_is_an_nn_module_wrapping_the_model_as_deepspeeds():
    engine = _engine(2)
    assert isinstance(engine, nn.Module) and dict(engine.named_children()) == {"module": engine.module}
    assert list(engine.state_dict()) == ["module." + k for k in engine.module.state_dict()]
    assert engine.append.__self__ is engine.module  # the model's attributes through the engine (as DeepSpeed's)
    engine.eval()
    assert not engine.module.training
    engine.train()
    assert engine.module.training


def test_engine_config_reads_as_a_dict():
    engine = _engine(3)
    assert engine.config.get("zero_optimization", {}).get("stage") == 3  # transformers' save_model asks this
    assert engine.config["train_micro_batch_size_per_gpu"] == 4 and "fp16" in engine.config
    assert engine.config.get("no_such_section", {}).get("autotp_size", 1) == 1  # absent keys: the default given
    assert engine.config.get("tensor_parallel", {}).get("autotp_size", 1) == 0  # DeepSpeed's default: no split
    assert dict(engine.config.items())["zero_optimization"]["stage"] == 3 and "bf16" in engine.config.keys()
    assert engine.config.zero_optimization.stage == 3  # and still the typed config


def test_destroy_takes_the_engine_off_the_model():
    engine = _engine(2)
    x, y = _batches(1)[0]
    engine.backward(nn.functional.cross_entropy(engine(x), y))
    engine.step()
    model = engine.module
    engine.destroy()
    engine.destroy()  # twice is fine, as DeepSpeed's
    with pytest.raises(RuntimeError, match="after engine.destroy"):
        engine(x)
    # Its gradient hooks are gone: a plain backward on the model is the model's own again (it was refused).
    nn.functional.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_zero3_consolidated_state_dict_is_the_full_model():
    reference = _model().state_dict()
    engine = _engine(3, zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    assert engine.zero_gather_16bit_weights_on_model_save()
    full = engine._zero3_consolidated_16bit_state_dict()
    assert list(full) == list(reference)
    for name, value in reference.items():
        assert torch.equal(full[name], value), name
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        _engine(2)._zero3_consolidated_16bit_state_dict()
    assert not _engine(3).zero_gather_16bit_weights_on_model_save()


def test_init_distributed_takes_deepspeeds_keywords_and_refuses_a_world_it_does_not_read():
    from datetime import timedelta

    init_distributed(dist_backend="gloo", auto_mpi_discovery=False, distributed_port=29500,
                     timeout=timedelta(seconds=60))  # already initialised here: returns (the next test starts one)
    with pytest.raises(ValueError, match="reads the world from the launcher's environment"):
        init_distributed(rank=0, world_size=1)


def test_initialize_refuses_mesh_param_saying_where_the_mesh_comes_from():
    from zeroengine.integrations.ds_compat import initialize

    with pytest.raises(ValueError, match="mesh_param.*tensor_parallel.autotp_size, a PipelineModule's stages, or "
                                         "an mpu"):
        initialize(model=_model(), config=_config(0), mesh_param=(2, 1))


def _start_group_in_a_fresh_process(entry: str, port: int, seconds: float, master_port: int | None) -> dict:
    env = environment(switch=False)  # no rank variables: set here as a launcher would, MASTER_PORT only if given
    env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
    command = [sys.executable, script("init_distributed_probe.py"), entry, str(port), str(seconds)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("entry", ["zeroengine", "deepspeed"])
def test_init_distributed_rendezvous_at_distributed_port_with_the_timeout_given(entry):
    """From no process group, a launcher's world without MASTER_PORT: the group meets at distributed_port, and
    its store and collectives give up after ``timeout`` (recorded for zeroengine's own messages too)."""
    port = free_port()
    seen = _start_group_in_a_fresh_process(entry, port, 77, master_port=None)
    assert seen["world"] == 1
    assert seen["store_port"] == port and seen["master_port_env"] == str(port)
    assert seen["store_timeout_s"] == seen["group_timeout_s"] == seen["recorded_timeout_s"] == 77


def test_init_distributed_port_gives_way_to_the_launchers_master_port():
    """As DeepSpeed: distributed_port is the default for a world whose environment names no port."""
    port, launchers = free_port(), free_port()
    seen = _start_group_in_a_fresh_process("deepspeed", port, 33, master_port=launchers)
    assert seen["store_port"] == launchers and seen["master_port_env"] == str(launchers)
    assert seen["store_timeout_s"] == seen["group_timeout_s"] == 33


def test_deepspeed_cpu_adam_matches_torch_adam_and_refuses_what_it_cannot_do():
    torch.manual_seed(0)
    ours, theirs = nn.Linear(5, 3), nn.Linear(5, 3)
    theirs.load_state_dict(ours.state_dict())
    opt_ours = DeepSpeedCPUAdam(ours.parameters(), lr=1e-2, weight_decay=0.1, adamw_mode=False)
    opt_theirs = torch.optim.Adam(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(4, 5)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="bias_correction=False is not supported"):
        DeepSpeedCPUAdam(ours.parameters(), bias_correction=False)


def test_module_methods_that_would_bypass_the_engine_are_refused_with_the_way_that_works():
    engine = _engine(2)
    with pytest.raises(RuntimeError, match="use engine.load_checkpoint"):
        engine.load_state_dict(engine.state_dict())


def test_engine_compile_takes_deepspeeds_arguments_and_trains_as_eager(caplog):
    """accelerate calls engine.compile(backend=..., compile_kwargs=...) when torch_compile is on (DeepSpeed's
    signature); tests/distributed/test_compile.py checks every stage on 2 ranks with inductor."""
    runs = []
    for compiled in (False, True):
        engine = _engine(2)
        assert not engine.is_compiled
        if compiled:
            with pytest.raises(ValueError, match="DeepCompile"):
                engine.compile(schedule=[(0, [])])
            engine.compile(backend="eager", compile_kwargs={"dynamic": False})
            engine.compile(backend="eager")  # a second call only says so
            assert engine.is_compiled and "already compiled" in caplog.text
        for x, y in _batches(3):
            engine.backward(nn.functional.cross_entropy(engine(x), y))
            engine.step()
        runs.append(_weights(engine))
    for eager, compiled in zip(*runs):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
