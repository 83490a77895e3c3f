"""Standard-MLP experts on CPU: exact-size per-expert GEMMs into views of one output, and weight
gradients written into a reused buffer.

Note: CPU expert cost. Measured on a 2-core AVX2 host (benchmarks/bench_moe.py, hidden 512,
ffn 2048, 4096 tokens) the expert layer lost to one dense MLP over the same rows for three
reasons, in order of size:

* fresh weight gradients: with ``zero_grad(set_to_none=True)`` every step allocates new
  gradients, and glibc serves any block over 32 MiB by a fresh ``mmap``: each 4 KiB page
  then faults in (about 3 us each here: 512 MiB of expert gradients at 64 experts cost
  ~0.4 s, as much as the whole dense floor). :class:`GradWorkspace` keeps the last
  gradient buffer and writes the next gradients into it when nothing else holds it any
  more (the previous ``.grad`` was dropped or already accumulated), so the pages stay
  mapped; autograd then adopts views of it as ``.grad`` without a copy;
* fresh activations: the same holds for the ``[rows, ffn]`` hidden activations (64 MiB each at
  top-2): the pre-activation and activation kept for backward come from the same workspace
  (free again once backward has run), and backward's one ``[rows, ffn]`` scratch (the
  activation's gradient, turned in place into the pre-activation's) is shared by all layers;
* padding: a padded ``bmm`` runs every expert at the largest batch (dropless routing at
  64 experts pads 4096 rows to ~5200); here each expert's GEMM covers exactly its rows,
  written into its slice of one output (no padding, no gather back);
* stacking: per-expert modules were stacked into ``[E, ...]`` copies every forward
  (another 512 MiB written, and faulted in, at 64 experts); here each expert's own
  weight is used in place.

* small-row GEMMs: at 64 experts each GEMM covers ~64-128 rows of a 4 MiB weight, and a BLAS
  packs that weight (read, write, read again) before any arithmetic; the C++ kernel runs such
  GEMMs with its own small-row kernels that read the weight once, in place, prefetched
  (``ops/csrc/moe/moe_small_gemm_cpu.cpp``; up to 256 rows, fp32, AVX2 + FMA, when each
  expert runs on one thread).

The workspace holds one gradient-sized buffer per weight and the two hidden activations
between steps (memory a caching allocator would hold too);
``experts.grad_workspace.enabled = False`` frees them and allocates afresh each step.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from zeroengine.ops.moe_dispatch import cpu_kernel as _kernel


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class GradWorkspace:
    """Buffers reused across steps (Note: CPU expert cost): ``get(name, shape, like)`` returns a
    contiguous ``shape`` tensor backed by the buffer kept under ``name`` when only this workspace
    still references that buffer's storage and it is large enough, else a new buffer (which it then
    keeps). It never hands out memory someone else can still see. Used for the weight gradients
    (adopted by autograd as ``.grad``) and the hidden activations (saved for backward, then free)."""

    def __init__(self):
        self._buffers: dict[str, tuple[torch.Tensor, int]] = {}
        self.enabled = True

    def get(self, name: str, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            self._buffers.clear()
            return like.new_empty(shape)
        numel = math.prod(shape)
        kept = self._buffers.get(name)
        if kept is not None:
            buf, alone = kept
            if (buf.numel() >= numel and buf.dtype == like.dtype and buf.device == like.device
                    and _storage_refs(buf) == alone):
                return buf[:numel].view(shape)
        buf = like.new_empty(numel)
        self._buffers[name] = (buf, _storage_refs(buf))
        return buf.view(shape)

    def clear(self) -> None:
        self._buffers.clear()

    # Copies and pickles (deepcopy of a model, torch.save of a module) carry the setting, not the buffers.
    def __getstate__(self):
        return {"enabled": self.enabled}

    def __setstate__(self, state):
        self._buffers, self.enabled = {}, state["enabled"]


# Backward's [rows, ffn] scratch lives only during one expert layer's backward: one buffer serves
# every layer (a per-layer one would add a layer's worth of activation memory per layer).
_BACKWARD_SCRATCH = GradWorkspace()


def _act_into(act: nn.Module, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``act(h)`` written into ``out`` (``h`` itself for Identity)."""
    if isinstance(act, nn.GELU):
        return torch.ops.aten.gelu.out(h, approximate=act.approximate, out=out)
    if isinstance(act, nn.SiLU):
        return torch.ops.aten.silu.out(h, out=out)
    if isinstance(act, nn.ReLU):
        return torch.clamp(h, min=0, out=out)
    if isinstance(act, nn.Tanh):
        return torch.tanh(h, out=out)
    if isinstance(act, nn.Sigmoid):
        return torch.sigmoid(h, out=out)
    if isinstance(act, nn.Identity):
        return h
    raise TypeError(f"no forward for activation {type(act).__name__}")


def _act_backward_(act: nn.Module, grad: torch.Tensor, h: torch.Tensor | None, a: torch.Tensor) -> torch.Tensor:
    """``grad`` times d act(h) / dh, in place, from the saved pre-activation ``h`` or output ``a``."""
    if isinstance(act, nn.GELU):
        return torch.ops.aten.gelu_backward.grad_input(grad, h, approximate=act.approximate, grad_input=grad)
    if isinstance(act, nn.SiLU):
        return torch.ops.aten.silu_backward.grad_input(grad, h, grad_input=grad)
    if isinstance(act, nn.ReLU):
        return torch.ops.aten.threshold_backward.grad_input(grad, a, 0, grad_input=grad)
    if isinstance(act, nn.Tanh):
        return torch.ops.aten.tanh_backward.grad_input(grad, a, grad_input=grad)
    if isinstance(act, nn.Sigmoid):
        return torch.ops.aten.sigmoid_backward.grad_input(grad, a, grad_input=grad)
    if isinstance(act, nn.Identity):
        return grad
    raise TypeError(f"no backward for activation {type(act).__name__}")


_NEEDS_INPUT = (nn.GELU, nn.SiLU)  # activations whose backward reads h (the others read the output)


class _Weights:
    """One weight (or bias) of every local expert: a stacked ``[E, ...]`` tensor or ``E`` tensors."""

    def __init__(self, tensors: Sequence[torch.Tensor] | torch.Tensor | None):
        self.stacked = isinstance(tensors, torch.Tensor)
        self.tensors = [] if tensors is None else ([tensors] if self.stacked else list(tensors))

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.tensors[0][e] if self.stacked else self.tensors[e]

    def grads(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Views of the gradient buffer ``[E, ...]`` as this weight's gradient(s): fresh view objects,
        so autograd adopts them as ``.grad`` without copying."""
        return [buf.view(buf.shape)] if self.stacked else list(buf.unbind(0))


class _ExpertMLP(torch.autograd.Function):
    """``y[rows of e] = act(x[rows of e] @ w1[e].T + b1[e]) @ w2[e].T + b2[e]`` for every expert e."""

    @staticmethod
    def forward(ctx, x, meta, *params):
        counts, act, workspace, layout, impl = meta
        w1, b1, w2, b2 = _split(params, layout)
        kernel = _kernel(x, impl)
        shape = (x.shape[0], w1[0].shape[0])
        h = workspace.get("h", shape, x)
        rows_mm(x, w1, counts, b1, True, h, kernel)
        a = _act_into(act, h, workspace.get("a", shape, x) if not isinstance(act, nn.Identity) else None)
        y = x.new_empty(x.shape[0], w2[0].shape[0])
        rows_mm(a, w2, counts, b2, True, y, kernel)
        ctx.meta = meta
        ctx.save_for_backward(x, h if isinstance(act, _NEEDS_INPUT) else None, a, *params)
        return y

    @staticmethod
    def backward(ctx, gy):
        counts, act, workspace, layout, impl = ctx.meta
        x, h, a, *params = ctx.saved_tensors
        w1, b1, w2, b2 = _split(params, layout)
        kernel = _kernel(x, impl)
        gy = gy.contiguous()
        scratch = _BACKWARD_SCRATCH if workspace.enabled else workspace
        gh = scratch.get("g", a.shape, a)
        rows_mm(gy, w2, counts, None, False, gh, kernel)  # d loss / d a ...
        _act_backward_(act, gh, h, a)  # ... then d loss / d h, in place
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.empty_like(x)
            rows_mm(gh, w1, counts, None, False, gx, kernel)
        grads: list[torch.Tensor] = []
        for weight, bias, rows, cols, name in ((w1, b1, gh, x, "1"), (w2, b2, gy, a, "2")):
            gw = workspace.get("w" + name, (len(counts), *weight[0].shape), weight[0])
            gb = workspace.get("b" + name, (len(counts), *bias[0].shape), bias[0]) if bias else None
            weight_grad(rows, cols, counts, gw, gb, kernel)
            grads.append(weight.grads(gw))
            grads.append(bias.grads(gb) if bias else [])
        w1g, b1g, w2g, b2g = grads
        return (gx, None, *w1g, *b1g, *w2g, *b2g)


# -- the two grouped GEMMs: the C++ kernel (one parallel region), or this loop (the reference) -------
def rows_mm(a: torch.Tensor, w: _Weights, counts: Sequence[int], bias: _Weights, trans_w: bool,
            out: torch.Tensor, kernel=None) -> None:
    """``out[rows of e] = a[rows of e] @ (w[e].T if trans_w else w[e]) (+ bias[e])``."""
    num = len(counts)
    if kernel is not None:
        kernel.grouped_rows_mm(a, [w[e] for e in range(num)], list(counts),
                               [bias[e] for e in range(num)] if bias else [], trans_w, out)
        return
    for e, (s, n) in enumerate(_spans(counts)):
        if n:
            m = w[e].t() if trans_w else w[e]
            if bias:
                torch.addmm(bias[e], a[s:s + n], m, out=out[s:s + n])
            else:
                torch.mm(a[s:s + n], m, out=out[s:s + n])


def weight_grad(a: torch.Tensor, b: torch.Tensor, counts: Sequence[int], out: torch.Tensor,
                bias_out: torch.Tensor | None, kernel=None) -> None:
    """``out[e] = a[rows of e].T @ b[rows of e]``, ``bias_out[e] = a[rows of e].sum(0)`` (zeros for no rows)."""
    if kernel is not None:
        kernel.grouped_weight_grad(a, b, list(counts), out, bias_out)
        return
    for e, (s, n) in enumerate(_spans(counts)):
        if not n:
            out[e].zero_()
            if bias_out is not None:
                bias_out[e].zero_()
            continue
        torch.mm(a[s:s + n].t(), b[s:s + n], out=out[e])
        if bias_out is not None:
            torch.sum(a[s:s + n], 0, out=bias_out[e])


def _spans(counts: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for c in counts:
        out.append((start, c))
        start += c
    return out


def _split(params, layout) -> list[_Weights]:
    """The flat ``params`` of :func:`expert_mlp` back into w1, b1, w2, b2 (``layout``: per group,
    ``(stacked, count)``)."""
    groups, i = [], 0
    for stacked, size in layout:
        chunk = params[i:i + size]
        i += size
        groups.append(_Weights(None if not size else (chunk[0] if stacked else chunk)))
    return groups


def expert_mlp(x: torch.Tensor, counts: Sequence[int], w1, b1, act: nn.Module, w2, b2,
               workspace: GradWorkspace, impl: str = "auto") -> torch.Tensor:
    """Expert i's MLP on its ``counts[i]`` consecutive rows of ``x``. Each of ``w1, b1, w2, b2`` is
    a stacked ``[E, ...]`` tensor, a sequence of E per-expert tensors, or None (no bias). ``impl``:
    ``"auto"`` / ``"kernel"`` / ``"torch"`` as in :mod:`zeroengine.ops.moe_dispatch`."""
    groups = [[] if t is None else ([t] if isinstance(t, torch.Tensor) else list(t)) for t in (w1, b1, w2, b2)]
    layout = tuple((isinstance(t, torch.Tensor), len(g)) for t, g in zip((w1, b1, w2, b2), groups))
    meta = (tuple(int(c) for c in counts), act, workspace, layout, impl)
    return _ExpertMLP.apply(x.contiguous(), meta, *[t for g in groups for t in g])
