"""Random numbers across tensor ranks under AutoTP, with dropout on (GPT-2: embedding, residual and attention
dropout 0.1), at tp=2 with each rank seeded ``seed + rank`` as scripts commonly do.

* the replicated parameters (layer norms, row-parallel biases, position embeddings) stay bit-identical on the two
  tensor ranks: replicated dropout draws the same masks on both;
* the attention-dropout masks (of each rank's own heads) differ between the ranks, also when every rank was seeded
  alike (its tracker too), and the replicated dropout masks agree;
* the training equals one process whose dropout draws the same way: replicated dropout from the shared seed
  (tensor rank 0's), the attention dropout of head-half r from the stream tensor rank r forks into,
  ``seed + 2718 + r``. fp32 within 1e-5 (what differs is the order of the row-parallel sums).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import base_config
from test_tensor_parallel import ADAM_EPS, full_state, local_state
from torch.overrides import TorchFunctionMode

import zeroengine
from zeroengine.testing import run_distributed

transformers = pytest.importorskip("transformers")

TP, MICRO, STEPS, SEQ, VOCAB, HEADS, LAYERS, LR, CLIP, P = 2, 2, 3, 8, 128, 4, 2, 1e-3, 1.0, 0.1
SEED = 1234
REFERENCE_ATTENTION = "tp_rng_reference"  # the one-process attention drawing per head-half (registered below)


def build(attn_implementation: str = "eager"):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=LAYERS, n_head=HEADS,
                                  embd_pdrop=P, resid_pdrop=P, attn_pdrop=P, bos_token_id=0, eos_token_id=0,
                                  attn_implementation=attn_implementation)
    return transformers.GPT2LMHeadModel(cfg)


def batches():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(VOCAB, (MICRO, SEQ), generator=g) for _ in range(STEPS)]


class DropoutMasks(TorchFunctionMode):
    """Every ``F.dropout`` call's mask (True where an element that was not already zero was dropped), in call
    order. Hugging Face's eager attention calls ``F.dropout`` itself, not a module a hook could see."""

    def __init__(self):
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.dropout:
            self.masks.append(((out == 0) & (args[0] != 0)).detach().clone())
        return out


def _train(rank, world):
    model = build()
    torch.manual_seed(SEED + rank)  # the common per-rank seeding: AutoTP must make the tensor ranks agree
    cfg = base_config(MICRO, 1, 1, CLIP, lr=LR, stage=1)
    cfg["tensor_parallel"] = {"autotp_size": TP}
    engine, *_ = zeroengine.initialize(model=model, config=cfg)
    recorder, losses = DropoutMasks(), []
    for ids in batches():
        with recorder:
            loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    trained = {"losses": losses, "state": local_state(model), "masks": recorder.masks}

    # Every rank seeded alike, the tracker included (Megatron's seeding done before the tensor rank was known):
    # the split heads must still drop independently.
    model = build()
    zeroengine.checkpointing.model_parallel_cuda_manual_seed(SEED, model_parallel_rank=0)
    engine, *_ = zeroengine.initialize(model=model, config=cfg)
    with DropoutMasks() as alike:
        engine(input_ids=batches()[0], labels=batches()[0])
    return {**trained, "alike": alike.masks}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_train, TP)


def _kinds(masks):
    """(attention masks [B, heads of this rank, T, T], replicated masks [B, T, C])"""
    return [m for m in masks if m.dim() == 4], [m for m in masks if m.dim() == 3]


def test_replicated_parameters_stay_identical_across_tensor_ranks(ranks):
    first, second = ranks
    replicated = [n for n, (_, split) in first["state"].items() if split is None]
    assert any("ln_" in n for n in replicated) and any(n.endswith("c_proj.bias") for n in replicated)
    for n in replicated:
        assert torch.equal(first["state"][n][0], second["state"][n][0]), n


@pytest.mark.parametrize("seeding", ["masks", "alike"])
def test_split_dropout_differs_across_tensor_ranks_and_replicated_dropout_agrees(ranks, seeding):
    (attention_0, replicated_0), (attention_1, replicated_1) = (_kinds(r[seeding]) for r in ranks)
    steps = STEPS if seeding == "masks" else 1
    assert len(attention_0) == steps * LAYERS and len(replicated_0) == steps * (1 + 2 * LAYERS)
    assert all(m.shape[1] == HEADS // TP for m in attention_0)
    assert all(m.any() for m in attention_0 + replicated_0)  # dropout is on
    for a, b in zip(attention_0, attention_1):
        assert not torch.equal(a, b)
    for a, b in zip(replicated_0, replicated_1):
        assert torch.equal(a, b)


class HeadHalves:
    """The one-process equivalent of tp=2's attention dropout: heads [r·H/T, (r+1)·H/T) drop with tensor rank
    r's stream (seeded ``SEED + 2718 + r``, as initialize seeds it), each half drawn as that rank draws it (its
    own contiguous tensor); everything else draws from the default generator."""

    def __init__(self):
        self.states = [torch.Generator().manual_seed(SEED + 2718 + r).get_state() for r in range(TP)]

    def __call__(self, weights: torch.Tensor, p: float) -> torch.Tensor:
        halves = []
        for r, half in enumerate(weights.chunk(TP, dim=1)):
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states[r])
            halves.append(F.dropout(half.contiguous(), p))
            self.states[r] = torch.get_rng_state()
            torch.set_rng_state(outer)
        return torch.cat(halves, dim=1)


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' eager attention (GPT-2's), its dropout by head halves."""
    weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1).type(value.dtype)
    if module.training and dropout:
        weights = module.head_halves(weights, dropout)
    return torch.matmul(weights, value).transpose(1, 2), weights


def reference():
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    transformers.AttentionInterface.register(REFERENCE_ATTENTION, reference_attention)
    AttentionMaskInterface.register(REFERENCE_ATTENTION, eager_mask)  # the float causal mask eager gets
    model = build(REFERENCE_ATTENTION)
    halves = HeadHalves()
    for block in model.transformer.h:
        block.attn.head_halves = halves
    torch.manual_seed(SEED)  # tensor rank 0's seed: both ranks draw their replicated dropout from it
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=ADAM_EPS)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def test_training_with_dropout_matches_one_process_drawing_the_same_masks(ranks):
    ref_losses, ref_state = reference()
    for r in ranks:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
    state = full_state([r["state"] for r in ranks])
    assert set(state) == set(ref_state)
    for n, p in ref_state.items():
        torch.testing.assert_close(state[n], p, atol=1e-5, rtol=0, msg=n)
