"""CPUAdam against torch.optim.Adam/AdamW: C++ kernel and PyTorch fallback.

The kernel builds once into the user's op cache (or $ZEROENGINE_CACHE_DIR),
so only the first run on a machine pays for the compile.
"""
import warnings

import pytest
import torch

from zeroengine.ops import builder as builder_module
from zeroengine.ops._adam_common import AdamHyper, reference_adam_step
from zeroengine.ops.adam import CPUAdam
from zeroengine.ops.op_builders import CPUAdamBuilder

SIZES = [1, 7, 1000003]  # below, at and past the SIMD width and the OpenMP block
STEPS = 5
IMPLS = ["cpp", "torch"]


@pytest.fixture(scope="module")
def kernel():
    module = CPUAdamBuilder().load_or_none()
    if module is None:
        pytest.skip(f"cpu_adam op unavailable: {CPUAdamBuilder().status()['reason']}")
    return module


@pytest.fixture(params=IMPLS)
def impl(request):
    if request.param == "cpp":
        request.getfixturevalue("kernel")
    return request.param


def assert_close(actual, expected):
    """Equal up to float32 rounding, relative to the tensor's magnitude."""
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale)


def torch_optimizer_cls(adamw_mode):
    return torch.optim.AdamW if adamw_mode else torch.optim.Adam


def make_params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(shape, generator=gen) for shape in shapes]
    return ([torch.nn.Parameter(t.clone()) for t in init],
            [torch.nn.Parameter(t.clone()) for t in init])


def step_both(opt, ref_opt, ours, ref, steps=STEPS, seed=1):
    """Same random grads for both sides; params listed in neither get none."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_matches_torch(impl, adamw_mode, weight_decay, size):
    ours, ref = make_params([(size,)])
    opt = CPUAdam(ours, lr=1e-2, weight_decay=weight_decay, adamw_mode=adamw_mode, impl=impl)
    ref_opt = torch_optimizer_cls(adamw_mode)(ref, lr=1e-2, weight_decay=weight_decay)
    step_both(opt, ref_opt, ours, ref)
    assert opt.backend.startswith("cpp-") if impl == "cpp" else opt.backend == "torch"
    assert_close(ours[0], ref[0])
    for key in ("exp_avg", "exp_avg_sq"):
        assert_close(opt.state[ours[0]][key], ref_opt.state[ref[0]][key])
    assert opt.state[ours[0]]["step"].item() == STEPS


def test_param_groups_and_params_without_grads(impl):
    shapes = [(33, 17), (5,), (1000,), (3, 3)]
    ours, ref = make_params(shapes)

    def groups(params):
        return [{"params": params[:2], "lr": 3e-3, "weight_decay": 0.05},
                {"params": params[2:], "betas": (0.8, 0.99), "eps": 1e-6}]

    opt = CPUAdam(groups(ours), lr=1e-2, impl=impl)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.0)
    # The last param never gets a grad: it must stay put and have no state.
    step_both(opt, ref_opt, ours[:-1], ref[:-1])
    for a, b in zip(ours, ref):
        assert_close(a, b)
    assert ours[-1] not in opt.state


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_to_16bit_equals_param_cast(impl, dtype):
    sizes = [1, 7, 1000003]
    params = [torch.nn.Parameter(torch.randn(n) * 3) for n in sizes]
    copies = {p: torch.empty(p.numel(), dtype=dtype) for p in params}
    opt = CPUAdam(params, lr=1e-2, weight_decay=0.01, impl=impl)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step_with_copy(copies)
        for p in params:
            assert torch.equal(copies[p], p.detach().to(dtype))


def test_copy_target_is_checked(kernel):
    p = torch.nn.Parameter(torch.randn(10))
    p.grad = torch.randn(10)
    opt = CPUAdam([p])
    with pytest.raises(ValueError, match="elements"):
        opt.step_with_copy({p: torch.empty(9, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        opt.step_with_copy({p: torch.empty(10, dtype=torch.float32)})


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_kernel_16bit_grads(kernel, grad_dtype, adamw_mode):
    # CPUAdam's own grads are fp32 (torch ties .grad's dtype to the param's);
    # the engine calls the kernel directly with 16-bit gradient buffers.
    n = 100003
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                      adamw=adamw_mode)
    ours = [torch.randn(n), torch.zeros(n), torch.zeros(n)]
    ref = [t.clone() for t in ours]
    for step in range(1, 4):
        grad = torch.randn(n).to(grad_dtype)
        kernel.adam_step(ours[0], grad, ours[1], ours[2], None, step, **hyper.kernel_args())
        reference_adam_step(ref[0], grad, ref[1], ref[2], step, hyper)
    for a, b in zip(ours, ref):
        assert_close(a, b)


def test_state_dict_round_trips_with_torch(impl):
    ours, ref = make_params([(257,), (4, 4)])
    opt = CPUAdam(ours, lr=1e-2, weight_decay=0.1, impl=impl)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    step_both(opt, ref_opt, ours, ref, steps=3)

    # Continue our run with torch's optimizer and torch's run with ours.
    to_torch = torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1)
    to_torch.load_state_dict(opt.state_dict())
    to_ours = CPUAdam(ref, lr=1e-2, weight_decay=0.1, impl=impl)
    to_ours.load_state_dict(ref_opt.state_dict())
    assert to_ours.param_groups[0]["adamw_mode"] is True
    step_both(to_torch, to_ours, ours, ref, steps=3, seed=2)
    for a, b in zip(ours, ref):
        assert_close(a, b)
    assert to_ours.state[ref[0]]["step"].item() == 6


def test_rejects_amsgrad_and_cuda_impl_names():
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([torch.nn.Parameter(torch.zeros(1))], amsgrad=True)
    with pytest.raises(ValueError, match="impl"):
        CPUAdam([torch.nn.Parameter(torch.zeros(1))], impl="cuda")


def test_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(CPUAdamBuilder, "is_compatible", lambda self: (False, "simulated"))
    monkeypatch.setattr(builder_module, "_WARNED_FALLBACK", set())
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.warns(RuntimeWarning, match="simulated"):
        assert CPUAdam(params).backend == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CPUAdam(params).backend == "torch"


def test_reloaded_state_of_16bit_params_keeps_fp32_moments_and_resumes_exactly(impl):
    # torch's load_state_dict casts state to the param dtype: fp16 moments underflow, then NaN weights
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        p = torch.nn.Parameter((torch.randn(512) * 0.1).to(dtype))
        q = torch.nn.Parameter(p.detach().clone())
        grads = [(torch.randn(512) * 1e-3).to(dtype) for _ in range(4)]
        opt = CPUAdam([p], lr=1e-3, impl=impl)
        for g in grads:
            p.grad = g
            opt.step()
        first = CPUAdam([q], lr=1e-3, impl=impl)
        for g in grads[:2]:
            q.grad = g
            first.step()
        resumed = CPUAdam([q], lr=1e-3, impl=impl)
        resumed.load_state_dict(first.state_dict())
        assert resumed.state[q]["exp_avg_sq"].dtype == torch.float32
        for g in grads[2:]:
            q.grad = g
            resumed.step()
        assert torch.isfinite(q).all() and torch.equal(q, p), dtype


def test_deepspeed_style_state_with_an_int_step_and_torch_decoupled_flag_load(impl):
    ours, ref = make_params([(64,)])
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    step_both(CPUAdam(ours, lr=1e-2, weight_decay=0.1, impl=impl), ref_opt, ours, ref, steps=2)
    saved = ref_opt.state_dict()
    saved["state"][0]["step"] = int(saved["state"][0]["step"].item())  # DeepSpeedCPUAdam writes an int
    to_ours = CPUAdam(ours, lr=1e-2, weight_decay=0.1, adamw_mode=False, impl=impl)
    to_ours.load_state_dict(saved)
    assert to_ours.param_groups[0]["adamw_mode"] is True  # AdamW's decoupled_weight_decay=True, as torch obeys
    ours[0].grad = torch.ones(64)
    to_ours.step()
    assert to_ours.state[ours[0]]["step"].item() == 3


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_kernel_bf16_params_round_the_fp32_step_once(kernel, state_dtype, grad_dtype, adamw_mode):
    """A bf16 param (bf16_master_weights_and_grads, offloaded) with fp32 or bf16 moments: each step is the fp32
    kernel's step on the widened values, each result rounded to its storage once, so it is bitwise that; and
    within one bf16 step of the pure-PyTorch reference, whose fp32 intermediates round differently (no fma)."""
    n = 100003  # past the OpenMP block, and a scalar tail
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=adamw_mode)
    gen = torch.Generator().manual_seed(3)
    ours = [torch.randn(n, generator=gen).bfloat16(), torch.zeros(n, dtype=state_dtype),
            torch.zeros(n, dtype=state_dtype)]
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        wide = [t.to(torch.float32, copy=True) for t in ours]
        ref = [t.clone() for t in ours]  # (each step from the same values: a one-step difference compounds)
        kernel.adam_step(wide[0], grad.float(), wide[1], wide[2], None, step, **hyper.kernel_args())
        kernel.adam_step(ours[0], grad, ours[1], ours[2], None, step, **hyper.kernel_args())
        for got, want in zip(ours, wide):
            assert torch.equal(got, want.to(got.dtype))
        reference_adam_step(ref[0], grad, ref[1], ref[2], step, hyper)
        # One bf16 step at most (2**-7 relative, at worst), or fp32 rounding where the update cancels the value
        torch.testing.assert_close(ours[0].float(), ref[0].float(), rtol=2**-7, atol=1e-6)
        assert (ours[0] != ref[0]).float().mean() < 0.01  # and only where the fp32 value sits on a rounding edge
    assert ours[1].dtype == state_dtype and ours[0].dtype == torch.bfloat16


def test_bf16_moments_step_load_and_resume_in_bf16(impl):
    """``state_dtype=bf16``: the moments are created, stepped, saved and reloaded as bf16 (a reload does not widen
    them), and a resumed run continues exactly where the uninterrupted one goes."""
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(777).bfloat16())
    q = torch.nn.Parameter(p.detach().clone())
    grads = [torch.randn(777).bfloat16() for _ in range(4)]
    whole = CPUAdam([p], lr=1e-2, weight_decay=0.1, impl=impl, state_dtype=torch.bfloat16)
    for g in grads:
        p.grad = g
        whole.step()
    first = CPUAdam([q], lr=1e-2, weight_decay=0.1, impl=impl, state_dtype=torch.bfloat16)
    for g in grads[:2]:
        q.grad = g
        first.step()
    resumed = CPUAdam([q], lr=1e-2, weight_decay=0.1, impl=impl, state_dtype=torch.bfloat16)
    resumed.load_state_dict(first.state_dict())
    assert {resumed.state[q][k].dtype for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    for g in grads[2:]:
        q.grad = g
        resumed.step()
    assert torch.equal(q, p)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        CPUAdam([p], state_dtype=torch.float16)


def test_the_avx2_build_matches_torch_on_an_avx512_machine(monkeypatch):
    """The kernel dispatches at build time on the CPU's SIMD level: on a machine with AVX-512 the default build
    never runs the AVX2 path that AVX2-only CPUs get, so build that one too (ZEROENGINE_SIMD) and check it."""
    from zeroengine.ops.cpu_features import SIMD_ENV, SimdLevel, simd_level

    if simd_level() is not SimdLevel.AVX512:
        pytest.skip("the default build is already the AVX2 (or scalar) one here")
    monkeypatch.setenv(SIMD_ENV, "avx2")
    ours, ref = make_params([(100003,)])
    opt = CPUAdam(ours, lr=1e-2, weight_decay=0.1, impl="cpp")
    assert opt.backend == "cpp-avx2"
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    step_both(opt, ref_opt, ours, ref)
    assert_close(ours[0], ref[0])
    lean = torch.nn.Parameter(ref[0].detach().bfloat16())  # and the bf16 loads and stores
    wide = torch.nn.Parameter(lean.detach().float())
    a = CPUAdam([lean], lr=1e-2, impl="cpp", state_dtype=torch.bfloat16)
    b = CPUAdam([wide], lr=1e-2, impl="cpp")
    lean.grad = ref[0].grad.bfloat16()
    wide.grad = lean.grad.float()
    a.step()
    b.step()
    assert torch.equal(lean, wide.bfloat16())
    assert torch.equal(a.state[lean]["exp_avg_sq"], b.state[wide]["exp_avg_sq"].bfloat16())


@pytest.mark.parametrize("simd", [None, "avx2"])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_a_tensors_tail_rounds_as_its_body(kernel, monkeypatch, simd, adamw_mode):
    """Elements past a tensor's last whole vector go through the scalar ops, which fuse their multiply-adds where
    the build has FMA as the vector body does: a value's step does not depend on where it falls in its tensor
    (where a ZeRO partition's cut puts it, so on the world size). Before, the tail rounded a * b + c twice and
    differed from the body in the last bit of about one value in five."""
    from zeroengine.ops.cpu_features import SIMD_ENV, SimdLevel, simd_level

    if simd is not None:
        if simd_level() is not SimdLevel.AVX512:
            pytest.skip("the default build is already the AVX2 (or scalar) one here")
        monkeypatch.setenv(SIMD_ENV, simd)
    gen = torch.Generator().manual_seed(0)
    values, grads = torch.randn(112, generator=gen), [torch.randn(112, generator=gen) for _ in range(3)]
    body = torch.nn.Parameter(values.clone())  # 112: whole vectors at either width
    tails = [torch.nn.Parameter(chunk.clone()) for chunk in values.split(7)]  # 7: under either width, all tail
    hyper = dict(lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode, impl="cpp")
    whole, pieces = CPUAdam([body], **hyper), CPUAdam(tails, **hyper)
    assert whole.backend == pieces.backend and (simd is None or whole.backend == f"cpp-{simd}")
    for grad in grads:
        body.grad = grad.clone()
        for tail, chunk in zip(tails, grad.split(7)):
            tail.grad = chunk.clone()
        whole.step()
        pieces.step()
    assert torch.equal(body, torch.cat(tails))
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(whole.state[body][key], torch.cat([pieces.state[t][key] for t in tails]))


@pytest.mark.parametrize("adamw_mode, weight_decay", [(True, 0.01), (False, 0.0)])
def test_an_infinite_param_keeps_torchs_finite_moments(impl, adamw_mode, weight_decay):
    """With no L2 term (AdamW mode, or Adam without weight decay) torch never multiplies the parameter into the
    gradient; 0 * inf would be NaN in the moments, and every later step of those elements NaN with them."""
    values = torch.tensor([float("inf"), -float("inf"), 1.0, -2.0] * 5)  # 20: a vector and a tail
    ours, ref = [torch.nn.Parameter(values.clone())], [torch.nn.Parameter(values.clone())]
    opt = CPUAdam(ours, lr=1e-2, weight_decay=weight_decay, adamw_mode=adamw_mode, impl=impl)
    ref_opt = torch_optimizer_cls(adamw_mode)(ref, lr=1e-2, weight_decay=weight_decay)
    step_both(opt, ref_opt, ours, ref, steps=2)
    infinite = torch.isinf(values)
    assert torch.equal(ours[0][infinite], values[infinite])  # the infinities stay
    assert_close(ours[0][~infinite], ref[0][~infinite])  # and the finite values step as torch's
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.isfinite(opt.state[ours[0]][key]).all()
        assert_close(opt.state[ours[0]][key], ref_opt.state[ref[0]][key])
