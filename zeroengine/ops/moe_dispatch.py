"""MoE token permutation: gather tokens into expert order, and scatter them back with a weighted combine.

Two differentiable ops over 2-d ``[rows, hidden]`` tensors, defined by the
pure-PyTorch references below and run by the C++ (CPU, OpenMP) or CUDA kernels
of ops/csrc/moe/ when those build:

* ``permute_tokens(x, index, rows)``: ``out[i] = x[index[i]]``. ``rows[t, j]``
  names the output row holding token t's j-th copy (-1: none); the backward is
  ``grad_x[t] = sum_j grad[rows[t, j]]``, i.e. an un-permutation with unit weights.
* ``unpermute_combine(y, rows, weights)``: ``out[t] = sum_j weights[t, j] * y[rows[t, j]]``,
  skipping ``rows[t, j] < 0`` (a dropped token). Each row of ``y`` must be named
  at most once. Gradients reach ``y`` and ``weights``.
* ``permute_tokens_split`` / ``unpermute_combine_segments``: the same with the permuted rows
  as one tensor per expert (``counts[e]`` rows each), for experts run one module at a time:
  the experts' inputs come out separate and their outputs go in separate, so neither the
  forward nor the backward concatenates (each concatenation was a full copy of the rows).

Accumulation is in fp32 (fp64 for double) whatever the storage dtype, and
``weights`` are fp32 (a router computes in fp32 under bf16/fp16).
``impl="auto"`` uses a kernel when one is available for the tensor's device and
dtype (else the reference, after one warning), ``"kernel"`` insists on it,
``"torch"`` never uses it.
"""
from __future__ import annotations

import torch

from zeroengine.ops.builder import load_kernel
from zeroengine.ops.op_builders import MoEDispatchBuilder, MoEDispatchCUDABuilder

__all__ = ["backend", "combine_rows_backward_reference", "combine_rows_reference", "cpu_kernel", "gather_rows_reference",
           "permute_tokens", "permute_tokens_split", "unpermute_combine", "unpermute_combine_segments"]

_IMPLS = ("auto", "kernel", "torch")
_KERNEL_DTYPES = {"cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
                  "cuda": (torch.float32, torch.bfloat16, torch.float16)}
_kernels: dict[str, object] = {}


# -- the definition: pure-PyTorch references ---------------------------------------------------------
def gather_rows_reference(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, index)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def combine_rows_reference(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    valid = rows >= 0
    w = valid.to(_acc_dtype(y.dtype)) if weights is None else weights.to(_acc_dtype(y.dtype)) * valid
    picked = y.index_select(0, rows.clamp(min=0).reshape(-1)).view(*rows.shape, y.shape[1])
    return (picked.to(w.dtype) * w.unsqueeze(-1)).sum(1).to(y.dtype)


def combine_rows_backward_reference(grad: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                                    weights: torch.Tensor | None, need_grad_y: bool = True,
                                    need_grad_w: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    acc = _acc_dtype(y.dtype)
    valid = rows >= 0
    grad_y = grad_w = None
    if need_grad_y:
        token = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1).expand_as(rows)[valid]
        scaled = grad.index_select(0, token).to(acc)
        if weights is not None:
            scaled = scaled * weights[valid].to(acc).unsqueeze(1)
        grad_y = torch.zeros_like(y).index_add_(0, rows[valid], scaled.to(y.dtype))
    if need_grad_w:
        picked = y.index_select(0, rows.clamp(min=0).reshape(-1)).view(*rows.shape, y.shape[1])
        grad_w = ((grad.to(acc).unsqueeze(1) * picked.to(acc)).sum(-1) * valid).float()
    return grad_y, grad_w


# -- kernel selection -------------------------------------------------------------------------------
def _kernel(t: torch.Tensor, impl: str):
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    device = t.device.type
    if impl == "torch" or t.dtype not in _KERNEL_DTYPES.get(device, ()):
        if impl == "kernel":
            raise ValueError(f"moe_dispatch has no kernel for {t.dtype} on {device}")
        return None
    if device not in _kernels:
        builder = MoEDispatchBuilder() if device == "cpu" else MoEDispatchCUDABuilder()
        _kernels[device] = load_kernel(builder, impl == "kernel", "moe_dispatch", "the PyTorch reference")
    if _kernels[device] is None and impl == "kernel":
        raise RuntimeError(f"moe_dispatch kernel unavailable on {device}")
    return _kernels[device]


def cpu_kernel(t: torch.Tensor, impl: str = "auto"):
    """The CPU extension (permutation, grouped expert GEMMs, fused gate) for ``t``'s dtype, or None where
    ``impl="auto"`` falls back to PyTorch (``"kernel"`` raises instead, ``"torch"`` always gives None)."""
    if t.device.type != "cpu":
        if impl == "kernel":
            raise ValueError("the moe_dispatch CPU kernels take CPU tensors")
        return None
    return _kernel(t, impl)


def backend(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """What ``impl="auto"`` runs for tensors of this device and dtype: ``"cpp"``, ``"cuda"`` or ``"torch"``."""
    probe = torch.empty(0, dtype=dtype, device=device)
    if _kernel(probe, "auto") is None:
        return "torch"
    return "cpp" if probe.device.type == "cpu" else "cuda"


def _check_range(index: torch.Tensor, lo: int, n: int, op: str) -> None:
    """Index checks for the CPU kernel, in Python: a C++ exception thrown out of an extension has been
    seen to crash some torch builds (2.11+cu130 with gcc 13) instead of raising. CUDA kernels skip
    out-of-range rows instead (a check there would synchronise the device)."""
    if index.device.type == "cpu" and index.numel():
        low, high = torch.aminmax(index)
        if int(low) < lo or int(high) >= n:
            raise RuntimeError(f"moe_dispatch.{op}: index out of range [0, {n})")


def _combine(y, rows, weights, impl):
    kernel = _kernel(y, impl)
    if kernel is None:
        return combine_rows_reference(y, rows, weights)
    _check_range(rows, -1, y.shape[0], "combine_rows")
    return kernel.combine_rows(y.contiguous(), rows, weights)


def _combine_backward(grad, y, rows, weights, need_grad_y, need_grad_w, covers_all, impl):
    kernel = _kernel(y, impl)
    if kernel is None:
        return combine_rows_backward_reference(grad, y, rows, weights, need_grad_y, need_grad_w)
    _check_range(rows, -1, y.shape[0], "combine_rows_backward")
    grad_y, grad_w = kernel.combine_rows_backward(grad.contiguous(), y.contiguous(), rows, weights, need_grad_y,
                                                  need_grad_w, not covers_all)
    return grad_y, grad_w


# -- autograd ---------------------------------------------------------------------------------------
class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, rows, impl):
        ctx.save_for_backward(rows)
        ctx.impl = impl
        kernel = _kernel(x, impl)
        if kernel is None:
            return gather_rows_reference(x, index)
        _check_range(index, 0, x.shape[0], "gather_rows")
        return kernel.gather_rows(x.contiguous(), index)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return _combine(grad.contiguous(), rows, None, ctx.impl), None, None, None


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows, weights, covers_all, impl):
        ctx.save_for_backward(y, rows, weights)
        ctx.covers_all, ctx.impl = covers_all, impl
        return _combine(y, rows, weights, impl)

    @staticmethod
    def backward(ctx, grad):
        y, rows, weights = ctx.saved_tensors
        need_y, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2] and weights is not None
        grad_y, grad_w = _combine_backward(grad.contiguous(), y, rows, weights, need_y, need_w, ctx.covers_all,
                                           ctx.impl)
        return grad_y, None, grad_w, None, None


def permute_tokens(x: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """``x[index]`` (rows of a 2-d tensor); ``rows`` is the inverse map used by the backward (see module doc)."""
    return _PermuteTokens.apply(x, index, rows, impl)


def unpermute_combine(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor | None = None,
                      covers_all: bool = False, impl: str = "auto") -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[rows[t, j]]`` (see module doc).

    ``covers_all=True`` promises every row of ``y`` is named once, so the
    backward need not zero ``grad_y`` first.
    """
    if weights is not None and weights.dtype != torch.float32:
        weights = weights.float()
    return _UnpermuteCombine.apply(y, rows, None if weights is None else weights.contiguous(), covers_all, impl)


# -- per-expert segments ----------------------------------------------------------------------------
class _PermuteSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, rows, counts, impl, checked):
        ctx.save_for_backward(rows)
        ctx.impl, ctx.checked = impl, checked
        kernel = _kernel(x, impl)
        if kernel is None:
            return tuple(gather_rows_reference(x, part) for part in index.split(counts))
        if not checked:
            _check_range(index, 0, x.shape[0], "gather_rows")
        return tuple(kernel.gather_rows_split(x.contiguous(), index, counts))

    @staticmethod
    def backward(ctx, *grads):
        (rows,) = ctx.saved_tensors
        grads = [g.contiguous() for g in grads]
        kernel = _kernel(grads[0], ctx.impl)
        if kernel is None:
            grad_x = combine_rows_reference(torch.cat(grads), rows, None)
        else:
            if not ctx.checked:
                _check_range(rows, -1, sum(g.shape[0] for g in grads), "combine_rows")
            grad_x = kernel.combine_segments(grads, rows, None)
        return grad_x, None, None, None, None, None


class _CombineSegments(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, covers_all, impl, checked, *ys):
        ys = tuple(y.contiguous() for y in ys)
        ctx.save_for_backward(rows, weights, *ys)
        ctx.covers_all, ctx.impl = covers_all, impl
        kernel = _kernel(ys[0], impl)
        if kernel is None:
            return combine_rows_reference(torch.cat(ys), rows, weights)
        if not checked:  # (backward reuses the same rows against the same row count)
            _check_range(rows, -1, sum(y.shape[0] for y in ys), "combine_rows")
        return kernel.combine_segments(list(ys), rows, weights)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, *ys = ctx.saved_tensors
        need_y = any(ctx.needs_input_grad[5:])
        need_w = ctx.needs_input_grad[1] and weights is not None
        kernel = _kernel(ys[0], ctx.impl)
        if kernel is None:
            grad_y, grad_w = combine_rows_backward_reference(grad, torch.cat(ys), rows, weights, need_y, need_w)
            grad_ys = grad_y.split([y.shape[0] for y in ys]) if need_y else [None] * len(ys)
        else:
            grad_w, *grad_ys = kernel.combine_segments_backward(grad.contiguous(), ys, rows, weights, need_y, need_w,
                                                               not ctx.covers_all)
            grad_ys = grad_ys if need_y else [None] * len(ys)
        return (None, grad_w if need_w else None, None, None, None, *grad_ys)


def _has_segment_kernels(t: torch.Tensor, impl: str) -> bool:
    """Whether the per-expert-segment entry points serve ``t``: the CPU op has them (no concatenation of the
    experts' rows), the CUDA op does not (a concatenation is one fast device copy there); with no kernel
    the segment autograd functions run the PyTorch reference."""
    kernel = _kernel(t, impl)
    return kernel is None or hasattr(kernel, "gather_rows_split")


def permute_tokens_split(x: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, counts: list[int],
                         impl: str = "auto", checked: bool = False) -> tuple[torch.Tensor, ...]:
    """:func:`permute_tokens` returned as one tensor per expert (``counts[e]`` consecutive rows each).
    ``checked=True`` skips the index range check (maps built by the fused gate kernel are in range)."""
    if not _has_segment_kernels(x, impl):  # (the CUDA op: one gather, split into views by autograd)
        return permute_tokens(x, index, rows, impl=impl).split(list(counts))
    return _PermuteSplit.apply(x, index, rows, list(counts), impl, checked)


def unpermute_combine_segments(ys, rows: torch.Tensor, weights: torch.Tensor | None = None,
                               covers_all: bool = False, impl: str = "auto", checked: bool = False) -> torch.Tensor:
    """:func:`unpermute_combine` of the concatenation of ``ys`` (rows index into it), without concatenating
    (``checked`` as in :func:`permute_tokens_split`)."""
    if not _has_segment_kernels(ys[0], impl):  # (the CUDA op: one combine of the concatenation)
        return unpermute_combine(torch.cat(list(ys)), rows, weights, covers_all=covers_all, impl=impl)
    if weights is not None and weights.dtype != torch.float32:
        weights = weights.float()
    return _CombineSegments.apply(rows, None if weights is None else weights.contiguous(), covers_all, impl,
                                  checked, *ys)
