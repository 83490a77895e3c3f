"""compress_saved_activations and the bit-mask ReLU (zeroengine/activation_checkpointing/compressed.py).

The claim under test: compression is exactly "round the tensors autograd saves to the dtype, leave weights and
small tensors alone", nothing else. Forward outputs are unchanged bit for bit; gradients equal a reference that
rounds each saved tensor itself; each tensor is stored once however many ops save it.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeroengine.activation_checkpointing import (
    BitMaskReLU,
    compress_saved_activations,
    relu_with_bit_mask,
    use_bit_mask_relu,
)
from zeroengine.activation_checkpointing.compressed import pack_bits, unpack_bits

BF16_REL = 2.0 ** -8  # bf16 keeps 8 significant bits: round-to-nearest is off by at most half an ulp, 2^-8 relative


def _nonleaf(*shape, seed=0):
    """An activation-like input: requires grad (so weights are saved too) but is not a leaf."""
    x0 = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    return x0, x0 * 1.0


class _Echo(torch.autograd.Function):
    """Saves its input; its backward returns the saved tensor as the gradient, so x.grad shows what came back."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        return saved


def _restored(x_values, dtype, **kw):
    x0 = x_values.clone().requires_grad_(True)
    with compress_saved_activations(dtype, **kw) as c:
        y = _Echo.apply(x0 * 1.0)
    y.sum().backward()
    return x0.grad, c.stats


def test_bad_arguments_are_value_errors_naming_them():
    for bad in (torch.float32, torch.float64, torch.int8, torch.float8_e5m2):
        with pytest.raises(ValueError, match="dtype"):
            compress_saved_activations(bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_bytes"):
            compress_saved_activations(torch.bfloat16, min_bytes=bad)
    c = compress_saved_activations()
    with c, pytest.raises(RuntimeError, match="already active"):
        with c:
            pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_round_trip_is_the_cast(dtype):
    x = torch.randn(64, 64) * 10
    got, stats = _restored(x, dtype)
    assert torch.equal(got, x.to(dtype).float()) and not torch.equal(got, x)
    assert (stats.count, stats.original_bytes, stats.stored_bytes) == (1, 64 * 64 * 4, 64 * 64 * 2)


def test_fp8_round_trip_is_scaled_and_within_e4m3_rounding():
    x = torch.randn(64, 64) * 1000  # far beyond 448: the scale must bring it into range
    x[0, 0] = 0.0
    got, stats = _restored(x, torch.float8_e4m3fn)
    scale = x.abs().max() / 448
    # e4m3: 4 significant bits (half ulp 2^-4 relative) for normals; below 2^-6 (scaled) steps of 2^-9 (half 2^-10)
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6)
    assert torch.isfinite(got).all() and ((got - x).abs() <= bound).all() and not torch.equal(got, x)
    assert torch.isclose(got.abs().max(), x.abs().max(), rtol=1e-6) and got[0, 0] == 0
    assert (stats.count, stats.original_bytes, stats.stored_bytes) == (1, 64 * 64 * 4, 64 * 64 + 4)  # + the scale
    zeros, _ = _restored(torch.zeros(64, 64), torch.float8_e4m3fn)
    assert torch.equal(zeros, torch.zeros(64, 64))  # amax 0: scale 1, no NaN


def test_linear_weight_gradient_is_rounded_input_and_the_weight_is_never_compressed():
    lin = nn.Linear(128, 64)
    x0, x = _nonleaf(64, 128)
    g = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    with compress_saved_activations(torch.bfloat16) as c:
        y = lin(x)
    y.backward(g)
    # x was saved (compressed); W was saved too, as W.t(), and must not be: one tensor, x's bytes.
    assert (c.stats.count, c.stats.original_bytes, c.stats.stored_bytes) == (1, 64 * 128 * 4, 64 * 128 * 2)
    assert torch.equal(lin.weight.grad, g.t() @ x.detach().bfloat16().float())
    assert not torch.equal(lin.weight.grad, g.t() @ x.detach())  # it did something
    assert torch.equal(x0.grad, g @ lin.weight.detach())  # the input gradient used the exact weight


def test_a_weight_cast_by_autocast_is_not_compressed():
    lin = nn.Linear(128, 64)
    _, x = _nonleaf(64, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16), compress_saved_activations(torch.float8_e4m3fn) as c:
        y = lin(x)
    y.float().sum().backward()
    assert (c.stats.count, c.stats.original_bytes) == (1, 64 * 128 * 2)  # x's bf16 cast only, not the weight's


class _LogSoftmaxKeepingLse(torch.autograd.Function):
    """Saves its input and a logsumexp computed inside forward (so outside the graph), as attention kernels do."""

    @staticmethod
    def forward(ctx, x):
        lse = torch.logsumexp(x, dim=-1, keepdim=True).expand_as(x).contiguous()
        ctx.save_for_backward(x, lse)
        return x - lse

    @staticmethod
    def backward(ctx, grad):
        x, lse = ctx.saved_tensors
        return grad - torch.exp(x - lse) * grad.sum(-1, keepdim=True)  # exponentiates lse: its error multiplies


def test_tensors_outside_the_graph_are_not_compressed():
    lin = nn.Linear(128, 64)
    x = torch.randn(64, 128)  # a plain input: alive in the caller anyway
    with compress_saved_activations() as c:
        lin(x).sum().backward()
    assert c.stats.count == 0 and torch.equal(lin.weight.grad, torch.ones(64, 64).t() @ x)
    _, x = _nonleaf(64, 128)
    with compress_saved_activations() as c:
        (_LogSoftmaxKeepingLse.apply(x) * torch.randn(64, 128)).sum().backward()  # mul saves only its constant
    assert (c.stats.count, c.stats.original_bytes) == (1, 64 * 128 * 4)  # x; the logsumexp kept exact


def test_min_bytes_threshold():
    lin = nn.Linear(16, 16)
    for min_bytes, expect in ((16 * 16 * 4 + 1, 0), (16 * 16 * 4, 1)):
        x0, x = _nonleaf(16, 16)
        with compress_saved_activations(torch.bfloat16, min_bytes=min_bytes) as c:
            lin(x).sum().backward()
        assert c.stats.count == expect
        ref = torch.ones(16, 16).t() @ x.detach()
        assert torch.equal(lin.weight.grad, ref) == (expect == 0)
        lin.weight.grad = None


def test_mlp_gradients_equal_a_hand_written_backward_on_rounded_activations():
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(96, 192), nn.Linear(192, 48)
    x0, x = _nonleaf(128, 96)
    g = torch.randn(128, 48, generator=torch.Generator().manual_seed(2))
    with compress_saved_activations(torch.bfloat16) as c:
        y = fc2(torch.relu(fc1(x)))
    y.backward(g)
    assert c.stats.count == 2 and c.stats.shared == 1  # x; relu's output saved by relu and by fc2, stored once
    with torch.no_grad():  # the reference: the derivative by hand, reading rounded x and h wherever backward does
        h = torch.relu(fc1(x))
        hb, xb = h.bfloat16().float(), x.bfloat16().float()
        gh = (g @ fc2.weight) * (hb > 0)
        ref = {"fc2.w": g.t() @ hb, "fc1.w": gh.t() @ xb, "fc1.b": gh.sum(0), "x": gh @ fc1.weight}
        exact = {"fc2.w": g.t() @ h, "fc1.w": gh.t() @ x}
    got = {"fc2.w": fc2.weight.grad, "fc1.w": fc1.weight.grad, "fc1.b": fc1.bias.grad, "x": x0.grad}
    for k, want in ref.items():
        # Same products, possibly summed in another order: fp32 noise (k * 2^-24 of the magnitudes)
        tol = 1e-5 * want.abs().max()
        assert (got[k] - want).abs().max() <= tol, k
        if k in exact:  # and the unrounded result is farther away than that: the tolerance can tell them apart
            assert (exact[k] - want).abs().max() > 10 * tol, k


class _Block(nn.Module):
    """A pre-norm transformer block: q, k, v projections of one input, causal sdpa, a GELU MLP."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _round_each_save(t):
    """The reference hooks: the same rule as the context, written out, each save rounded on its own (no sharing)."""
    root = t if t._base is None else t._base
    weight = isinstance(root, nn.Parameter) or (root.is_leaf and root.requires_grad)
    if t.requires_grad and t.dtype == torch.float32 and t.numel() * 4 >= 4096 and not weight:
        return t.detach().bfloat16()
    return t


def _grads(model, x, hooks):
    model.zero_grad(set_to_none=True)
    x0 = x.clone().requires_grad_(True)
    with hooks:
        out = model(model(x0 * 1.0))  # two passes: the second pass's allocations can reuse the first's addresses
    out.pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()] + [x0.grad]


def test_transformer_block_is_exactly_rounded_saves_and_forward_is_unchanged():
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(2, 64, 64)
    out0, plain = _grads(block, x, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    ctx = compress_saved_activations(torch.bfloat16)
    out1, comp = _grads(block, x, ctx)
    ref_hooks = torch.autograd.graph.saved_tensors_hooks(_round_each_save,
                                                         lambda t: t.float() if t.dtype == torch.bfloat16 else t)
    _, ref = _grads(block, x, ref_hooks)
    assert torch.equal(out0, out1)  # forward never reads the stored copies
    assert all(torch.equal(a, b) for a, b in zip(comp, ref))  # exactly "each saved tensor rounded", nothing else
    assert not all(torch.equal(a, b) for a, b in zip(comp, plain))
    assert ctx.stats.shared >= 2 * 2  # per pass, k and v share q's copy of the normalized input
    # First order, each saved tensor that backward reads moves a gradient by at most 2^-8 of that read's share
    # of it; summed over the reads (no cancellation assumed: random weights), the relative error is at most
    # reads * 2^-8. The reads are the saves (shared ones included).
    reads = ctx.stats.count + ctx.stats.shared
    names = [n for n, _ in block.named_parameters()] + ["x"]
    # The key bias's gradient is exactly 0 in exact arithmetic (softmax ignores a shift of a row's scores): both
    # values are rounding noise, so its error is measured against the query bias's gradient, made of the same terms.
    scale = {n: plain[names.index("q.bias" if n == "k.bias" else n)].norm() for n in names}
    rel = {n: (a - b).norm() / scale[n] for n, a, b in zip(names, comp, plain)}
    assert all(r <= reads * BF16_REL for r in rel.values()), rel
    # And the error is the dtype's rounding: it scales with the unit roundoff (fp16 2^-11, bf16 2^-8, fp8 e4m3
    # 2^-4), so against bf16 fp16's is ~8x smaller and fp8's ~16x larger (a factor 4 allowed either way).
    for dtype, expect in ((torch.float16, 2.0 ** -3), (torch.float8_e4m3fn, 2.0 ** 4)):
        _, other = _grads(block, x, compress_saved_activations(dtype))
        for n, a, b in zip(names, other, plain):
            ratio = ((a - b).norm() / scale[n]) / rel[n]
            assert expect / 4 <= ratio <= expect * 4, (dtype, n, ratio)


def test_each_tensor_is_stored_once_however_many_ops_save_it():
    lins = [nn.Linear(128, 128) for _ in range(3)]
    for shape in ((64, 128), (4, 16, 128)):  # 2-d: the same tensor object; 3-d: a new view per linear
        _, x = _nonleaf(*shape)
        with compress_saved_activations() as c:
            sum(lin(x).sum() for lin in lins).backward()
        assert (c.stats.count, c.stats.shared, c.stats.original_bytes) == (1, 2, 64 * 128 * 4), shape
    w, (_, x) = nn.Parameter(torch.ones(128)), _nonleaf(4, 16, 128)
    with compress_saved_activations() as c:  # w * x saves x itself, the linear a [64, 128] view: the same elements
        (w * x + lins[0](x)).sum().backward()
    assert (c.stats.count, c.stats.shared) == (1, 1)
    w, (_, x) = nn.Parameter(torch.ones(16)), _nonleaf(4, 16, 128)
    with compress_saved_activations() as c:  # a permuted view (as attention saves its output) and a flat one
        heads = x.view(4, 16, 8, 16).transpose(1, 2)  # [batch, heads, seq, head_dim], not contiguous
        ((heads * w).sum() + lins[0](x).sum()).backward()
    assert (c.stats.count, c.stats.shared) == (1, 1)  # one copy of x's range, read back with each save's strides
    # Read back in the right layout: a permuted read would sum other elements
    assert torch.allclose(w.grad, x.detach().bfloat16().float().view(4, 16, 8, 16).sum((0, 1, 2)), atol=1e-4)
    _, x = _nonleaf(64, 128)
    with compress_saved_activations() as c:  # modified in place between saves: a new version, a new copy
        y = lins[0](x)
        x.mul_(2)
        y = y + lins[1](x)
    assert (c.stats.count, c.stats.shared) == (2, 0)


# ---- bit-mask ReLU ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4096])
def test_pack_bits_round_trip(n):
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
    assert torch.equal(unpack_bits(packed, mask.shape), mask)
    assert packed[0] == sum(int(b) << i for i, b in enumerate(mask[:8].tolist()))  # element i in bit i


def _saved_bytes(fn, x):
    """Bytes of every distinct storage autograd saves while ``fn(x)`` runs (the input's, which is alive anyway,
    excluded)."""
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() != x.untyped_storage().data_ptr():
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    return y, sum(seen.values())


def test_bit_mask_relu_is_relu_bit_for_bit_and_keeps_one_bit_per_element():
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(3))
    x[0, :10] = 0.0
    x[1, :10] = -0.0
    g = torch.randn(64, 1024, generator=torch.Generator().manual_seed(4))
    g[x <= 0] = float("inf")  # where relu blocks the gradient, even an inf must come out 0
    results = []
    for fn in (torch.relu, relu_with_bit_mask, BitMaskReLU.apply):
        xr = x.clone().requires_grad_(True)
        y, nbytes = _saved_bytes(fn, xr * 1.0)
        y.backward(g)
        results.append((y.detach(), xr.grad, nbytes))
    (y0, g0, b0), *masked = results
    for y1, g1, b1 in masked:
        assert torch.equal(y0, y1) and torch.equal(g0, g1) and torch.isfinite(g1).all()
        assert b0 == x.numel() * 4 and b1 == x.numel() // 8  # 1/32 of the fp32 output relu keeps


def test_use_bit_mask_relu_swaps_relu_modules_only():
    torch.manual_seed(0)
    shared = nn.ReLU()
    model = nn.Sequential(nn.Linear(32, 32), shared, nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 8),
                          nn.Sequential(shared))
    ref = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(16, 32)
    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    assert use_bit_mask_relu(model) == 2  # the shared module counted once
    assert model[1] is model[5][0] and isinstance(model[1], nn.ReLU) and type(model[3]) is not nn.ReLU
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(ref, model.parameters()))
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    assert use_bit_mask_relu(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.SiLU())) == 0
