"""FusedAdam: the CUDA source compiles (nvcc, no GPU needed), the torch-fused
fallback matches torch.optim, and on a GPU the multi-tensor kernel does too."""
import pytest
import torch

from zeroengine.ops import builder as builder_module
from zeroengine.ops._adam_common import AdamHyper, reference_adam_step
from zeroengine.ops.adam import FusedAdam
from zeroengine.ops.builder import find_nvcc
from zeroengine.ops.op_builders import FusedAdamBuilder

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_close(actual, expected):
    """Equal up to float32 rounding, relative to the tensor's magnitude."""
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale)


def make_pair(shapes, device, adamw_mode, weight_decay, impl):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(shape, generator=gen).to(device) for shape in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=weight_decay, adamw_mode=adamw_mode, impl=impl)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return opt, ref_cls(ref, lr=1e-2, weight_decay=weight_decay), ours, ref


def step_both(opt, ref_opt, ours, ref, steps=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=gen).to(a.device)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_cuda_source_compiles(tmp_path):
    objects = FusedAdamBuilder().compile_only(tmp_path)
    assert [o.name for o in objects] == ["fused_adam.o"]
    assert objects[0].stat().st_size > 0


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch has CUDA")
def test_without_cuda_falls_back_with_reason(monkeypatch):
    status = FusedAdamBuilder().status()
    assert not status["compatible"] and "without CUDA" in status["reason"]
    monkeypatch.setattr(builder_module, "_WARNED_FALLBACK", set())
    with pytest.warns(RuntimeWarning, match="without CUDA"):
        assert FusedAdam([torch.nn.Parameter(torch.zeros(2))]).backend == "torch-fused"


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_torch_fused_fallback_matches_torch(adamw_mode):
    pair = make_pair([(1000,), (7, 3)], "cpu", adamw_mode, weight_decay=0.1, impl="torch")
    step_both(*pair)
    opt, _, ours, ref = pair
    assert opt.backend == "torch-fused"
    for a, b in zip(ours, ref):
        assert_close(a, b)


def test_rejects_amsgrad():
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdam([torch.nn.Parameter(torch.zeros(1))], amsgrad=True)


# -- on a GPU ---------------------------------------------------------------

# 40 tensors overflow one launch's tensor table (36); the 21M-element tensor
# spans more chunks (65536 elements each) than one launch carries (320), so it
# is split across launches; odd sizes leave ragged chunk ends.
GPU_SHAPES = [(1,), (7,), (65537,), (21_000_007,), (33, 17)] + [(1000 + i,) for i in range(35)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_cuda_kernel_matches_torch(adamw_mode, weight_decay):
    pair = make_pair(GPU_SHAPES, "cuda", adamw_mode, weight_decay, impl="cuda")
    step_both(*pair)
    opt, ref_opt, ours, ref = pair
    assert opt.backend == "cuda"
    for a, b in zip(ours, ref):
        assert_close(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(opt.state[a][key], ref_opt.state[b][key])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_16bit_params(dtype):
    # Reference: the same fp32 math in torch ops (fp32 moments, one rounding of
    # the param per step); torch.optim would keep 16-bit moments instead.
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (65537,), (1001, 3)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen).to("cuda", dtype)) for s in shapes]
    ref = [(p.detach().clone(), torch.zeros(s, device="cuda"), torch.zeros(s, device="cuda"))
           for p, s in zip(ours, shapes)]
    opt = FusedAdam(ours, lr=hyper.lr, weight_decay=hyper.weight_decay, impl="cuda")
    for step in range(1, 4):
        for p, (ref_p, m, v) in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=gen).to("cuda", dtype)
            reference_adam_step(ref_p, p.grad, m, v, step, hyper)
        opt.step()
    for p, (ref_p, m, v) in zip(ours, ref):
        # Each step rounds nearly equal fp32 values (fma differences) to 16 bits,
        # so a step may land one ulp apart; that ulp is of the larger values seen
        # along the way, before later updates cancel towards zero.
        tol = 2 * torch.finfo(dtype).eps * (ref_p.float().abs() + 3 * hyper.lr)
        assert ((p.float() - ref_p.float()).abs() <= tol).all()
        assert_close(opt.state[p]["exp_avg"], m)
        assert_close(opt.state[p]["exp_avg_sq"], v)


@pytest.mark.gpu
@needs_cuda
def test_cuda_state_dict_round_trips_with_torch():
    pair = make_pair([(1000,), (5, 5)], "cuda", True, 0.1, impl="cuda")
    step_both(*pair, steps=2)
    opt, ref_opt, ours, ref = pair
    to_torch = torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1)
    to_torch.load_state_dict(opt.state_dict())
    to_ours = FusedAdam(ref, lr=1e-2, weight_decay=0.1, impl="cuda")
    to_ours.load_state_dict(ref_opt.state_dict())
    step_both(to_torch, to_ours, ours, ref, steps=2, seed=2)
    for a, b in zip(ours, ref):
        assert_close(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("adamw_mode, weight_decay", [(True, 0.01), (False, 0.0)])
def test_cuda_kernel_keeps_torchs_finite_moments_for_an_infinite_param(adamw_mode, weight_decay):
    """No L2 term where there is none (AdamW mode, Adam without decay): 0 * inf would be NaN in the moments."""
    values = torch.tensor([float("inf"), -float("inf"), 1.0, -2.0] * 5, device="cuda")
    ours, ref = [torch.nn.Parameter(values.clone())], [torch.nn.Parameter(values.clone())]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=weight_decay, adamw_mode=adamw_mode, impl="cuda")
    ref_opt = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(ref, lr=1e-2, weight_decay=weight_decay)
    step_both(opt, ref_opt, ours, ref, steps=2)
    infinite = torch.isinf(values)
    assert torch.equal(ours[0][infinite], values[infinite])
    assert_close(ours[0][~infinite], ref[0][~infinite])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.isfinite(opt.state[ours[0]][key]).all()
        assert_close(opt.state[ours[0]][key], ref_opt.state[ref[0]][key])
