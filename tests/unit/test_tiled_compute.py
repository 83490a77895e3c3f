"""Tiled compute (zeroengine.sequence_parallel.tiled) against the untiled computation, in one process.

TiledMLP on a Llama MLP, sequence_tiled_compute over a loss and over an MLP, TiledFusedLogitsLoss on an LM head and
cross-entropy with -100 labels: outputs and the gradients of the input and of every parameter equal the untiled
ones within 1e-6 (fp32), with pieces of unequal length, and whatever the caller does to the output afterwards (a
factor of 0.5, a division by the token count: DeepSpeed computes the head's gradients in forward with an assumed
upstream gradient of 1, which these comparisons catch). Each parameter's gradient is accumulated once per
backward of a tiled op (its post-accumulate-grad hook counts), forward keeps no intermediate activation, and the
ops work under activation checkpointing, with compute_params=None, with a frozen input, and under
torch.autograd.grad.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from zeroengine.sequence_parallel import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
    shards_for,
)

pytest.importorskip("transformers")

HIDDEN, VOCAB, TOL = 16, 40, 1e-6


def llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=44, num_attention_heads=4,
                                num_key_value_heads=4)).float()


def mlp_forward(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def inputs(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def labels(batch, seq, seed=2):
    """Random targets with -100 on a prompt, at the end and here and there."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, VOCAB, (batch, seq), generator=g)
    y[:, :3] = -100
    y[:, -1] = -100
    y[torch.rand(batch, seq, generator=g) < 0.2] = -100
    return y


def assert_same_grads(module_a, module_b, tol=TOL):
    for (name, a), b in zip(module_a.named_parameters(), module_b.parameters()):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, atol=tol, rtol=0, msg=name)


def pair(module):
    return module, copy.deepcopy(module)


# -- TiledMLP ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,shards", [((2, 13, HIDDEN), 4), ((13, HIDDEN), 5), ((1, 6, HIDDEN), 1),
                                          ((1, 3, HIDDEN), 5)])
@pytest.mark.parametrize("listed", [True, False])
def test_tiled_mlp_equals_the_untiled_mlp(shape, shards, listed):
    """Uneven pieces, 2-d input, one piece, more pieces than tokens (empty ones); compute_params listed or None."""
    tiled, plain = pair(llama_mlp())
    x, x_ref = inputs(*shape), inputs(*shape)
    weights = torch.randn(*shape[:-1], HIDDEN, generator=torch.Generator().manual_seed(5))
    out = TiledMLP.apply(mlp_forward, tiled, x, shards, list(tiled.parameters()) if listed else None)
    ref = plain(x_ref)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    (0.5 * (out * weights).sum()).backward()
    (0.5 * (ref * weights).sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=TOL, rtol=0)
    assert_same_grads(tiled, plain)


def test_tiled_mlp_keeps_only_its_input_for_backward():
    """No intermediate activation is saved for backward: the whole sequence's MLP activations never exist at once."""
    mlp = llama_mlp()
    x = inputs(1, 12, HIDDEN)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        TiledMLP.apply(mlp_forward, mlp, x, 4, list(mlp.parameters()))
    assert saved == [tuple(x.shape)]


def count_accumulations(module):
    counts = {name: 0 for name, _ in module.named_parameters()}
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


@pytest.mark.parametrize("which", ["all", "none", "some"])
def test_each_parameter_is_accumulated_once_per_backward(which):
    """Four pieces, one accumulation per parameter and backward, whether the parameters are inputs of the autograd
    Function (listed), found in the recomputed graph (compute_params=None), or both."""
    mlp = llama_mlp()
    counts = count_accumulations(mlp)
    compute_params = {"all": list(mlp.parameters()), "none": None, "some": [mlp.up_proj.weight]}[which]
    for step in range(2):
        TiledMLP.apply(mlp_forward, mlp, inputs(1, 12, HIDDEN), 4, compute_params).sum().backward()
        assert counts == {name: step + 1 for name in counts}


def test_listed_parameters_work_with_torch_autograd_grad():
    """Listed parameters are inputs of the autograd Function: torch.autograd.grad gets their gradients (and
    .grad stays empty), as for any op."""
    tiled, plain = pair(llama_mlp())
    out = TiledMLP.apply(mlp_forward, tiled, inputs(1, 9, HIDDEN), 3, list(tiled.parameters()))
    grads = torch.autograd.grad(out.sum(), list(tiled.parameters()))
    ref = torch.autograd.grad(plain(inputs(1, 9, HIDDEN)).sum(), list(plain.parameters()))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, atol=TOL, rtol=0)
    assert all(p.grad is None for p in tiled.parameters())


def test_a_frozen_input_still_trains_the_parameters():
    """x without a gradient and compute_params=None: the output still requires one, and the parameters get theirs."""
    tiled, plain = pair(llama_mlp())
    x = inputs(1, 10, HIDDEN).detach()
    out = TiledMLP.apply(mlp_forward, tiled, x, 3, None)
    assert out.requires_grad
    out.sum().backward()
    plain(x).sum().backward()
    assert_same_grads(tiled, plain)


@pytest.mark.parametrize("checkpoint", ["torch", "zeroengine"])
def test_tiled_mlp_under_activation_checkpointing(checkpoint):
    import torch.utils.checkpoint

    import zeroengine.checkpointing

    tiled, plain = pair(llama_mlp())
    counts = count_accumulations(tiled)
    x, x_ref = inputs(2, 11, HIDDEN), inputs(2, 11, HIDDEN)

    def block(h):
        return h + TiledMLP.apply(mlp_forward, tiled, h, 3, list(tiled.parameters()))

    if checkpoint == "torch":
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    else:
        out = zeroengine.checkpointing.checkpoint(block, x)
    (out ** 2).mean().backward()
    ((x_ref + plain(x_ref)) ** 2).mean().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=TOL, rtol=0)
    assert_same_grads(tiled, plain)
    assert set(counts.values()) == {1}


# -- sequence_tiled_compute -------------------------------------------------------------------------------------

def lm_head():
    torch.manual_seed(3)
    return torch.nn.Linear(HIDDEN, VOCAB, bias=False)


def summed_loss(hidden_states, shift_labels, head):
    """One piece's cross-entropy, summed over its good tokens (0 for a piece without any)."""
    logits = head(hidden_states).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), shift_labels.reshape(-1), ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("compute_params", ["listed", None])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_sequence_tiled_compute_of_a_loss_equals_the_untiled_loss(compute_params, scale):
    """A loss per piece (output_unshard_dimension=0) summed, then divided by the token count and scaled."""
    tiled, plain = pair(lm_head())
    x, x_ref = inputs(2, 13, HIDDEN), inputs(2, 13, HIDDEN)
    y = labels(2, 13)
    good = (y != -100).sum()
    total = sequence_tiled_compute(summed_loss, 13, 4, {"hidden_states": x, "shift_labels": y}, {"head": tiled},
                                   "hidden_states", [tiled.weight] if compute_params else None,
                                   output_unshard_dimension=0, output_reduction="sum")
    ref = summed_loss(x_ref, y, plain)
    torch.testing.assert_close(total, ref, atol=1e-5, rtol=0)
    (scale * total / good).backward()
    (scale * ref / good).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=TOL, rtol=0)
    assert_same_grads(tiled, plain)


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
def test_sequence_tiled_compute_of_an_mlp_along_the_sequence(reduction):
    """Outputs concatenated along the sequence (dimension 1), then reduced or not; an upstream gradient that is not
    uniform for None."""
    tiled, plain = pair(llama_mlp())
    x, x_ref = inputs(2, 10, HIDDEN), inputs(2, 10, HIDDEN)
    out = sequence_tiled_compute(lambda hidden, module: mlp_forward(module, hidden), 10, 3, {"hidden": x},
                                 {"module": tiled}, "hidden", list(tiled.parameters()),
                                 output_reduction=reduction)
    ref = plain(x_ref)
    ref = ref if reduction is None else (ref.mean() if reduction == "mean" else ref.sum())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4))
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=TOL, rtol=0)
    assert_same_grads(tiled, plain)


def test_sequence_tiled_compute_with_scalar_outputs_and_no_reduction():
    """output_unshard_dimension=0, output_reduction=None: one value per piece (DeepSpeed's cut: 10 in 4 gives 3, 3,
    3, 1), each with its own upstream gradient."""
    tiled, plain = pair(lm_head())
    x, x_ref = inputs(1, 10, HIDDEN), inputs(1, 10, HIDDEN)
    y = labels(1, 10)
    per_piece = SequenceTiledCompute.apply(summed_loss, 10, 4, ["hidden_states", "shift_labels"], ["head"],
                                           "hidden_states", None, 0, None, x, y, tiled)
    bounds = [(0, 3), (3, 6), (6, 9), (9, 10)]
    ref = torch.stack([summed_loss(x_ref[:, a:b], y[:, a:b], plain) for a, b in bounds])
    torch.testing.assert_close(per_piece, ref, atol=1e-5, rtol=0)
    weights = torch.tensor([0.5, -1.0, 2.0, 3.0])
    (per_piece * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=TOL, rtol=0)
    assert_same_grads(tiled, plain)


# -- TiledFusedLogitsLoss ---------------------------------------------------------------------------------------

def head_loss(self, x, y):
    return summed_loss(x, y, self)


def masked_mean_loss(self, x, y, mask):
    """A piece's mean loss over the rows its mask keeps (nan-free when it keeps none)."""
    losses = F.cross_entropy(self(x).float(), y, reduction="none")
    return (losses * mask).sum() / mask.sum().clamp(min=1)


@pytest.mark.parametrize("after", ["per token", "half", "none"])
@pytest.mark.parametrize("shards", [3, 4, 26])
def test_tiled_logits_loss_gradients_follow_what_the_caller_does(after, shards):
    """The summed loss (output_reduction "sum"), then divided by the good-token count (the tutorial's recipe),
    multiplied by 0.5, or left: the head's gradient, not only x's, follows."""
    tiled, plain = pair(lm_head())
    x, x_ref = inputs(2, 13, HIDDEN), inputs(2, 13, HIDDEN)
    y = labels(2, 13)
    total = TiledFusedLogitsLoss.apply(head_loss, tiled, x, y, None, shards, [tiled.weight], "sum")
    ref = summed_loss(x_ref, y, plain)
    torch.testing.assert_close(total, ref, atol=1e-5, rtol=0)
    factor = {"per token": 1 / (y != -100).sum(), "half": 0.5, "none": 1.0}[after]
    (total * factor).backward()
    (ref * factor).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=TOL, rtol=0)
    assert_same_grads(tiled, plain)


@pytest.mark.parametrize("compute_params", ["listed", None])
@pytest.mark.parametrize("batch,seq,rows", [(2, 13, [(0, 7), (7, 14), (14, 21), (21, 26)]),
                                            (1, 9, [(0, 3), (3, 6), (6, 9)])])
def test_tiled_logits_loss_mean_of_the_pieces_with_a_mask(compute_params, batch, seq, rows):
    """output_reduction "mean" over pieces of the flattened batch × sequence cut in 4 (26 rows: 7, 7, 7, 5; 9 rows:
    3, 3, 3, so the mean is over 3 pieces), a mask passed to fn, and the loss halved afterwards."""
    tiled, plain = pair(lm_head())
    x, x_ref = inputs(batch, seq, HIDDEN), inputs(batch, seq, HIDDEN)
    y = labels(batch, seq)
    mask = (y != -100).float()
    y = y.clamp(min=0)
    loss = TiledFusedLogitsLoss.apply(masked_mean_loss, tiled, x, y, mask, 4,
                                      [tiled.weight] if compute_params else None, "mean")
    xr, yr, mr = x_ref.reshape(-1, HIDDEN), y.reshape(-1), mask.reshape(-1)
    ref = torch.stack([masked_mean_loss(plain, xr[a:b], yr[a:b], mr[a:b]) for a, b in rows]).mean()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)
    (0.5 * loss).backward()
    (0.5 * ref).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=TOL, rtol=0)
    assert_same_grads(tiled, plain)


def test_tiled_logits_loss_accumulates_the_head_once():
    head = lm_head()
    counts = count_accumulations(head)
    x = inputs(1, 12, HIDDEN)
    TiledFusedLogitsLoss.apply(head_loss, head, x, labels(1, 12), None, 5, [head.weight], "sum").backward()
    assert counts == {"weight": 1}


def test_a_frozen_head_input_still_trains_the_head():
    """Frozen hidden states (no gradient) with the head found in the graph: the loss still backpropagates."""
    tiled, plain = pair(lm_head())
    x = inputs(1, 8, HIDDEN).detach()
    y = labels(1, 8)
    TiledFusedLogitsLoss.apply(head_loss, tiled, x, y, None, 3, None, "sum").backward()
    summed_loss(x, y, plain).backward()
    assert_same_grads(tiled, plain)


def test_no_backward_work_in_forward():
    """Under no_grad the op only computes the loss: fn runs once per piece."""
    head = lm_head()
    calls = []

    def counted(self, x, y):
        calls.append(x.shape[0])
        return head_loss(self, x, y)

    x = inputs(1, 12, HIDDEN)
    loss = TiledFusedLogitsLoss.apply(counted, head, x, labels(1, 12), None, 4, [head.weight], "sum")
    assert calls == [3, 3, 3, 3]
    loss.backward()
    assert calls == [3, 3, 3, 3] * 2


# -- arguments ------------------------------------------------------------------------------------------------

def test_bad_arguments_are_named():
    head = lm_head()
    x, y = inputs(1, 6, HIDDEN), labels(1, 6)
    with pytest.raises(ValueError, match="output_reduction='max'"):
        TiledFusedLogitsLoss.apply(head_loss, head, x, y, None, 2, None, "max")
    with pytest.raises(ValueError, match="same batch and sequence"):
        TiledFusedLogitsLoss.apply(head_loss, head, x, y[:, :5], None, 2, None, "sum")
    with pytest.raises(ValueError, match="mask"):
        TiledFusedLogitsLoss.apply(head_loss, head, x, y, torch.ones(1, 5), 2, None, "sum")
    with pytest.raises(ValueError, match="one loss value per piece"):
        TiledFusedLogitsLoss.apply(lambda self, a, b: self(a), head, x, y, None, 2, None, "sum")
    with pytest.raises(ValueError, match="shards=0"):
        TiledMLP.apply(mlp_forward, llama_mlp(), x, 0)
    with pytest.raises(ValueError, match="not one of kwargs_to_shard"):
        sequence_tiled_compute(summed_loss, 6, 2, {"hidden_states": x}, {"shift_labels": y, "head": head},
                               "shift_labels")
    with pytest.raises(ValueError, match="seqlen=7"):
        sequence_tiled_compute(summed_loss, 7, 2, {"hidden_states": x, "shift_labels": y}, {"head": head},
                               "hidden_states")
    with pytest.raises(ValueError, match="output_reduction='avg'"):
        sequence_tiled_compute(summed_loss, 6, 2, {"hidden_states": x, "shift_labels": y}, {"head": head},
                               "hidden_states", output_reduction="avg")


def test_shards_for_in_one_process_is_the_tutorials_count():
    assert shards_for(100, 32) == 4
    assert shards_for(64, 32) == 2
    assert shards_for(5, 32) == 1
