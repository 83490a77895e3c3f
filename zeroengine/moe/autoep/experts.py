"""The expert-parallel stand-in for a Hugging Face experts module (fused ``gate_up_proj`` / ``down_proj``).

transformers (5.x) holds every MoE family's routed experts in one module with
two stacked parameters, ``gate_up_proj [E, 2I, H]`` (each expert's gate rows,
then its up rows) and ``down_proj [E, H, I]``, and calls it as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``. Expert e
computes ``down_proj[e] @ (act(gate) * up)``; the outputs are added up with the
router's weights. :class:`ShardedExperts` takes that module's place with the
same call and the same parameter names, so:

* the block around it, and its router, run unchanged: the model's own scores
  (softmax or sigmoid, grouped top-k, normalisation, scaling, correction bias),
  shared experts and the router-logit capture its auxiliary loss is built from;
* the state_dict keys stay the model's (``...mlp.experts.gate_up_proj``), each
  rank holding experts ``[first, first + count)`` of them, and a checkpoint
  stores them at their global place (:mod:`zeroengine.moe.checkpoint_places`);
* the parameter objects are the original ones, narrowed in place: an optimizer
  built on the model before the conversion still holds them.

Tokens travel with the all-to-all dispatcher of :class:`zeroengine.moe.MoE`
(uneven splits, no capacity: dropless), and the local experts run as grouped
GEMMs (``torch._grouped_mm`` where it runs, one GEMM pair per expert elsewhere).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..dispatch import AllToAllDispatch, DispatchPlan, LocalDispatch
from ..grouped import ExpertRows, RowExperts, grouped_mm_supported
from ..groups import expert_groups
from ..params import tag_stacked_expert_params
from ..routing import GateOutput

FUSED_NAMES = ("gate_up_proj", "down_proj")


class ShardedExperts(nn.Module, RowExperts):
    """Experts ``[first, first + count)`` of a fused experts module, over an expert-parallel group of ``ep_size``."""

    def __init__(self, original: nn.Module, ep_size: int, impl: str = "auto", grouped_mm: bool = True):
        super().__init__()
        gate_up, down = (getattr(original, name) for name in FUSED_NAMES)
        self.num_experts, two_inter, self.hidden_dim = gate_up.shape
        self.intermediate_dim = two_inter // 2
        self.groups = expert_groups(ep_size)
        self.ep_size = ep_size
        self.count = self.num_experts // ep_size
        self.first = self.groups.ep_rank * self.count
        for name in FUSED_NAMES:  # the same Parameter objects, holding this rank's experts only
            param = getattr(original, name)
            param.data = param.data[self.first:self.first + self.count].clone()
            self.register_parameter(name, param)
        self.act_fn = original.act_fn
        self.impl = impl
        self.grouped_mm = grouped_mm
        tag_stacked_expert_params(self, ep_size, self.first, self.count)
        self._dispatch = LocalDispatch() if ep_size == 1 else AllToAllDispatch(self.groups, self.count)

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.count - 1} of {self.num_experts}, ep_size={self.ep_size}, "
                f"hidden={self.hidden_dim}, intermediate={self.intermediate_dim}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # An index of num_experts is transformers' "no expert" (skipped by its own loop): not routed here.
        routing = GateOutput.from_choices(top_k_index, top_k_weights, self.num_experts,
                                          routed=top_k_index < self.num_experts)
        out = self._dispatch(hidden_states, DispatchPlan.from_gate(routing), self, impl=self.impl)
        return out.to(hidden_states.dtype)

    def run_rows(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """The local experts on their rows: ``x`` holds ``counts[i]`` consecutive rows for local expert i."""
        return swiglu_rows(x, counts, self.gate_up_proj, self.down_proj, self.act_fn, self.grouped_mm)


def swiglu_rows(x: torch.Tensor, counts: Sequence[int], gate_up: torch.Tensor, down: torch.Tensor, act,
                grouped_mm: bool = True) -> torch.Tensor:
    """Expert i's ``down[i] @ (act(gate) * up)`` with ``gate, up = gate_up[i] @ x_i`` on its ``counts[i]`` rows.

    One ``torch._grouped_mm`` per projection on CUDA when every expert has rows (an empty group's weight
    gradient is not trusted there, see :mod:`zeroengine.moe.grouped`); otherwise one GEMM pair per expert,
    on every expert (even with no rows, so every expert's weights get a gradient on every rank)."""
    counts = list(counts)
    gate_up_t, down_t = gate_up.transpose(1, 2), down.transpose(1, 2)  # [E, in, out] views
    if (grouped_mm and x.device.type == "cuda" and min(counts, default=0) > 0
            and grouped_mm_supported(x, gate_up_t) and grouped_mm_supported(x.new_empty(0, down_t.shape[1]), down_t)):
        offs = ExpertRows(counts, x.device).offsets()
        gate, up = torch._grouped_mm(x, gate_up_t, offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(act(gate) * up, down_t, offs=offs)
    # unbind, not gate_up[i]: one backward node stacks the experts' weight gradients once, where indexing
    # would make every expert's backward write a zero-filled gradient of the whole stacked parameter (64
    # experts at FastMoE's CPU shape: 20 s a step instead of about 1)
    outputs = []
    for rows, w1, w2 in zip(x.split(counts), gate_up.unbind(0), down.unbind(0)):
        gate, up = F.linear(rows, w1).chunk(2, dim=-1)
        outputs.append(F.linear(act(gate) * up, w2))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
