"""Small pipeline models for the pipeline-parallel tests, their data, and the single-process reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from parity import ADAM_EPS

from zeroengine.pipe import LayerSpec, PipelineModule, TiedLayerSpec

VOCAB, HIDDEN, SEQ = 32, 16, 6


class Block(torch.nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MaskedBlock(Block):
    """Takes and returns (hidden, mask): a tuple between stages, with a tensor that needs no gradient."""

    def forward(self, inputs):
        x, mask = inputs
        return super().forward(x) * mask.unsqueeze(-1).to(x.dtype), mask


class EmbedWithMask(torch.nn.Embedding):
    def forward(self, tokens):
        return super().forward(tokens), tokens != 0


def lm_head(embedding: torch.nn.Embedding, x):
    """The tied embedding used as the output projection."""
    return x @ embedding.weight.t()


def drop_mask(inputs):
    return inputs[0]


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def layers(blocks: int = 6, tied: bool = True, masked: bool = False, hidden: int = HIDDEN) -> list:
    if masked:
        return [LayerSpec(EmbedWithMask, VOCAB, hidden)] + [LayerSpec(MaskedBlock, hidden) for _ in range(blocks)] + \
            [drop_mask, LayerSpec(torch.nn.LayerNorm, hidden), LayerSpec(torch.nn.Linear, hidden, VOCAB)]
    embed = TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, hidden) if tied else \
        LayerSpec(torch.nn.Embedding, VOCAB, hidden)
    head = TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, hidden, forward_fn=lm_head) if tied else \
        LayerSpec(torch.nn.Linear, hidden, VOCAB, bias=False)
    return [embed] + [LayerSpec(Block, hidden) for _ in range(blocks)] + [LayerSpec(torch.nn.LayerNorm, hidden), head]


def pipe_model(stages: int, **kwargs) -> PipelineModule:
    partition = kwargs.pop("partition_method", "type:Block")
    interval = kwargs.pop("activation_checkpoint_interval", 0)
    virtual = kwargs.pop("virtual_stages", 1)
    return PipelineModule(layers(**kwargs), num_stages=stages, loss_fn=lm_loss, seed_layers=True,
                          partition_method=partition, activation_checkpoint_interval=interval,
                          virtual_stages=virtual)


def batches(steps: int, micro_batches: int, dp: int, micro: int = 2, seed: int = 3, seq: int = SEQ):
    """batches[step][dp_rank] = the micro-batches (tokens, labels) of that replica; the same on every process."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(1, VOCAB, (dp, micro_batches, micro, seq), generator=g)
        x[..., -1] = 0  # a padding token, so the masked model's mask is not all ones
        y = torch.randint(VOCAB, (dp, micro_batches, micro, seq), generator=g)
        out.append([[(x[r, i], y[r, i]) for i in range(micro_batches)] for r in range(dp)])
    return out


def config(dp: int, micro_batches: int, stage: int = 1, clip: float = 1.0, schedule: str = "1f1b",
           dtype: str = "fp32", micro: int = 2) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro * micro_batches * dp, "gradient_clipping": clip, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": ADAM_EPS}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
        "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        "pipeline": {"schedule": schedule},
    }


def reference(steps: int, micro_batches: int, dp: int, clip: float = 1.0, model: PipelineModule | None = None,
              loss_fn=lm_loss, seq: int = SEQ, **model_kwargs):
    """(losses per step, final state_dict) of the same model (one stage) in one process over the same global
    batches, stepped by torch's AdamW on the mean loss of every replica's micro-batches."""
    model = model if model is not None else pipe_model(1, **model_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS)
    losses = []
    for per_rank in batches(steps, micro_batches, dp, seq=seq):
        opt.zero_grad()
        total = 0.0
        for replica in per_rank:
            for x, y in replica:
                loss = loss_fn(model(x), y)
                (loss / (micro_batches * dp)).backward()
                total += loss.item() / (micro_batches * dp)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- tensor parallel inside the stages (3D parallelism) -----------------------------------------------------------
from zeroengine.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


class TPBlock(torch.nn.Module):
    """Block with its MLP split Megatron's way: column-parallel up, row-parallel down (the tensor group of the
    mesh the PipelineModule was built on)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = ColumnParallelLinear(hidden, 2 * hidden)
        self.down = RowParallelLinear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TPEmbedding(VocabParallelEmbedding):
    def __init__(self, vocab: int, hidden: int):
        super().__init__(torch.nn.Embedding(vocab, hidden).weight, None)


def tp_head(embedding: TPEmbedding, x):
    return embedding.as_head(x)


def tp_lm_loss(logits, labels):
    return vocab_parallel_cross_entropy(logits.float(), labels)


def tp_layers(blocks: int = 4) -> list:
    return [TiedLayerSpec("embed", TPEmbedding, VOCAB, HIDDEN)] + [LayerSpec(TPBlock, HIDDEN) for _ in range(blocks)] \
        + [LayerSpec(torch.nn.LayerNorm, HIDDEN), TiedLayerSpec("embed", TPEmbedding, VOCAB, HIDDEN, forward_fn=tp_head)]


def tp_pipe_model(stages: int, tp: int) -> PipelineModule:
    from zeroengine.parallel import build_mesh

    return PipelineModule(tp_layers(), topology=build_mesh(pp=stages, tp=tp), loss_fn=tp_lm_loss, seed_layers=True,
                          partition_method="type:TPBlock")


def tp_reference(steps: int, micro_batches: int, dp: int, clip: float = 1.0):
    """The 3D model at one rank (tensor-parallel layers whole), against every replica's batch."""
    return reference(steps, micro_batches, dp, clip, model=tp_pipe_model(1, 1), loss_fn=tp_lm_loss)
