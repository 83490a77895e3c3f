"""Grouped GEMMs for standard-MLP experts (Linear -> activation -> Linear): all local experts in two
matmul calls instead of two per expert.

Two representations feed the same compute (:func:`grouped_mlp`):

* ``"modules"`` (the default): experts stay one ``nn.Sequential`` each (names, tags,
  ZeRO and checkpoints unchanged); their weights are stacked on the fly each forward
  (one copy of the local expert weights; the backward of the stack hands each expert
  a view of the stacked gradient, no copy);
* ``"stacked"`` (:class:`GroupedMLPExperts`): the local experts' weights *are*
  ``[E_local, out, in]`` parameters (nn.Linear's layout with an expert dimension),
  so nothing is copied. One tag per stacked parameter names the first global expert
  and the count (see :mod:`zeroengine.moe.params`).

Note: grouped kernels. On CUDA, ``torch._grouped_mm`` takes the expert-contiguous
rows and the per-expert row offsets directly (no padding) where it supports the
dtype; elsewhere (CPU, or a dtype it refuses) the rows are padded to the largest
expert batch and run as one ``bmm`` per layer (no padding when the batches are
equal, e.g. full capacity). Padded rows are zeros in and are dropped on the way
out, so their gradient is zero and they add nothing to the weight gradients.
On CPU neither is used: :mod:`zeroengine.moe.grouped_cpu` runs exact-size per-expert
GEMMs into views of one output, on the experts' own weights (no stacking copy), and
reuses the weight-gradient buffers (Note: CPU expert cost there).
Measured in benchmarks/bench_moe.py and docs/moe.md.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from .grouped_cpu import GradWorkspace, expert_mlp
from .params import tag_stacked_expert_params

# Elementwise activations the grouped path may apply to [E, rows, ffn] as well as to [rows, ffn].
_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)
_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


@dataclass(frozen=True)
class MLPSpec:
    """The shape of a standard-MLP expert."""

    hidden: int
    ffn: int
    out: int
    bias1: bool
    bias2: bool


def has_hooks(module: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
               or getattr(m, "_backward_pre_hooks", None) for m in module.modules())


def mlp_spec(expert: nn.Module) -> MLPSpec | None:
    """The spec if ``expert`` is exactly ``nn.Sequential(nn.Linear, <elementwise activation>, nn.Linear)``
    with no hooks (subclasses could override forward, so types must match exactly); else None."""
    if type(expert) is not nn.Sequential or len(expert) != 3:
        return None
    l1, act, l2 = expert
    if type(l1) is not nn.Linear or type(l2) is not nn.Linear or type(act) not in _ACTIVATIONS:
        return None
    if l1.out_features != l2.in_features or has_hooks(expert):
        return None
    return MLPSpec(l1.in_features, l1.out_features, l2.out_features, l1.bias is not None, l2.bias is not None)


# -- the compute ------------------------------------------------------------------------------------
def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs this device/dtype here (probed once with a tiny call)."""
    if x.device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    # 16-byte aligned strides are required: inner dims must be multiples of 16 bytes.
    if (x.shape[1] * x.element_size()) % 16 or (w.shape[2] * w.element_size()) % 16:
        return False
    key = (str(x.device), x.dtype)
    if key not in _GROUPED_MM_OK:
        try:
            a = torch.zeros(8, 8, device=x.device, dtype=x.dtype)
            b = torch.zeros(2, 8, 8, device=x.device, dtype=x.dtype).transpose(1, 2)
            torch._grouped_mm(a, b, offs=torch.tensor([4, 8], device=x.device, dtype=torch.int32))
            _GROUPED_MM_OK[key] = True
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM_OK[key] = False
    return _GROUPED_MM_OK[key]


class ExpertRows:
    """Per-row expert ids, offsets and padding slots of an expert-contiguous batch (counts: host ints)."""

    def __init__(self, counts: Sequence[int], device: torch.device):
        self.counts = list(counts)
        self.num = len(self.counts)
        self.total = sum(self.counts)
        self.width = max(self.counts, default=0)  # padded rows per expert
        self.equal = all(c == self.width for c in self.counts)
        self.device = device

    def offsets(self) -> torch.Tensor:
        ends, acc = [], 0
        for c in self.counts:
            acc += c
            ends.append(acc)
        return torch.tensor(ends, dtype=torch.int32).to(self.device, non_blocking=True)

    def expert_of_row(self) -> torch.Tensor:
        counts = torch.tensor(self.counts).to(self.device, non_blocking=True)
        return torch.repeat_interleave(torch.arange(self.num, device=self.device), counts, output_size=self.total)

    def slots(self) -> torch.Tensor:
        """Row r of expert e at position p goes to padded slot ``e * width + p``."""
        shift, start = [], 0
        for e, c in enumerate(self.counts):
            shift.append(e * self.width - start)
            start += c
        shift_t = torch.tensor(shift).to(self.device, non_blocking=True)
        counts = torch.tensor(self.counts).to(self.device, non_blocking=True)
        return torch.arange(self.total, device=self.device) + torch.repeat_interleave(shift_t, counts,
                                                                                         output_size=self.total)


def grouped_mlp(x: torch.Tensor, counts: Sequence[int], w1: torch.Tensor, b1: torch.Tensor | None,
                act: nn.Module, w2: torch.Tensor, b2: torch.Tensor | None,
                workspace: GradWorkspace | None = None) -> torch.Tensor:
    """Expert i's MLP on the ``counts[i]`` consecutive rows of ``x`` that are its batch, all experts at once.

    ``w1 [E, ffn, hidden]``, ``b1 [E, ffn]``, ``w2 [E, out, ffn]``, ``b2 [E, out]`` (nn.Linear's layout,
    stacked); returns ``[rows, out]`` in the order of ``x`` (Note: grouped kernels). ``workspace``
    keeps CPU weight-gradient buffers across calls (a fresh one when None).
    """
    if x.device.type == "cpu":
        return expert_mlp(x, counts, w1, b1, act, w2, b2, workspace or GradWorkspace())
    rows = ExpertRows(counts, x.device)
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)  # [E, in, out] views, no copy
    # No rows at all: the bmm path on [E, 0, in] still gives every parameter (and x) a zero gradient.
    # An empty expert also goes there: _grouped_mm's weight gradient for an empty group did not match
    # the loop's zeros in a CUDA fp32 test (torch 2.11, H100), so it is used only when no batch is empty.
    if min(rows.counts, default=0) > 0 and grouped_mm_supported(x, w1t) and grouped_mm_supported(x.new_empty(0, w1t.shape[2]), w2t):
        offs = rows.offsets()
        index = rows.expert_of_row() if b1 is not None or b2 is not None else None
        h = torch._grouped_mm(x, w1t, offs=offs)
        if b1 is not None:
            h = h + b1.index_select(0, index)
        y = torch._grouped_mm(act(h), w2t, offs=offs)
        if b2 is not None:
            y = y + b2.index_select(0, index)
        return y
    if rows.equal:
        xs, slots = x.view(rows.num, rows.width, x.shape[1]), None
    else:
        slots = rows.slots()
        xs = x.new_zeros(rows.num * rows.width, x.shape[1]).index_copy(0, slots, x).view(rows.num, rows.width, x.shape[1])
    h = torch.bmm(xs, w1t) if b1 is None else torch.baddbmm(b1.unsqueeze(1), xs, w1t)
    h = act(h)
    y = torch.bmm(h, w2t) if b2 is None else torch.baddbmm(b2.unsqueeze(1), h, w2t)
    y = y.view(rows.num * rows.width, y.shape[-1])
    return y if slots is None else y.index_select(0, slots)


def grouped_mlp_modules(experts: Sequence[nn.Sequential], x: torch.Tensor, counts: Sequence[int],
                        spec: MLPSpec, workspace: GradWorkspace | None = None) -> torch.Tensor:
    """:func:`grouped_mlp` over per-expert modules: on CPU on their own weights, elsewhere on
    weights stacked on the fly."""
    if x.device.type == "cpu":
        return expert_mlp(x, counts, [e[0].weight for e in experts],
                          [e[0].bias for e in experts] if spec.bias1 else None, experts[0][1],
                          [e[2].weight for e in experts], [e[2].bias for e in experts] if spec.bias2 else None,
                          workspace or GradWorkspace())
    w1 = torch.stack([e[0].weight for e in experts])
    w2 = torch.stack([e[2].weight for e in experts])
    b1 = torch.stack([e[0].bias for e in experts]) if spec.bias1 else None
    b2 = torch.stack([e[2].bias for e in experts]) if spec.bias2 else None
    return grouped_mlp(x, counts, w1, b1, experts[0][1], w2, b2)


# -- the stacked representation ---------------------------------------------------------------------
class RowExperts:
    """Local experts that run all their rows in one call: ``run_rows(x, counts)``, ``x`` holding
    ``counts[i]`` consecutive rows for expert i (the dispatchers' interface to stacked experts)."""

    def run_rows(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError


class GroupedMLPExperts(nn.Module, RowExperts):
    """The local experts of an MoE layer as stacked parameters: ``w1 [E, ffn, hidden]``, ``b1 [E, ffn]``,
    ``w2 [E, out, ffn]``, ``b2 [E, out]`` (expert i's slice is its nn.Linear weight/bias).

    Built from a standard-MLP template (every expert starts as a copy of it, as with per-expert
    modules). ``expert_module(i)`` returns a standalone copy of expert i as the template's type,
    ``load_expert(i, module)`` copies a module's weights into slot i.
    """

    def __init__(self, template: nn.Module, global_ids: Sequence[int], ep_size: int):
        super().__init__()
        spec = mlp_spec(template)
        if spec is None:
            raise ValueError("stacked experts need an nn.Sequential(nn.Linear, activation, nn.Linear) expert; "
                             f"got {type(template).__name__}")
        self.spec, self.global_ids, self.num = spec, list(global_ids), len(global_ids)
        self._template = [copy.deepcopy(template)]  # a list: not a submodule (no parameters of its own)
        l1, act, l2 = template

        def stacked(t: torch.Tensor | None) -> nn.Parameter | None:
            return None if t is None else nn.Parameter(t.detach().unsqueeze(0).repeat(self.num, *[1] * t.dim()))

        self.w1, self.b1 = stacked(l1.weight), stacked(l1.bias)
        self.activation = copy.deepcopy(act)
        self.w2, self.b2 = stacked(l2.weight), stacked(l2.bias)
        tag_stacked_expert_params(self, ep_size, self.global_ids[0], self.num)
        self.grad_workspace = GradWorkspace()

    def __len__(self) -> int:
        return self.num

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        return grouped_mlp(x, counts, self.w1, self.b1, self.activation, self.w2, self.b2, self.grad_workspace)

    def run_rows(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        return self(x, counts)

    def expert_module(self, i: int) -> nn.Sequential:
        m = copy.deepcopy(self._template[0]).to(device=self.w1.device, dtype=self.w1.dtype)
        with torch.no_grad():
            for dst, src in self._pairs(m):
                dst.copy_(src[i])
        return m

    def load_expert(self, i: int, module: nn.Module) -> None:
        with torch.no_grad():
            for src, dst in self._pairs(module):
                dst[i].copy_(src)

    def _pairs(self, m: nn.Module):
        pairs = [(m[0].weight, self.w1), (m[2].weight, self.w2)]
        if self.b1 is not None:
            pairs.append((m[0].bias, self.b1))
        if self.b2 is not None:
            pairs.append((m[2].bias, self.b2))
        return pairs
