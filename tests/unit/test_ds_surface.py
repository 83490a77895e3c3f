"""The rest of DeepSpeed's surface that users' scripts import, under the ``ZEROENGINE_AS_DEEPSPEED`` alias
(issue 34): ``deepspeed.pipe``, ``deepspeed.moe.layer``, ``deepspeed.zero.Init(module=, mpu=, dtype=)``,
``save_16bit_model(exclude_frozen_parameters=)``, ``load_checkpoint(custom_load_fn=)``, ``utils.RepeatingLoader``,
``checkpointing``'s module functions, ``runtime.utils.see_memory_usage`` and the gradient-clipping default. The
collectives of ``deepspeed.comm`` run on two ranks in tests/distributed/test_ds_surface_ranks.py."""
from __future__ import annotations

import logging
import re
import sys

import psutil
import pytest
import torch
from torch import nn

import zeroengine
from zeroengine.integrations import as_deepspeed
from zeroengine.zero import GatheredParameters
from zeroengine.zero.init import is_init_partitioned


def _deepspeed_modules() -> dict:
    return {name: m for name, m in sys.modules.items() if name == "deepspeed" or name.startswith("deepspeed.")}


@pytest.fixture
def deepspeed():
    """``import deepspeed`` resolving to zeroengine, in this process only for the test's duration."""
    saved = _deepspeed_modules()
    for name in saved:
        del sys.modules[name]
    finder = as_deepspeed.DeepSpeedAliasFinder()
    sys.meta_path.insert(0, finder)
    try:
        import deepspeed

        yield deepspeed
    finally:
        sys.meta_path.remove(finder)
        for name in _deepspeed_modules():
            del sys.modules[name]
        sys.modules.update(saved)


def _config(stage=0, **extra):
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "gradient_clipping": 0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}, **extra}


# -- deepspeed.pipe ----------------------------------------------------------------------------------------------

def test_pipe_builds_deepspeeds_layer_specs_and_trains(deepspeed):
    import deepspeed.pipe
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    assert deepspeed.PipelineModule is PipelineModule and deepspeed.runtime.pipe.PipelineModule is PipelineModule
    torch.manual_seed(0)
    layers = [TiedLayerSpec("io", nn.Linear, 4, 4), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 4, 4),
              TiedLayerSpec("io", nn.Linear, 4, 4)]
    model = PipelineModule(layers, num_stages=1, loss_fn=nn.MSELoss(), dynamic_shape=True)
    assert isinstance(model, zeroengine.pipe.PipelineModule)
    assert [n for n, _ in model.named_parameters()] == ["tied_modules.io.weight", "tied_modules.io.bias",
                                                        "2.weight", "2.bias"]  # DeepSpeed's names, one tied copy
    io, mid = model.tied_modules["io"], getattr(model, "2")
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(model(x), io(mid(torch.tanh(io(x)))))
    expected = nn.functional.mse_loss(model(x), y).item()
    engine, *_ = deepspeed.initialize(model=model, config={**_config(), "train_micro_batch_size_per_gpu": 3})
    assert isinstance(engine, deepspeed.PipelineEngine)
    assert engine.train_batch(iter([(x, y)])).item() == pytest.approx(expected, rel=1e-6)

    with pytest.raises(TypeError, match="DeepSpeed's process topologies .* pass num_stages"):
        PipelineModule(layers, topology=object())


# -- deepspeed.moe.layer -----------------------------------------------------------------------------------------

def test_moe_layer_is_zeroengines_moe(deepspeed):
    import deepspeed.moe.layer
    from deepspeed.moe.layer import MoE

    assert MoE is zeroengine.moe.MoE and deepspeed.moe.layer.MoE is MoE
    torch.manual_seed(0)
    expert = nn.Linear(8, 8)
    layer = MoE(hidden_size=8, expert=expert, num_experts=1, k=1, drop_tokens=False)
    x = torch.randn(2, 5, 8)
    out, l_aux, counts = layer(x)
    # one expert: every token goes to it with gate probability 1
    torch.testing.assert_close(out, layer.local_experts[0](x))
    assert counts.tolist() == [10] and l_aux.item() == pytest.approx(1.0)


# -- deepspeed.zero.Init(module=, mpu=, dtype=) -------------------------------------------------------------------

class _Mpu:
    def get_data_parallel_group(self):
        return None  # the world (one rank here); tests/distributed/test_ds_surface_ranks.py has real groups


def test_zero_init_partitions_a_built_module_casting_it(deepspeed):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    model.register_buffer("scale", torch.full((6,), 0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    deepspeed.zero.Init(module=model, mpu=_Mpu(), dtype=torch.bfloat16,
                        config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}})
    assert all(is_init_partitioned(p) and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.scale.dtype == torch.bfloat16
    with GatheredParameters(list(model.parameters())):
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name].bfloat16()), name
    # trains at stage 3 from those values
    engine, *_ = deepspeed.initialize(model=model, config={**_config(3), "bf16": {"enabled": True}})
    with GatheredParameters(list(engine.module.parameters())):
        assert torch.equal(engine.module[0].weight, before["0.weight"].bfloat16())

    # DeepSpeed's first positional argument is the module; a stage-2 config disables Init (nothing changes)
    plain = nn.Linear(3, 3)
    deepspeed.zero.Init(plain, config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 2}})
    assert not is_init_partitioned(plain.weight) and plain.weight.dtype == torch.float32


def test_zero_init_dtype_casts_what_is_built_inside_and_mpu_must_have_a_data_group(deepspeed):
    with deepspeed.zero.Init(dtype=torch.float16):
        layer = nn.Linear(4, 4)
        layer.register_buffer("b", torch.ones(2))
    assert layer.weight.dtype == torch.float16 and layer.b.dtype == torch.float16 and is_init_partitioned(layer.weight)
    with pytest.raises(TypeError, match="mpu lacks get_data_parallel_group"):
        deepspeed.zero.Init(mpu=object())
    with pytest.raises(ValueError, match="floating-point torch.dtype"):
        deepspeed.zero.Init(dtype=torch.int8)


# -- engine.save_16bit_model(exclude_frozen_parameters=) ---------------------------------------------------------

class _Adapted(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.base.requires_grad_(False)
        self.adapter = nn.Linear(4, 4)
        self.register_buffer("step", torch.zeros(1))

    def forward(self, x):
        return (self.base(x) + self.adapter(x)).pow(2).mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_save_16bit_model_can_leave_out_frozen_parameters(deepspeed, tmp_path, stage):
    torch.manual_seed(0)
    extra = {"zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}
    engine, *_ = deepspeed.initialize(model=_Adapted(), config=_config(stage, **extra))
    assert engine.save_16bit_model(str(tmp_path), "all.bin")
    assert engine.save_16bit_model(str(tmp_path), save_filename="peft.bin", exclude_frozen_parameters=True)
    everything = torch.load(tmp_path / "all.bin", weights_only=True)
    peft = torch.load(tmp_path / "peft.bin", weights_only=True)
    assert sorted(everything) == ["adapter.bias", "adapter.weight", "base.bias", "base.weight", "step"]
    assert sorted(peft) == ["adapter.bias", "adapter.weight", "step"]
    for name, value in peft.items():
        assert torch.equal(value, everything[name]), name


# -- engine.load_checkpoint(custom_load_fn=) ---------------------------------------------------------------------

class _Renamed(nn.Module):
    """The same network as nn.Sequential(Linear, Tanh, Linear), under other names."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _seq():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(engine, x, y):
    dtype = next(engine.module.parameters()).dtype  # (bf16 casts no inputs)
    engine.backward(nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
    engine.step()


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (0, "bf16"), (3, "fp32")])
def test_custom_load_fn_loads_the_weights_and_the_optimizer_follows(deepspeed, tmp_path, stage, dtype):
    precision = {"bf16": {"enabled": dtype == "bf16"}}
    torch.manual_seed(0)
    saver, *_ = deepspeed.initialize(model=_seq(), config=_config(stage, **precision))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)) for _ in range(3)]
    _step(saver, *batches[0])
    saver.save_checkpoint(str(tmp_path), tag="t", client_state={"epoch": 7})

    seen = {}

    def rename(src, dst):  # the checkpoint's names -> this model's
        seen["src"], seen["dst"] = {k: v.clone() for k, v in src.items()}, dst
        names = {"0": "first", "2": "second"}
        dst.load_state_dict({f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in src.items()})

    torch.manual_seed(5)  # other initial values
    loader, *_ = deepspeed.initialize(model=_Renamed(), config=_config(stage, **precision))
    path, client = loader.load_checkpoint(str(tmp_path), "t", custom_load_fn=rename)
    assert path.endswith("t") and client == {"epoch": 7}
    assert seen["dst"] is loader.module
    assert sorted(seen["src"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(v.dtype == torch.float32 for v in seen["src"].values())  # consolidated fp32 values
    # SGD keeps no state: from equal weights (and masters), the same batches give the same weights
    for x, y in batches[1:]:
        _step(saver, x, y)
        _step(loader, x, y)
    tolerance = 1e-2 if dtype == "bf16" else 1e-6  # bf16: the loader's masters start from the 16-bit weights
    with GatheredParameters(list(saver.module.parameters())), GatheredParameters(list(loader.module.parameters())):
        for (_, want), (name, got) in zip(saver.module.state_dict().items(), loader.module.state_dict().items()):
            torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=0, msg=name)


# -- utils.RepeatingLoader, checkpointing, see_memory_usage ------------------------------------------------------

def test_repeating_loader_restarts_its_loader(deepspeed):
    from deepspeed.runtime.dataloader import RepeatingLoader as FromRuntime
    from deepspeed.utils import RepeatingLoader

    assert FromRuntime is RepeatingLoader
    loader = torch.utils.data.DataLoader(torch.arange(6), batch_size=2)
    it = RepeatingLoader(loader)
    assert [next(it).tolist() for _ in range(5)] == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]


def test_checkpointing_module_functions_keep_deepspeeds_meaning(deepspeed):
    import deepspeed.checkpointing
    from deepspeed.runtime.activation_checkpointing import checkpointing

    assert deepspeed.checkpointing is checkpointing
    checkpointing.configure(None, partition_activations=False, num_checkpoints=4, profile=True)
    assert checkpointing.is_configured() and checkpointing.num_layers == 4
    checkpointing.set_num_layers(6)
    assert checkpointing.num_layers == 6 and checkpointing.PROFILE_TIME  # the other settings stay
    checkpointing.reset()  # DeepSpeed's: frees buffers, keeps the settings (Megatron calls it after evaluation)
    assert checkpointing.is_configured() and checkpointing.num_layers == 6
    assert checkpointing.PARTITION_ACTIVATIONS is False and checkpointing.mp_size == 1

    checkpointing.model_parallel_cuda_manual_seed(123)
    assert "model-parallel-rng" in checkpointing.get_cuda_rng_tracker().get_states()
    assert isinstance(checkpointing.get_cuda_rng_tracker(), checkpointing.CudaRNGStatesTracker)
    layer = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    for run in (checkpointing.checkpoint, checkpointing.non_reentrant_checkpoint, lambda f, a: f(a)):
        layer.zero_grad()
        x.grad = None
        run(layer, x).pow(2).sum().backward()
        grads = (x.grad.clone(), layer.weight.grad.clone())
        if run is checkpointing.checkpoint:
            want = grads
        torch.testing.assert_close(grads, want)


def test_see_memory_usage_prints_like_deepspeed(deepspeed, capsys):
    from deepspeed.runtime.utils import see_memory_usage

    see_memory_usage("quiet", force=False)  # DeepSpeed's own calls pass False: nothing
    assert capsys.readouterr().out == ""
    see_memory_usage("after init", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after init"
    used, percent = re.fullmatch(r"CPU Virtual Memory:  used = ([\d.]+) GB, percent = ([\d.]+)%", lines[-1]).groups()
    total = psutil.virtual_memory().total / 1024 ** 3
    assert 0 < float(used) <= total and 0 < float(percent) <= 100
    assert len(lines) == (3 if torch.cuda.is_available() else 2)  # + the accelerator's line on CUDA


def test_comm_names_it_lacks_say_what_to_use(deepspeed):
    import deepspeed.comm as dist

    with pytest.raises(AttributeError, match="batch_isend_irecv is not provided .* use isend / irecv"):
        dist.batch_isend_irecv
    assert callable(dist.all_gather_into_tensor) and callable(dist.reduce_scatter_tensor)


# -- gradient_clipping defaults to 1.0 (DeepSpeed >= 0.19.3) -----------------------------------------------------

def test_gradient_clipping_defaults_to_one_and_is_logged(caplog):
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    before = model.weight.detach().clone()
    config = {k: v for k, v in _config().items() if k != "gradient_clipping"}
    config["optimizer"]["params"]["lr"] = 1.0
    with caplog.at_level(logging.INFO, logger="zeroengine"):
        engine, *_ = zeroengine.initialize(model=model, config=config)
    assert engine.gradient_clipping() == 1.0
    assert "gradient_clipping = 1.0 (DeepSpeed 0.19's default; set \"gradient_clipping\": 0 to turn it off)" \
        in caplog.text
    x = torch.full((2, 4), 10.0)
    engine.backward(engine(x).sub(100).pow(2).mean())  # a gradient norm far above 1
    engine.step()
    assert engine.get_global_grad_norm() > 10
    assert (model.weight.detach() - before).norm().item() == pytest.approx(1.0, rel=1e-4)  # lr 1 × clipped norm 1

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zeroengine"):
        engine, *_ = zeroengine.initialize(model=nn.Linear(4, 1), config=_config())
    assert engine.gradient_clipping() == 0 and "gradient_clipping = 0.0 (off)" in caplog.text
