"""zeroengine.estimate_memory against docs/concepts.md's table (the distributed tests check it against memory_breakdown)."""
import pytest
import torch

import zeroengine

PSI, N = 1_000_000, 4


@pytest.mark.parametrize("stage,dtype,bytes_per_param", [
    (0, torch.bfloat16, 16), (1, torch.bfloat16, 4 + 12 / N), (2, torch.bfloat16, 2 + 14 / N), (3, torch.float16, 16 / N),
    (0, torch.float32, 16), (1, torch.float32, 8 + 8 / N), (2, torch.float32, 4 + 12 / N), (3, torch.float32, 16 / N),
])
def test_totals_follow_the_design_formulas(stage, dtype, bytes_per_param):
    est = zeroengine.estimate_memory(PSI, N, stage, dtype=dtype)
    assert est["total"] == pytest.approx(bytes_per_param * PSI)
    assert est["cpu"] == 0 and est["device"] == est["total"]


def test_offload_moves_masters_and_state_to_cpu_and_takes_a_module():
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters
    est = zeroengine.estimate_memory(model, 2, 2, offload_optimizer=True, dtype=torch.bfloat16)
    psi = 1_001_000
    assert est["cpu"] == pytest.approx(12 * psi / 2)
    assert est["device"] == pytest.approx(2 * psi + 2 * psi / 2)
    fp32 = zeroengine.estimate_memory(psi, 2, 3, offload_optimizer=True, offload_param=True)
    assert fp32["master_params"] == 4 * psi / 2 and fp32["cpu"] == pytest.approx((4 + 4 + 8) * psi / 2)


def test_partial_offload_splits_masters_and_state_by_the_ratio():
    bf16 = zeroengine.estimate_memory(PSI, 1, 3, offload_optimizer=0.75, dtype=torch.bfloat16)
    assert bf16["total"] == pytest.approx(16 * PSI)  # same model states, only their place changes
    assert bf16["cpu"] == pytest.approx(0.75 * 12 * PSI)
    assert bf16["device"] == pytest.approx((2 + 2 + 0.25 * 12) * PSI)
    # fp32: only the offloaded share has masters (the resident share steps the parameters in place)
    fp32 = zeroengine.estimate_memory(PSI, 2, 2, offload_optimizer=0.5)
    assert fp32["master_params"] == pytest.approx(4 * PSI / 2 * 0.5)
    assert fp32["cpu"] == pytest.approx(0.5 * 12 * PSI / 2)
    full, none = (zeroengine.estimate_memory(PSI, 2, 2, offload_optimizer=r) for r in (1.0, 0.0))
    assert full == zeroengine.estimate_memory(PSI, 2, 2, offload_optimizer=True)
    assert none == zeroengine.estimate_memory(PSI, 2, 2)


def test_bf16_masters_drop_the_fp32_copy_and_bf16_states_halve_adams():
    plain = zeroengine.estimate_memory(PSI, 2, 2, dtype=torch.bfloat16)
    lean = zeroengine.estimate_memory(PSI, 2, 2, dtype=torch.bfloat16, bf16_masters=True)
    leaner = zeroengine.estimate_memory(PSI, 2, 2, dtype=torch.bfloat16, bf16_masters=True, bf16_optimizer_states=True)
    assert (plain["master_params"], lean["master_params"]) == (4 * PSI / 2, 0)
    assert (lean["optimizer_states"], leaner["optimizer_states"]) == (8 * PSI / 2, 4 * PSI / 2)
    offloaded = zeroengine.estimate_memory(PSI, 2, 2, 0.5, dtype=torch.bfloat16, bf16_masters=True,
                                           bf16_optimizer_states=True)
    assert offloaded["master_params"] == pytest.approx(2 * PSI / 2 * 0.5)  # the offloaded share's bf16 copy
    assert offloaded["cpu"] == pytest.approx(0.5 * (2 + 4) * PSI / 2)


@pytest.mark.parametrize("kwargs", [dict(stage=4), dict(stage=0, offload_optimizer=True), dict(stage=2, offload_param=True),
                                    dict(stage=1, dtype=torch.int8), dict(stage=1, world_size=0),
                                    dict(stage=2, offload_optimizer=1.5), dict(stage=2, offload_optimizer=-0.5),
                                    dict(model_or_param_count=-1e9), dict(model_or_param_count=float("nan")),
                                    dict(model_or_param_count=2.5), dict(world_size=2.5), dict(stage=True),
                                    dict(stage="2"), dict(stage=2, offload_optimizer="cpu"),
                                    dict(stage=2, bf16_masters=True), dict(stage=0, dtype=torch.bfloat16, bf16_masters=True),
                                    dict(stage=2, dtype=torch.bfloat16, bf16_optimizer_states=True)])
def test_bad_arguments(kwargs):
    args = dict(model_or_param_count=10, world_size=2, stage=1) | kwargs
    with pytest.raises(ValueError):
        zeroengine.estimate_memory(**args)


def test_frozen_parameters_count_as_parameters_only():
    # LoRA / frozen-base fine-tuning: the frozen weights are held (partitioned at stage 3) but have no
    # gradient, master or optimizer state
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100))  # 10,100 each
    model[0].requires_grad_(False)
    for stage in (2, 3):
        est = zeroengine.estimate_memory(model, 2, stage, dtype=torch.bfloat16)
        assert est["params"] == 2 * 20_200 / (2 if stage == 3 else 1)
        assert est["grads"] == 2 * 10_100 / 2 and est["optimizer_states"] == 8 * 10_100 / 2
