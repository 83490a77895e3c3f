"""Optimizer factory: DeepSpeed names and params -> the right torch optimizer, stepping identically."""
import sys
import types

import pytest
import torch

from zeroengine.optim.factory import OPTIMIZER_NAMES, build_optimizer


def params(seed=0, shapes=((4, 3), (3,))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]


def run_steps(optimizer, parameters, steps=3):
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        for p in parameters:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()


def assert_same_steps(built, reference, built_params, reference_params):
    run_steps(built, built_params)
    run_steps(reference, reference_params)
    for a, b in zip(built_params, reference_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("type_name, config, torch_cls, torch_kwargs", [
    # DeepSpeed's default adam_w_mode=True: "Adam" means decoupled weight decay, weight_decay default 0
    ("Adam", {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1},
     torch.optim.AdamW, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    ("Adam", {"lr": 0.01}, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.0}),
    ("Adam", {"lr": 0.01, "adam_w_mode": False, "weight_decay": 0.1},
     torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1}),
    ("AdamW", {"lr": 0.02, "weight_decay": 0.05}, torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.05}),
    ("AdamW", {"lr": 0.02}, torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.0}),
    # torch_adam: torch's class with torch's own defaults (AdamW: weight_decay=0.01)
    ("AdamW", {"lr": 0.02, "torch_adam": True}, torch.optim.AdamW, {"lr": 0.02}),
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, {}),
    ("Adam", {"lr": 0.01, "amsgrad": True, "foreach": False}, torch.optim.AdamW,
     {"lr": 0.01, "amsgrad": True, "weight_decay": 0.0, "foreach": False}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 1e-4},
     torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 1e-4}),
    ("SGD", {"lr": 0.1, "momentum": 0.5, "dampening": 0.1}, torch.optim.SGD,
     {"lr": 0.1, "momentum": 0.5, "dampening": 0.1}),
    ("SGD", {}, torch.optim.SGD, {"lr": 1e-3}),
])
def test_builds_right_class_and_steps_like_torch(type_name, config, torch_cls, torch_kwargs):
    built_params, reference_params = params(), params()
    built = build_optimizer(type_name, dict(config), built_params)
    reference = torch_cls(reference_params, **torch_kwargs)
    assert type(built) is torch_cls
    for key, value in reference.defaults.items():
        assert built.defaults[key] == value, key
    assert_same_steps(built, reference, built_params, reference_params)


def test_default_lr_and_betas_tuple():
    opt = build_optimizer("Adam", {"betas": [0.5, 0.6]}, params())
    assert opt.defaults["lr"] == 1e-3
    assert opt.param_groups[0]["betas"] == (0.5, 0.6)
    assert isinstance(opt.param_groups[0]["betas"], tuple)


def test_type_name_is_case_insensitive():
    assert type(build_optimizer("adamw", {}, params())) is torch.optim.AdamW
    assert type(build_optimizer("sgd", {}, params())) is torch.optim.SGD


def test_param_group_dicts():
    a, b = params()
    groups = [{"params": [a], "lr": 0.5, "betas": [0.7, 0.8]}, {"params": [b], "weight_decay": 0.3}]
    opt = build_optimizer("Adam", {"lr": 0.01}, groups)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.01]
    assert opt.param_groups[0]["betas"] == (0.7, 0.8)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.3]
    assert groups[0]["betas"] == [0.7, 0.8]  # the caller's dicts are not modified


def test_accepts_generators():
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer("SGD", {"lr": 0.1}, model.parameters())
    assert len(opt.param_groups[0]["params"]) == 2


@pytest.mark.parametrize("type_name, config, message", [
    ("Lamb", {}, "Adam, AdamW, SGD, CPUAdam"),
    ("Adam", {"max_grad_norm": 1.0}, "gradient_clipping"),
    ("Adam", {"lr": 0.1, "beta": 0.9}, "beta"),
    ("SGD", {"betas": [0.9, 0.99]}, "betas"),
    ("Adam", {"bias_correction": False}, "bias_correction"),
    ("Adam", {"adam_w_mode": "yes"}, "adam_w_mode"),
    ("Adam", {"betas": [0.9]}, "betas"),
    ("Adam", {"decoupled_weight_decay": True}, "decoupled_weight_decay"),
])
def test_bad_config_raises_value_error(type_name, config, message):
    with pytest.raises(ValueError, match=message):
        build_optimizer(type_name, config, params())


def test_deepspeed_flags_with_default_values_are_accepted():
    opt = build_optimizer("Adam", {"bias_correction": True, "set_grad_none": True}, params())
    assert type(opt) is torch.optim.AdamW


def test_names_listed():
    assert OPTIMIZER_NAMES == ("Adam", "AdamW", "SGD", "CPUAdam", "Adafactor", "SM3", "Muon")


def test_matrix_optimizers_take_their_own_parameters_and_defaults():
    from zeroengine.optim.adafactor import Adafactor
    from zeroengine.optim.sm3 import SM3

    params = [torch.nn.Parameter(torch.zeros(3, 2))]
    ada = build_optimizer("adafactor", {"eps": [None, 1e-2], "d": 2.0}, params)
    assert type(ada) is Adafactor
    assert ada.defaults["lr"] == 1e-2 and ada.defaults["eps"] == (None, 1e-2) and ada.defaults["d"] == 2.0
    assert type(build_optimizer("SM3", {}, params)) is SM3 and build_optimizer("SM3", {}, params).defaults["lr"] == 0.1
    with pytest.raises(ValueError, match="eps"):
        build_optimizer("Adafactor", {"eps": 1e-3}, params)
    with pytest.raises(ValueError, match="betas"):
        build_optimizer("SM3", {"betas": [0.9, 0.99]}, params)


# ---- CPUAdam (the op lives elsewhere; a stand-in checks the translation) ----

class FakeCPUAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, adamw_mode=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      adamw_mode=adamw_mode))


@pytest.fixture
def fake_cpu_adam(monkeypatch):
    module = types.ModuleType("zeroengine.ops.adam")
    module.CPUAdam = FakeCPUAdam
    monkeypatch.setitem(sys.modules, "zeroengine.ops.adam", module)
    return FakeCPUAdam


@pytest.fixture
def no_cpu_adam(monkeypatch):
    monkeypatch.setitem(sys.modules, "zeroengine.ops.adam", None)  # import raises ImportError


def test_cpu_adam_translation(fake_cpu_adam):
    opt = build_optimizer("CPUAdam", {"lr": 0.01, "betas": [0.8, 0.9], "adam_w_mode": False}, params())
    assert type(opt) is fake_cpu_adam
    assert opt.defaults["adamw_mode"] is False and opt.defaults["betas"] == (0.8, 0.9)
    assert build_optimizer("CPUAdam", {}, params()).defaults["adamw_mode"] is True
    assert build_optimizer("CPUAdam", {"adamw_mode": False}, params()).defaults["adamw_mode"] is False


@pytest.mark.parametrize("config, message", [
    ({"torch_adam": True}, "torch_adam"),
    ({"fused": True}, "fused"),
    ({"amsgrad": True}, "amsgrad"),
    ({"adam_w_mode": True, "adamw_mode": False}, "disagree"),
    ({"momentum": 0.9}, "momentum"),
])
def test_cpu_adam_rejects(fake_cpu_adam, config, message):
    with pytest.raises(ValueError, match=message):
        build_optimizer("CPUAdam", config, params())


def test_cpu_adam_unavailable_is_a_clear_runtime_error(no_cpu_adam):
    with pytest.raises(RuntimeError, match="CPUAdam op is unavailable"):
        build_optimizer("CPUAdam", {}, params())


def test_offload_routes_adam_to_cpu_adam(fake_cpu_adam):
    opt = build_optimizer("Adam", {"lr": 0.01}, params(), offload_optimizer=True)
    assert type(opt) is fake_cpu_adam and opt.defaults["adamw_mode"] is True
    opt = build_optimizer("Adam", {"adam_w_mode": False}, params(), offload_optimizer=True)
    assert opt.defaults["adamw_mode"] is False
    # torch_adam keeps torch's class, as in DeepSpeed
    assert type(build_optimizer("AdamW", {"torch_adam": True}, params(), offload_optimizer=True)) \
        is torch.optim.AdamW


def test_offload_without_op_falls_back_to_torch(no_cpu_adam):
    assert type(build_optimizer("Adam", {}, params(), offload_optimizer=True)) is torch.optim.AdamW



@pytest.mark.parametrize("config, key", [({"fused": True}, "optimizer.params.fused"),
                                         ({"amsgrad": True}, "optimizer.params.amsgrad")])
def test_offload_names_the_key_the_cpu_step_cannot_take(fake_cpu_adam, config, key):
    # Before, a plain ValueError about "optimizer type CPUAdam", a type the config never named.
    from zeroengine.config import ConfigError

    with pytest.raises(ConfigError) as info:
        build_optimizer("Adam", dict(config), params(), offload_optimizer=True)
    assert info.value.key_path == key and "offload" in str(info.value), str(info.value)


def test_bf16_masters_refuse_torch_adam_by_name():
    """torch's AdamW on bf16 masters would keep bf16 moments and compute in bf16: neither mode configured."""
    from zeroengine.config import ConfigError

    for name in ("Adam", "AdamW"):
        with pytest.raises(ConfigError) as info:
            build_optimizer(name, {"torch_adam": True}, params(), bf16_masters_state_dtype=torch.float32)
        assert info.value.key_path == "optimizer.params.torch_adam" and "bf16" in str(info.value)
    built = build_optimizer("AdamW", {"torch_adam": False}, params(), bf16_masters_state_dtype=torch.float32)
    assert type(built).__name__ == "LeanAdam" and built.defaults["weight_decay"] == 0.0
