"""Many small expert modules: run them, forward and backward, with one intra-op thread.

Note: small experts and threads. Each op of an expert over a small batch (at 64 experts and
4096 tokens, top-1: ~64 rows) is a parallel region of its own as soon as it reaches torch's
grain size (32768 elements), so 64 experts make ~200 regions per step, each waking the other
threads and waiting for all of them at its end. On an idle host that pays: measured on a
2-core host (benchmarks/bench_moe.py, overhead rows, 64 experts top-1) the threaded layer
is ~6-16% faster than one run with one thread per op. On an oversubscribed host it does not:
a region waits for a thread the scheduler parked, and the same 64 cheap experts went from
~7 ms to 0.3-1 s per step, against ~15-30 ms single-threaded. So the choice is the user's:
with ``ExpertList.serial_below = n`` (elements; off by default, 0), experts whose mean batch
holds fewer than ``n`` elements run under ``torch.set_num_threads(1)``, restored after, when
some batch is large enough for torch to thread an op at all (``PARALLEL_FROM``). Backward
gets the same through :class:`_SerialExperts`, one autograd Function for the whole group:
its forward records the experts' graph on detached inputs, its backward runs the autograd
engine over that graph with one thread and returns the gradients of the inputs and of the
expert parameters (passed in as inputs, so autograd accumulates them as usual, hooks and
``torch.autograd.grad`` callers included); the node itself costs ~20 us per expert.
Results equal the threaded run up to summation order inside reductions. Limits, as with
reentrant checkpointing: no double backward through the experts, and a second backward
through the same graph (``retain_graph=True``) is refused.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn

SERIAL_BELOW = 0  # off by default (Note: small experts and threads); 1 << 16 is a useful setting
# torch parallelises an op from 32768 elements; an expert's intermediates are often ~4x its input
PARALLEL_FROM = 1 << 13
_ENGINE = torch.autograd.Variable._execution_engine


def expert_output(out):
    """An expert's output tensor. Megatron-style experts return ``(output, bias)``: as DeepSpeed's MoE does,
    the first element is the output and the bias is left out."""
    return out[0] if isinstance(out, (tuple, list)) else out


def call_expert(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return expert_output(expert(x))


@contextmanager
def intra_op_threads(n: int):
    """``torch.set_num_threads(n)`` inside the block (when it lowers the count), restored after."""
    old = torch.get_num_threads()
    if n >= old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def wants_serial(chunks: Sequence[torch.Tensor], serial_below: int) -> bool:
    """Whether threads are in use, the experts' mean batch (elements) is below ``serial_below``, and some
    batch is large enough that torch would run an expert's ops multi-threaded (else the group node only
    adds its own cost, ~20 us per expert)."""
    if not serial_below or not chunks or torch.get_num_threads() == 1:
        return False
    sizes = [c.numel() for c in chunks]
    return sum(sizes) < serial_below * len(sizes) and max(sizes) >= PARALLEL_FROM


def run_expert_modules(experts: Sequence[nn.Module], chunks: Sequence[torch.Tensor],
                       serial_below: int = SERIAL_BELOW) -> list[torch.Tensor]:
    """``[expert_i(chunk_i)]``, single-threaded forward and backward when the batches are small
    (Note: small experts and threads)."""
    if not wants_serial(chunks, serial_below):
        return [call_expert(expert, chunk) for expert, chunk in zip(experts, chunks)]
    owner = experts if isinstance(experts, nn.Module) else nn.ModuleList(experts)
    params = [p for p in owner.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (params or any(c.requires_grad for c in chunks)):
        with intra_op_threads(1):
            return [call_expert(expert, chunk) for expert, chunk in zip(experts, chunks)]
    return list(_SerialExperts.apply(tuple(experts), len(chunks), *chunks, *params))


class _SerialExperts(torch.autograd.Function):
    """The experts of a group as one node: inputs ``(*chunks, *params)``, outputs one tensor per expert."""

    @staticmethod
    def forward(ctx, experts, n, *tensors):
        chunks, params = tensors[:n], tensors[n:]
        ins = [c.detach().requires_grad_(c.requires_grad) for c in chunks]
        with torch.enable_grad(), intra_op_threads(1):
            outs = [call_expert(expert, i) for expert, i in zip(experts, ins)]
        ctx.graph = (ins, outs, params)
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.graph is None:
            raise RuntimeError("MoE experts run as one group (zeroengine.moe.expert_group) support one backward "
                               "per forward; a second backward through the same graph (retain_graph=True) is "
                               "not supported. Set experts.serial_below = 0 to run them one module at a time")
        ins, outs, params = ctx.graph
        ctx.graph = None
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        wrt = [t for t in (*ins, *params) if t.requires_grad]
        found = [None] * len(wrt)
        if pairs and wrt:
            with intra_op_threads(1):
                # torch.autograd.grad minus its per-tensor checks of the gradients' shapes (~10 us per expert;
                # these gradients come from the combine's backward, shaped like the outputs by construction)
                found = _ENGINE.run_backward(tuple(o for o, _ in pairs), tuple(g for _, g in pairs), False, False,
                                             tuple(wrt), True, False)
        by_id = {id(t): g for t, g in zip(wrt, found)}
        grad_in = [by_id.get(id(i)) if i.requires_grad else None for i in ins]
        grad_params = [by_id.get(id(p)) for p in params]
        return (None, None, *grad_in, *grad_params)
