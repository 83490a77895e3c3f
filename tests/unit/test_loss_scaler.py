"""Loss scalers: exact dynamic-scale trajectories for scripted overflow sequences."""
import math

import pytest
import torch

from zeroengine.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleUnderflowError,
    StaticLossScaler,
    build_loss_scaler,
)

O, C = True, False  # overflow / clean step


def run(scaler, flags):
    """The scale after each update_scale(flag)."""
    scales = []
    for flag in flags:
        scaler.update_scale(flag)
        scales.append(scaler.loss_scale)
    return scales


def test_window_growth_and_backoff_without_hysteresis():
    scaler = DynamicLossScaler(init_scale=16, scale_window=3, delayed_shift=1)
    # DeepSpeed 0.19.8: grow on the clean step after 3, 6, ... clean steps since the last overflow
    # (last_overflow_iter starts at -1)
    assert run(scaler, [C, C, C, C, O, C, C, C, C, C, C, C]) == [16, 16, 16, 32, 16, 16, 16, 16, 32, 32, 32, 64]
    assert scaler.cur_iter == 12


def test_window_of_one_skips_the_step_after_an_overflow():
    scaler = DynamicLossScaler(init_scale=4, scale_window=1)
    assert run(scaler, [C, C, O, C, C]) == [4, 8, 4, 4, 8]


def test_overflow_right_after_growth_and_custom_factor():
    scaler = DynamicLossScaler(init_scale=64, scale_factor=4.0, scale_window=2)
    assert run(scaler, [C, C, C, O, O, C, C, C]) == [64, 64, 256, 64, 16, 16, 16, 64]


def test_hysteresis_two_not_consecutive():
    scaler = DynamicLossScaler(init_scale=1024, scale_window=100, delayed_shift=2)
    # first overflow is absorbed; hysteresis is not refilled by clean steps, so later overflows bite at once
    assert run(scaler, [O, O, C, O, C, C]) == [1024, 512, 512, 256, 256, 256]
    assert scaler.cur_hysteresis == 1


def test_hysteresis_two_consecutive():
    scaler = DynamicLossScaler(init_scale=1024, scale_window=100, delayed_shift=2, consecutive_hysteresis=True)
    # any clean step refills the hysteresis
    assert run(scaler, [O, C, O, C, O, O, O]) == [1024, 1024, 1024, 1024, 1024, 512, 256]


def test_window_growth_refills_hysteresis_when_not_consecutive():
    scaler = DynamicLossScaler(init_scale=8, scale_window=2, delayed_shift=2)
    assert run(scaler, [O, C, C, C, O, O]) == [8, 8, 8, 16, 16, 8]
    # iteration 3 grew the scale and refilled hysteresis to 2, so iteration 4's overflow was absorbed


def test_hysteresis_three():
    scaler = DynamicLossScaler(init_scale=256, scale_window=1000, delayed_shift=3)
    assert run(scaler, [O, O, O, O]) == [256, 256, 128, 64]


def test_min_scale_clamp_without_error():
    scaler = DynamicLossScaler(init_scale=8, min_scale=1.5, raise_error_at_min_scale=False)
    assert run(scaler, [O, O, O, O]) == [4, 2, 1.5, 1.5]


def test_min_scale_raises_by_default():
    scaler = DynamicLossScaler(init_scale=4, min_scale=1.0)
    assert run(scaler, [O, O]) == [2, 1]
    with pytest.raises(LossScaleUnderflowError, match="minimum loss scale"):
        scaler.update_scale(True)


def test_min_scale_error_waits_for_hysteresis():
    scaler = DynamicLossScaler(init_scale=1, min_scale=1, delayed_shift=2)
    scaler.update_scale(True)  # absorbed by hysteresis
    with pytest.raises(LossScaleUnderflowError):
        scaler.update_scale(True)


def test_state_dict_round_trip_continues_trajectory():
    flags = [O, C, C, C, O, O, C, C, C, C, C, O, C, C, C, C]
    reference = run(DynamicLossScaler(init_scale=64, scale_window=3, delayed_shift=2), flags)

    first = DynamicLossScaler(init_scale=64, scale_window=3, delayed_shift=2)
    head = run(first, flags[:7])
    state = first.state_dict()
    resumed = DynamicLossScaler(init_scale=2 ** 20, scale_window=3, delayed_shift=2)
    resumed.load_state_dict(state)
    assert resumed.cur_iter == 7 and resumed.loss_scale == first.loss_scale
    assert head + run(resumed, flags[7:]) == reference


def test_state_kind_mismatch_and_missing_keys():
    with pytest.raises(ValueError, match="static"):
        DynamicLossScaler().load_state_dict(StaticLossScaler(8).state_dict())
    with pytest.raises(ValueError, match="dynamic"):
        StaticLossScaler(8).load_state_dict(DynamicLossScaler().state_dict())
    with pytest.raises(ValueError, match="missing"):
        DynamicLossScaler().load_state_dict({"cur_scale": 2.0})


def test_static_scaler_never_changes():
    scaler = StaticLossScaler(128)
    assert run(scaler, [O, O, C, C, O]) == [128] * 5
    assert scaler.cur_iter == 0 and not scaler.dynamic
    loss = torch.tensor(0.5)
    assert scaler.scale_loss(loss).item() == 64.0
    other = StaticLossScaler(1)
    other.load_state_dict(scaler.state_dict())
    assert other.loss_scale == 128


def test_scale_loss_keeps_graph():
    w = torch.tensor(2.0, requires_grad=True)
    DynamicLossScaler(init_scale=8).scale_loss(w * 3).backward()
    assert w.grad.item() == 24.0


def test_defaults():
    scaler = DynamicLossScaler()
    assert scaler.loss_scale == 2 ** 16 and scaler.scale_factor == 2.0 and scaler.scale_window == 1000
    assert scaler.min_scale == 1.0 and scaler.delayed_shift == 1 and not scaler.consecutive_hysteresis
    assert scaler.dynamic and scaler.cur_iter == 0


@pytest.mark.parametrize("kwargs", [
    dict(init_scale=0), dict(init_scale=float("inf")), dict(scale_factor=1.0), dict(scale_window=0),
    dict(min_scale=-1), dict(delayed_shift=0), dict(init_scale=0.5, min_scale=1.0),
])
def test_bad_dynamic_arguments(kwargs):
    with pytest.raises(ValueError):
        DynamicLossScaler(**kwargs)


# ---- overflow detection ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_has_overflow_detects_nonfinite(dtype, bad):
    tensors = [torch.randn(5, 7).to(dtype), torch.randn(11).to(dtype)]
    assert not StaticLossScaler.has_overflow(tensors)
    tensors[1][4] = bad
    assert DynamicLossScaler.has_overflow(tensors)


def test_has_overflow_edge_cases():
    big = torch.full((3,), torch.finfo(torch.float32).max)
    assert not DynamicLossScaler.has_overflow([big, -big])  # large but finite
    assert not DynamicLossScaler.has_overflow([])
    assert not DynamicLossScaler.has_overflow([None, torch.empty(0), torch.arange(3)])
    t = torch.zeros(4, 4)
    t[3, 0] = float("nan")
    assert DynamicLossScaler.has_overflow([t[:, 0]])  # non-contiguous view
    assert DynamicLossScaler.has_overflow(iter([torch.zeros(2), t]))


def test_has_overflow_does_not_modify_tensors():
    t = torch.tensor([1.0, float("inf"), -0.0])
    before = t.clone()
    DynamicLossScaler.has_overflow([t])
    assert torch.equal(t, before) and math.copysign(1, t[2].item()) == -1


# ---- factory from the fp16 config section ----

def test_build_loss_scaler():
    assert build_loss_scaler(False, loss_scale=0) is None
    dynamic = build_loss_scaler(True, loss_scale=0, initial_scale_power=12, loss_scale_window=50, hysteresis=3,
                                consecutive_hysteresis=True, min_loss_scale=0.25)
    assert isinstance(dynamic, DynamicLossScaler)
    assert dynamic.loss_scale == 2 ** 12 and dynamic.scale_window == 50 and dynamic.delayed_shift == 3
    assert dynamic.consecutive_hysteresis and dynamic.min_scale == 0.25
    static = build_loss_scaler(True, loss_scale=512, initial_scale_power=12)
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 512
    defaults = build_loss_scaler(True)
    assert defaults.loss_scale == 2 ** 16 and defaults.delayed_shift == 2 and defaults.scale_window == 1000
    with pytest.raises(ValueError, match="loss_scale"):
        build_loss_scaler(True, loss_scale=-1)
    with pytest.raises(ValueError, match="initial_scale_power"):
        build_loss_scaler(True, initial_scale_power=200)


def test_package_exports():
    import zeroengine.precision as precision
    assert precision.DynamicLossScaler is DynamicLossScaler
    assert precision.build_loss_scaler is build_loss_scaler
