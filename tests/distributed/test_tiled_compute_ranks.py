"""Tiled compute under the engine: a small Llama whose MLPs run through TiledMLP (patched in the tutorial's way) and
whose head and loss run through TiledFusedLogitsLoss trains like the untiled model in one process.

Two ranks, each with its own sequence, at ZeRO stages 0-3 (stage 3 gathers the MLP and head weights through their
modules' hooks when the pieces run again in backward; once with Hugging Face's gradient checkpointing around the
layers too), and under Ulysses sequence parallelism (sp=2, the whole sequence's loss by sequence_parallel_loss).
SGD (a mis-scaled gradient shows), fp32, parameters within 1e-5 of one process after three steps; every parameter's
gradient is accumulated once per backward (a post-accumulate-grad hook counts); shards_for agrees over the ranks.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import zeroengine
from zeroengine.sequence_parallel import (
    TiledFusedLogitsLoss,
    TiledMLP,
    UlyssesSPAttentionHF,
    parallel_state,
    sequence_parallel_loss,
    shards_for,
    shift_labels,
)
from zeroengine.testing import run_distributed

pytest.importorskip("transformers")

SEQ, VOCAB, HIDDEN, STEPS, LR = 16, 96, 32, 3, 0.05
MLP_SHARDS, LOSS_SHARDS = 3, 3  # uneven pieces: 16 tokens as 6, 5, 5 (MLP) and 6, 6, 4 (loss)


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def mlp(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def tiled_forward(self, x):
    return TiledMLP.apply(mlp, self, x, MLP_SHARDS, list(self.parameters()))


@contextlib.contextmanager
def tiled_mlps():
    """The tutorial's patch of LlamaMLP.forward, undone after."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaMLP.forward
    modeling_llama.LlamaMLP.forward = tiled_forward
    try:
        yield
    finally:
        modeling_llama.LlamaMLP.forward = original


def head_loss(lm, x, y):
    return F.cross_entropy(lm.lm_head(x).float(), y, ignore_index=-100, reduction="sum")


class TiledLoss(torch.nn.Module):
    """The model's mean loss over the good tokens of ``labels`` (already shifted), its head and cross-entropy
    through TiledFusedLogitsLoss: the summed loss of the pieces, divided by the token count afterwards."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids, labels):
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        total = TiledFusedLogitsLoss.apply(head_loss, self.lm, hidden, labels, None, LOSS_SHARDS,
                                           [self.lm.lm_head.weight], "sum")
        return total / (labels != -100).sum().clamp(min=1)


def sequences(count: int):
    """``count`` sequences per step; -100 labels on a prompt and at the end."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (count, SEQ), generator=g)
        labels = ids.clone()
        labels[:, :5] = -100
        labels[:, -2:] = -100
        out.append((ids, shift_labels(labels)))
    return out


def reference(dp: int):
    """One process, untiled: each step the mean over the dp sequences of their mean loss over good tokens."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    positions = torch.arange(SEQ).unsqueeze(0)
    for ids, labels in sequences(dp):
        opt.zero_grad()
        logits = model(input_ids=ids, position_ids=positions.expand(dp, SEQ)).logits
        losses = [F.cross_entropy(logits[i], labels[i], ignore_index=-100) for i in range(dp)]
        (sum(losses) / dp).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def config(stage: int, dp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": dp,
            "gradient_clipping": 0.0, "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 400, "stage3_param_persistence_threshold": 0}}


def count_accumulations(model):
    counts = {name: 0 for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def train(rank, world, stage, sp=1, checkpointing=False):
    with tiled_mlps():
        model = build()
        if checkpointing:
            model.gradient_checkpointing_enable()
        mpu = None
        if sp > 1:
            mpu = UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa",
                                                                  sequence_parallel_size=sp, micro_batch_size=1,
                                                                  seq_length=SEQ, seq_length_is_variable=False)
        try:
            dp = world // sp
            engine, *_ = zeroengine.initialize(model=TiledLoss(model), config=config(stage, dp), mpu=mpu)
            counts = count_accumulations(model)
            sp_rank = parallel_state.get_sequence_parallel_rank() if sp > 1 else 0
            dp_rank = engine.mesh.dp_rank
            piece = slice(sp_rank * SEQ // sp, (sp_rank + 1) * SEQ // sp)
            positions = torch.arange(SEQ).unsqueeze(0)[:, piece]
            for step, (ids, labels) in enumerate(sequences(dp)):
                labels_here = labels[dp_rank:dp_rank + 1, piece]
                loss = engine(ids[dp_rank:dp_rank + 1, piece], positions, labels_here)
                if sp > 1:
                    loss = sequence_parallel_loss(loss, labels_here, parallel_state.get_sequence_parallel_group())
                engine.backward(loss)
                engine.step()
                assert counts == {name: step + 1 for name in counts}, counts  # once per parameter and backward
            with zeroengine.zero.GatheredParameters(list(model.parameters())):
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            return {"state": state, "dp": dp, "shards": shards_for(SEQ + 40 * rank, HIDDEN)}
        finally:
            if sp > 1:
                UlyssesSPAttentionHF.unregister_from_transformers("sdpa")


def check(results):
    ref = reference(results[0]["dp"])
    for r in results:
        for k, v in ref.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-5, rtol=0, msg=k)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tiled_llama_trains_like_the_untiled_one_at_every_zero_stage(stage):
    results = run_distributed(train, 2, stage)
    check(results)
    assert [r["shards"] for r in results] == [2, 2]  # ceil(56 / 32) on rank 1, the maximum on both


def test_tiled_llama_with_gradient_checkpointing_at_stage_3():
    check(run_distributed(train, 2, 3, checkpointing=True))


def test_tiled_llama_under_ulysses_sequence_parallelism():
    check(run_distributed(train, 2, 2, sp=2))
