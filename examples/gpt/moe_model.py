"""The example GPT with Mixture-of-Experts feed-forward layers (every other block's MLP).

Each MoE layer holds ``num_experts`` copies of the block's MLP, ``num_experts /
ep_size`` on each rank, routed top-k by a learned gate. The training loss is
the language-model loss plus ``aux_loss_coef`` times the gates' load-balancing
losses. Initialisation does not depend on ``ep_size``: dense weights come from
the global RNG exactly as they would without experts, and expert g from a
seed of its own, so a 1-rank model holding every expert starts from the same
weights as any expert-parallel layout of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from model import GPT, MLP, Block, CausalSelfAttention, GPTConfig

from zeroengine.moe import MoE


@dataclass
class MoEConfig:
    num_experts: int = 4
    ep_size: int = 1
    k: int = 2
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    min_capacity: int = 4
    drop_tokens: bool = True
    noisy_gate_policy: str | None = None
    aux_loss_coef: float = 0.01
    every: int = 2  # an MoE layer in every `every`-th block
    expert_seed: int = 1000


class MoEBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, moe: MoEConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.moe = MoE(cfg.n_embd, MLP(cfg), num_experts=moe.num_experts, ep_size=moe.ep_size, k=moe.k,
                       capacity_factor=moe.capacity_factor, eval_capacity_factor=moe.eval_capacity_factor,
                       min_capacity=moe.min_capacity, noisy_gate_policy=moe.noisy_gate_policy,
                       drop_tokens=moe.drop_tokens)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, l_aux


class MoEGPT(nn.Module):
    def __init__(self, cfg: GPTConfig, moe: MoEConfig):
        super().__init__()
        self.config, self.moe_config = cfg, moe
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(MoEBlock(cfg, moe) if i % moe.every == moe.every - 1 else Block(cfg)
                                    for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        moes = [m for m in self.modules() if isinstance(m, MoE)]
        experts = {id(m) for layer in moes for e in layer.local_experts for m in e.modules()}
        for m in self.modules():
            if id(m) not in experts:
                GPT._init_weights(m)
        self._scale_residual_projections(self, skip=experts)
        for layer in moes:
            layer.init_experts(self._init_expert, seed=moe.expert_seed)

    def _scale_residual_projections(self, root: nn.Module, skip=frozenset()):
        # GPT-2's scaled init of the residual projections (as in model.GPT).
        for m in root.modules():
            if id(m) not in skip and isinstance(m, (MLP, CausalSelfAttention)):
                nn.init.normal_(m.proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def _init_expert(self, expert: nn.Module):
        expert.apply(GPT._init_weights)
        self._scale_residual_projections(expert)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        aux = torch.zeros((), device=idx.device)
        for block in self.blocks:
            if isinstance(block, MoEBlock):
                x, l_aux = block(x)
                aux = aux + l_aux
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        lm = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return lm + self.moe_config.aux_loss_coef * aux
