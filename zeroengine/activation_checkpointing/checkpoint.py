"""``checkpoint(function, *args)``: keep a segment's inputs, drop its activations, recompute them in backward.

How it works (a reentrant autograd function, as in DeepSpeed and Megatron):

* forward: run ``function`` under ``no_grad`` (so none of its intermediates are
  kept), record the RNG and autocast state, and keep only the tensor inputs,
  stored as the settings ask (whole; partitioned; on CPU; packed; see storage.py);
* backward: bring the inputs back, re-run ``function`` with grad enabled, the
  same RNG state (identical dropout masks) and the same autocast state, and
  backpropagate the incoming gradients through the recomputed graph. Parameter
  gradients accumulate into ``.grad`` through that inner backward; the input
  gradients are returned to the outer graph.

Arguments and results may be any nesting of tuples/lists/dicts holding tensors
and other values: tensors are flattened out (pytree) and passed through the
autograd function, everything else rides along unchanged.

A plain reentrant function has one well-known gap: if no tensor input requires
grad, its outputs do not either, and the parameters inside the segment silently
get no gradient. A zero-size tensor that requires grad is passed along with the
inputs, so the segment is always part of the graph.

Stage 3: the recompute calls the segment's modules again, so their forward
pre-hooks gather the parameters again and their post-hooks release them; the
gradient hooks registered by that recomputed forward re-gather them for the
inner backward. :func:`is_recomputing` tells such hooks that a forward is a
recompute (a prefetcher that records the forward's module order must not
record it twice). A segment may also use the parameters of the module it is
called from directly (``checkpoint(lambda h: h * self.scale, h)`` inside
``forward``); those are gathered by no hook in the recompute, and by then
their module's gradient may be complete and its parameters released. So
each :func:`register_recompute_context` provider is asked at the segment's
forward what to hold, and that is held around the recompute and the inner
backward (stage 3 re-gathers the enclosing modules' parameters).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import profile as _profile
from .config import current
from .rng import RNGState, replay
from .storage import Lease, stash

_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed segment is being recomputed in the backward pass."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _recomputing():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


# Providers called at each segment's forward; each returns None or a function that makes a context manager,
# entered around that segment's recompute and inner backward (a fresh one each time: a graph kept with
# retain_graph=True is backpropagated, and so recomputed, more than once).
_recompute_contexts: list[Callable[[], Callable[[], contextlib.AbstractContextManager] | None]] = []


def register_recompute_context(provider: Callable[[], Callable[[], contextlib.AbstractContextManager] | None]) -> None:
    """Call ``provider()`` at every checkpointed segment's forward (see the module docstring)."""
    _recompute_contexts.append(provider)


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    return [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


@contextlib.contextmanager
def _autocast(states: list[tuple[str, torch.dtype]]):
    """Exactly the forward's autocast state: its enabled devices on, the others off (an autocast active only
    around backward must not reach the recompute)."""
    enabled = dict(states)
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if device_type in enabled:
                stack.enter_context(torch.autocast(device_type, dtype=enabled[device_type]))
            elif torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


@dataclass
class _Segment:
    """The checkpointed call with its tensors taken out: ``rebuild(tensors)`` puts them back."""

    function: Callable
    name: str
    spec: Any
    leaves: list  # the flattened (args, kwargs), tensors replaced by None
    tensor_at: list[int]
    out_spec: Any = None
    out_leaves: list = field(default_factory=list)
    out_tensor_at: list[int] = field(default_factory=list)

    def call(self, tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, self.spec)
        return self.function(*args, **kwargs)

    def remember_outputs(self, outputs) -> list[torch.Tensor]:
        leaves, self.out_spec = tree_flatten(outputs)
        self.out_tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.out_leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        return [leaves[i] for i in self.out_tensor_at]

    def outputs_from(self, tensors):
        leaves = list(self.out_leaves)
        for i, t in zip(self.out_tensor_at, tensors):
            leaves[i] = t
        return tree_unflatten(leaves, self.out_spec)


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, segment: _Segment, _always_needs_grad, *tensors):
        settings = current()
        ctx.segment = segment
        ctx.rng = RNGState.capture(tensors)
        ctx.autocast = _autocast_state()
        ctx.held = [c for c in (provider() for provider in _recompute_contexts) if c is not None]
        with _profile.timed(segment.name, "forward", settings.profile, settings.synchronize_checkpoint_boundary):
            outputs = segment.call(tensors)
        out_tensors = segment.remember_outputs(outputs)
        # Keep the inputs, and nothing else, for the recompute.
        if settings.partitions == 1 and not settings.cpu_checkpointing and not settings.contiguous_memory_optimization:
            ctx.save_for_backward(*tensors)  # autograd then also catches in-place edits of a saved input
            ctx.saved_inputs = None
        else:
            ctx.lease = Lease()
            ctx.saved_inputs = [stash(t, settings, ctx.lease) for t in tensors]
        ctx.mark_non_differentiable(*[t for t in out_tensors if not (t.is_floating_point() or t.is_complex())])
        return tuple(out_tensors)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("zeroengine.checkpointing.checkpoint works with .backward() / engine.backward(), "
                               "not torch.autograd.grad()")
        settings = current()
        segment: _Segment = ctx.segment
        if getattr(ctx, "inputs_freed", False):
            raise RuntimeError("zeroengine.checkpointing: a second backward through a checkpointed segment whose "
                               "inputs were partitioned, moved to CPU or packed contiguously (they are freed after "
                               "the first backward, as in DeepSpeed): retain_graph=True needs these options off")
        if ctx.saved_inputs is None:
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        else:
            inputs = [s.restore() for s in ctx.saved_inputs]
        with contextlib.ExitStack() as held:
            for make_context in ctx.held:
                held.enter_context(make_context())
            with replay(ctx.rng), _autocast(ctx.autocast), torch.enable_grad(), _recomputing(), \
                    _profile.timed(segment.name, "recompute", settings.profile,
                                   settings.synchronize_checkpoint_boundary):
                outputs = segment.call(inputs)
            out_tensors = [x for x in tree_flatten(outputs)[0] if isinstance(x, torch.Tensor)]
            pairs = [(o, g) for o, g in zip(out_tensors, grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if ctx.saved_inputs is not None:
            # Stashed inputs are ours to free: the node lives on while the loss does (until the next forward
            # in a usual loop), and would hold them, and their arena slots, a step too long.
            ctx.saved_inputs, ctx.inputs_freed = [], True
            ctx.lease.give_back_now()
        return (None, None) + tuple(x.grad if x.requires_grad else None for x in inputs)


def _name_of(function) -> str:
    name = getattr(function, "_zeroengine_checkpoint_name", None)
    if name is not None:
        return name
    if isinstance(function, torch.nn.Module):
        return type(function).__name__
    return getattr(function, "__qualname__", type(function).__name__)


def checkpoint(function: Callable, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` keeping only its inputs; recompute it during backward.

    The result is ``function``'s result (any structure of tensors and other
    values). Without grad mode (evaluation) it is a plain call. Options are the
    process-wide ones set by :func:`zeroengine.checkpointing.configure`.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    segment = _Segment(function, _name_of(function), spec,
                       [None if isinstance(x, torch.Tensor) else x for x in leaves], tensor_at)
    always = torch.empty(0, requires_grad=True)
    out_tensors = CheckpointFunction.apply(segment, always, *[leaves[i] for i in tensor_at])
    return segment.outputs_from(out_tensors)
