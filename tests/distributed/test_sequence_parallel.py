"""Ulysses sequence parallelism (zeroengine.sequence_parallel) against one process training on whole sequences.

A small Llama (transformers, sdpa attention) trains on the same sequences with and without sequence parallelism:
sp = 2 and 4, dp2 × sp2, ZeRO stages 0-3 and optimizer offload, grouped-query attention whose key/value heads are
fewer than sp (replicated) or a multiple of it. Each rank runs the model on its piece of every sequence, the loss
is the good-token-weighted mean over the group (sequence_parallel_loss), and the engine averages gradients over
data × sequence ranks. fp32 losses and parameters must equal one process's within 1e-5, with SGD (where a
mis-scaled gradient shows: Adam would hide a constant factor) and with Adam.
"""
from __future__ import annotations

import pytest
import torch

import zeroengine
from zeroengine.sequence_parallel import (
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
    parallel_state,
    sequence_parallel_loss,
    shift_labels,
)
from zeroengine.testing import run_distributed

pytest.importorskip("transformers")

SEQ, VOCAB, STEPS = 16, 96, 3
# Adam's eps. Sequence parallelism sums attention's contributions in another order, so a gradient that nearly
# cancels (an embedding row whose token's uses pull both ways: -7.0e-6 here, with 1.2e-7 of fp32 rounding between
# the two runs) differs by a few percent; with eps = 1e-6, Adam's g / (sqrt(v) + eps) turns that into a 2e-5
# difference of the weight in one step. eps = 1e-3 damps rounding noise below 1e-6 while real gradients
# (1e-3..1e-1) still take Adam's normalised steps; SGD (no normalisation) checks the gradients themselves.
ADAM_EPS = 1e-3


def build(kv_heads: int = 4, heads: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def sequences(steps: int, count: int):
    """``count`` sequences per step, with -100 labels on a prompt and at the end (not every piece has as many
    good tokens: the weighting shows)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (count, SEQ), generator=g)
        labels = ids.clone()
        labels[:, :5] = -100  # the prompt
        labels[:, -2:] = -100
        out.append((ids, labels))
    return out


def config(stage: int, optimizer: str, dp: int, offload: bool = False) -> dict:
    params = {"lr": 0.05} if optimizer == "SGD" else {"lr": 1e-2, "eps": ADAM_EPS, "weight_decay": 0.0}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": dp,
           "gradient_clipping": 0.0, "steps_per_print": 1000,
           "optimizer": {"type": optimizer, "params": params},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 400, "stage3_param_persistence_threshold": 0}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def reference(optimizer: str, dp: int, **model_kwargs):
    """One process: each step the mean over the dp sequences of their mean loss over good tokens."""
    model = build(**model_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05) if optimizer == "SGD" else \
        torch.optim.Adam(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    losses = []
    positions = torch.arange(SEQ).unsqueeze(0)
    for ids, labels in sequences(STEPS, dp):
        opt.zero_grad()
        step = [model(input_ids=ids[i:i + 1], position_ids=positions, labels=labels[i:i + 1]).loss for i in range(dp)]
        (sum(step) / dp).backward()
        opt.step()
        losses.append([float(v.detach()) for v in step])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank, world, sp, stage, optimizer, offload=False, model_kwargs=None):
    model = build(**(model_kwargs or {}))
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=sp, micro_batch_size=1,
                                                          seq_length=SEQ, seq_length_is_variable=False)
    try:
        dp = world // sp
        engine, *_ = zeroengine.initialize(model=model, config=config(stage, optimizer, dp, offload), mpu=mpu)
        group, sp_rank = parallel_state.get_sequence_parallel_group(), parallel_state.get_sequence_parallel_rank()
        dp_rank = engine.mesh.dp_rank
        piece = slice(sp_rank * SEQ // sp, (sp_rank + 1) * SEQ // sp)
        positions = torch.arange(SEQ).unsqueeze(0)
        losses = []
        for ids, labels in sequences(STEPS, dp):
            labels_here = shift_labels(labels[dp_rank:dp_rank + 1])[:, piece]
            logits = engine(input_ids=ids[dp_rank:dp_rank + 1, piece], position_ids=positions[:, piece]).logits
            loss = model.loss_function(logits=logits, labels=None, shift_labels=labels_here, vocab_size=VOCAB)
            loss = sequence_parallel_loss(loss, labels_here, group)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        state = {}
        with zeroengine.zero.GatheredParameters(list(model.parameters())):
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {"losses": losses, "state": state, "dp_rank": dp_rank, "sp": engine.mesh.sp}
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers("sdpa")


def check(results, optimizer, dp, tol=1e-5, **model_kwargs):
    ref_losses, ref_state = reference(optimizer, dp, **model_kwargs)
    for r in results:
        assert r["losses"] == pytest.approx([step[r["dp_rank"]] for step in ref_losses], abs=tol, rel=0)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=tol, rtol=0, msg=k)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_sp2_matches_one_process_at_every_zero_stage(stage, optimizer):
    check(run_distributed(train, 2, 2, stage, optimizer), optimizer, 1)


def test_sp4_with_key_value_heads_replicated():
    """4 query heads, 2 key/value heads over 4 sequence ranks: each k/v head serves two ranks."""
    kwargs = {"kv_heads": 2}
    check(run_distributed(train, 4, 4, 2, "SGD", model_kwargs=kwargs), "SGD", 1, **kwargs)


@pytest.mark.parametrize("stage,offload", [(1, True), (3, False)])
def test_dp2_sp2_matches_one_process(stage, offload):
    kwargs = {"kv_heads": 2}
    check(run_distributed(train, 4, 2, stage, "Adam", offload, model_kwargs=kwargs), "Adam", 2, **kwargs)


def _adapted(rank, world):
    """Each rank's loader: one batch of its own length (6 on rank 0, 8 on rank 1) and a non-tensor value."""
    parallel_state.initialize_sequence_parallel(2)
    length = 6 + 2 * rank
    ids = torch.arange(length).unsqueeze(0) + 100 * rank
    batch = {"input_ids": ids, "position_ids": torch.arange(length).unsqueeze(0), "labels": ids.clone(),
             "source": f"rank {rank}"}
    adapter = UlyssesSPDataLoaderAdapter([batch], sp_rank=parallel_state.get_sequence_parallel_rank(),
                                         sp_group=parallel_state.get_sequence_parallel_group(), sp_world_size=2,
                                         device=torch.device("cpu"))
    out = [next(adapter), next(adapter)]
    with pytest.raises(StopIteration):
        next(adapter)
    return out, len(adapter)


def test_the_adapter_gives_every_rank_its_piece_of_each_ranks_batch_in_turn():
    results = run_distributed(_adapted, 2)
    for rank, (micro_batches, length) in enumerate(results):
        assert length == 2
        for source, mb in enumerate(micro_batches):
            whole = torch.arange(6 + 2 * source) + 100 * source
            piece = slice(rank * len(whole) // 2, (rank + 1) * len(whole) // 2)
            assert mb["input_ids"].tolist() == [whole[piece].tolist()]
            assert mb["shift_labels"].tolist() == [shift_labels(whole[None])[0, piece].tolist()]
            assert mb["position_ids"].tolist() == [list(range(len(whole)))[piece]]
            assert mb["source"] == f"rank {source}" and "labels" not in mb


def _causal_attention(q, k, v):
    """[seq, batch, heads, dim] in and out."""
    out = torch.nn.functional.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                                           v.permute(1, 2, 0, 3), is_causal=True)
    return out.permute(2, 0, 1, 3)


def _qkv(batch_first: bool):
    g = torch.Generator().manual_seed(3)
    shape = (2, 8, 4, 5) if batch_first else (8, 2, 4, 5)  # 8 tokens, 4 heads
    return [torch.randn(shape, generator=g, requires_grad=True) for _ in range(3)]


def _distributed_attention(rank, world, batch_first):
    from zeroengine.sequence_parallel import DistributedAttention

    parallel_state.initialize_sequence_parallel(world)
    q, k, v = _qkv(batch_first)
    seq = 1 if batch_first else 0
    pieces = [t.detach().chunk(world, dim=seq)[rank].requires_grad_() for t in (q, k, v)]
    local = (lambda a, b, c: _causal_attention(*(t.transpose(0, 1) for t in (a, b, c))).transpose(0, 1)) \
        if batch_first else _causal_attention
    layer = DistributedAttention(local, parallel_state.get_sequence_parallel_group())
    out = layer(*pieces, batch_dim_idx=0 if batch_first else 1)
    (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()  # a loss that weighs every element
    return out.detach(), [p.grad for p in pieces]


@pytest.mark.parametrize("batch_first", [False, True])
def test_distributed_attention_equals_attention_over_the_whole_sequence(batch_first):
    world = 2
    results = run_distributed(_distributed_attention, world, batch_first)
    q, k, v = _qkv(batch_first)
    seq = 1 if batch_first else 0
    if batch_first:
        out = _causal_attention(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
    else:
        out = _causal_attention(q, k, v)
    pieces_out = out.chunk(world, dim=seq)
    weights = [torch.arange(p.numel()).reshape(p.shape) for p in pieces_out]
    sum((p * w).sum() for p, w in zip(pieces_out, weights)).backward()
    for rank, (got, grads) in enumerate(results):
        torch.testing.assert_close(got, pieces_out[rank].detach(), atol=1e-5, rtol=0)
        for g, t in zip(grads, (q, k, v)):
            torch.testing.assert_close(g, t.grad.chunk(world, dim=seq)[rank], atol=1e-4, rtol=1e-5)
