"""Tiled compute for long sequences (the second piece of Arctic Long Sequence Training, DeepSpeed 0.19's API).

A per-token computation (an MLP, the LM head and its loss, any function of pieces of the sequence) runs one piece
of the sequence at a time, so its intermediate tensors (the MLP's activations, the logits) exist for one piece
only. Each op's forward runs ``fn`` on the pieces under ``no_grad`` and keeps nothing but its inputs; its backward
runs ``fn`` again, one piece at a time with gradients on, and backpropagates that piece's part of the gradient
that arrived. :class:`TiledMLP`, :func:`sequence_tiled_compute` (:class:`SequenceTiledCompute`) and
:class:`TiledFusedLogitsLoss` are DeepSpeed's names and signatures; :func:`shards_for` is the tutorial's shard
count, agreed over a group.

Note: exact under any upstream gradient.
DeepSpeed's TiledFusedLogitsLoss runs the LM head's backward inside its forward with an assumed upstream gradient
of 1 (1/shards for "mean"), and its backward scales only x's gradient by the real one, so the head's gradient is
that of an unscaled loss: a caller that scales the loss afterwards (gradient accumulation's 1/N, fp16 loss
scaling, the good-token weighting of :func:`.loss.sequence_parallel_loss`, a division by a token count) gets head
gradients off by that factor. Here every op differentiates in its backward, with the gradient that arrived, so
its gradients are the untiled computation's whatever the caller does with the output (the cost is measured in
:class:`TiledFusedLogitsLoss`'s docstring).

Note: a parameter's gradient arrives once.
Each piece's backward computes gradients with ``torch.autograd.grad`` (nothing reaches ``.grad`` on the way) and
the op sums them, so a parameter every piece uses is accumulated, and its post-accumulate-grad hooks (ZeRO's
gradient stores) fire, once per backward of the op, as for any other op. How the sum reaches the parameter:

* those of ``compute_params`` that hold their values when the op is applied are inputs of the autograd Function:
  its backward returns their sums and autograd accumulates them, as it does for any op's inputs;
* any other parameter ``fn`` uses (``compute_params=None``, one not listed) is found in the recomputed graph, and
  its sum is handed to its gradient accumulator by one ``torch.autograd.backward`` at the end of the op's
  backward. So is a ZeRO-3 parameter partitioned when the op is applied: its tensor is then an empty placeholder,
  and autograd, given it as an input, would record that empty shape and refuse the real gradient. Stage 3
  gathers it through its module's hooks when ``fn`` runs the module again in backward, and keeps it until its
  gradient has arrived (a bucket's parameters are released once all its gradients exist).

Parameters reached the second way get their gradient in ``.grad`` even under ``torch.autograd.grad`` (as with
reentrant activation checkpointing and DeepSpeed's ops); list them in ``compute_params`` for that use (outside
ZeRO-3). The tensors ``fn`` differentiates must be its arguments or parameters: a tensor it captures from the
surrounding graph would be backpropagated into from here, outside the caller's backward.

Note: shard counts under ZeRO-3.
Stage 3 gathers a module's parameters each time it runs (a collective), so every rank must run ``fn`` as often.
TiledMLP runs it exactly ``shards`` times (pieces as even as can be: a rank with a shorter sequence runs shorter,
perhaps empty, pieces), so ranks need only agree on ``shards``; :func:`shards_for` gives the tutorial's
``ceil(seqlen / hidden)`` as its maximum over a group. The other two ops cut DeepSpeed's way (steps of
``ceil(seqlen / shards)``, so fewer pieces where the step overshoots: 9 in 4 gives 3, 3, 3) and need the same
sequence length on every rank as well, as Ulysses gives every rank of a sequence group.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable
from torch.autograd.graph import GradientEdge

from zeroengine import comm

_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad


def shards_for(seqlen: int, hidden: int, group=None) -> int:
    """TiledMLP's shard count for a local sequence of ``seqlen`` tokens: ``ceil(seqlen / hidden)`` (the tutorial's
    rule: each piece's MLP activations then weigh about as much as the hidden states), the maximum over ``group``
    (default: the world) so that every rank runs as many pieces (see "shard counts under ZeRO-3"). Collective when
    the group has more than one rank."""
    count = max(1, math.ceil(seqlen / hidden))
    if comm.get_world_size(group) > 1:
        count = int(comm.all_reduce_scalar(count, op=comm.ReduceOp.MAX, group=group))
    return count


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, self, x, shards, compute_params=None)``: ``fn(self, x_piece)`` on ``shards`` pieces of
    ``x`` (``[batch, seq, hidden]`` or ``[seq, hidden]``) along the sequence, concatenated; the MLP's intermediate
    activations exist for one piece at a time, in forward and again in backward (which runs ``fn`` once more).
    ``fn`` must treat tokens independently (an MLP does). ``compute_params``: the parameters ``fn`` uses (see
    "a parameter's gradient arrives once"; ``None`` works too). The tutorial's way, for Llama::

        from transformers.models.llama import modeling_llama

        def tiled_forward(self, x):
            def mlp(self, x):
                return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            shards = shards_for(x.shape[-2], x.shape[-1])
            return TiledMLP.apply(mlp, self, x, shards, [p for p in self.parameters()])

        modeling_llama.LlamaMLP.forward = tiled_forward
    """

    @classmethod
    def apply(cls, fn, self, x, shards, compute_params=None):
        _check_shards(shards, "TiledMLP")
        params = _Parameters(compute_params, [x])
        return super().apply(fn, self, x, shards, params, *params.tensors())

    @staticmethod
    def forward(ctx, fn, self, x, shards, params, *param_tensors):
        ctx.fn, ctx.module, ctx.params = fn, self, params
        ctx.pieces = _even_pieces(x.shape[-2], shards)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(self, x.narrow(-2, start, size)) for start, size in ctx.pieces], dim=-2)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        sums = _GradientSums(ctx.params.inputs)
        x_grad = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        for start, size in ctx.pieces:
            piece = x.narrow(-2, start, size).detach().requires_grad_(x_grad is not None)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, piece)
            grads = sums.backprop(out, grad.narrow(-2, start, size), [piece] if x_grad is not None else [])
            if x_grad is not None:
                _put(x_grad.narrow(-2, start, size), grads[0])
        return (None, None, x_grad, None, None, *ctx.params.gradients(sums.finish()))


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd Function behind :func:`sequence_tiled_compute`, with DeepSpeed's positional arguments:
    ``SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
    compute_params, output_unshard_dimension, output_reduction, *values_to_shard, *values_to_pass)``."""

    @classmethod
    def apply(cls, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
              output_unshard_dimension, output_reduction, *args):
        _check_shards(shards, "sequence_tiled_compute")
        keys_to_shard, keys_to_pass = list(keys_to_shard), list(keys_to_pass)
        if output_reduction not in (None, "mean", "sum"):
            raise ValueError(f"sequence_tiled_compute: output_reduction={output_reduction!r}; valid values are "
                             "None, \"mean\" and \"sum\"")
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(f"sequence_tiled_compute: grad_requiring_tensor_key={grad_requiring_tensor_key!r} is "
                             f"not one of kwargs_to_shard's keys ({keys_to_shard})")
        if len(args) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(f"SequenceTiledCompute: {len(args)} values for {len(keys_to_shard)} keys to shard and "
                             f"{len(keys_to_pass)} to pass")
        for key, value in zip(keys_to_shard, args):
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"sequence_tiled_compute: kwargs_to_shard[{key!r}] is {shape}; each value to shard "
                                 f"must be a tensor [batch, seqlen={seqlen}, ...] (it is cut along dimension 1)")
        target = keys_to_shard.index(grad_requiring_tensor_key)
        params = _Parameters(compute_params, [args[target]])
        plan = _Plan(fn, keys_to_shard, keys_to_pass, target, _step_pieces(seqlen, shards), output_unshard_dimension,
                     output_reduction)
        return super().apply(plan, params, len(args), *args, *params.tensors())

    @staticmethod
    def forward(ctx, plan, params, count, *tensors):
        ctx.plan, ctx.params = plan, params
        args = tensors[:count]
        ctx.passed = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
        with torch.no_grad():
            outputs = [plan.fn(**plan.kwargs(args, start, size)) for start, size in plan.pieces]
            ctx.shapes = [o.shape for o in outputs]
            return plan.reduce(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        plan, saved = ctx.plan, iter(ctx.saved_tensors)
        args = [next(saved) if a is None else a for a in ctx.passed]
        args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]  # only the target gets a gradient
        target = args[plan.target]
        needs = ctx.needs_input_grad[3 + plan.target]
        target_grad = torch.empty_like(target) if needs else None
        sums = _GradientSums(ctx.params.inputs)
        for (start, size), out_grad in zip(plan.pieces, plan.piece_gradients(grad, ctx.shapes)):
            kwargs = plan.kwargs(args, start, size)
            key = plan.keys_to_shard[plan.target]
            piece = kwargs[key] = kwargs[key].detach().requires_grad_(needs)
            with torch.enable_grad():
                out = plan.fn(**kwargs)
            grads = sums.backprop(out, out_grad, [piece] if needs else [])
            if needs:
                _put(target_grad.narrow(1, start, size), grads[0])
        arg_grads = [None] * len(args)
        arg_grads[plan.target] = target_grad
        return (None, None, None, *arg_grads, *ctx.params.gradients(sums.finish()))


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension=1, output_reduction="mean"):
    """``fn(**pieces, **kwargs_to_pass)`` on pieces of the tensors of ``kwargs_to_shard`` (each ``[batch, seqlen,
    ...]``, cut along dimension 1 in steps of ``ceil(seqlen / shards)``), the outputs concatenated along
    ``output_unshard_dimension`` (with 0, each piece's output, a loss say, gets a new leading dimension: one entry
    per piece), then reduced by ``output_reduction``: ``None`` (the concatenation), ``"mean"`` (over all its
    elements: with 0 and scalar outputs, the mean over pieces) or ``"sum"``. Only
    ``kwargs_to_shard[grad_requiring_tensor_key]`` and the parameters ``fn`` uses get gradients; ``kwargs_to_pass``
    is passed as is (its tensors as constants). ``compute_params`` as for :class:`TiledMLP` (``None`` works)."""
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction="mean")``: the
    loss of the LM head without the whole logits tensor. ``x`` (``[batch, seq, hidden]``), ``y`` (``[batch, seq,
    ...]``) and ``mask`` (``[batch, seq]`` or None) are flattened to rows (batch × seq) and cut into pieces (steps of
    ``ceil(rows / shards)``); ``fn(self, x_piece, y_piece[, mask_piece])`` returns a piece's loss (one value: the
    head and the loss inside it, so logits exist for one piece at a time); the result is the ``"mean"`` or the
    ``"sum"`` of the pieces' losses. With pieces of unequal weight (a mask, an uneven cut) return each piece's summed
    loss, reduce with ``"sum"`` and divide by the token count yourself: the gradients follow whatever you do to the
    loss (see "exact under any upstream gradient").

    Forward computes the pieces' losses under ``no_grad`` (nothing of the logits is kept); backward runs each piece's
    head and loss again and backpropagates the gradient that arrived (times 1/pieces for the mean). That is one LM
    head forward per piece more than DeepSpeed's scheme, which differentiates in forward with an assumed gradient.
    The exact form of that scheme (x's and the head's gradients computed in forward, scaled in backward by the real
    gradient, the head's injected then) was measured against this one (CPU, fp32, 8192 rows, hidden 1024, vocab
    32000, 8 pieces, median of 5; untiled head + cross-entropy: 2.24 GB peak, 1.00x time):

    ============================  ==========  ==============================  ======
    scheme                        peak        held from forward to backward   time
    ============================  ==========  ==============================  ======
    this one (recompute)          0.45 GB     0 (x, y are the caller's)       1.29x
    gradients in forward, scaled  0.45 GB     0.16 GB (x's grad, head's grad) 1.01x
    ============================  ==========  ==============================  ======

    (peaks above the inputs and weights; the x and head gradients are in both peaks, as the untiled backward makes
    them too). Both are exact and peak alike; the recompute costs about a quarter more head time (one forward of
    four matmul passes: the head is a few percent of a large model's step). It was chosen because the other
    computes the gradients before the upstream gradient is known: under fp16 loss scaling they would be computed
    unscaled and underflow (what loss scaling exists to prevent), it holds a gradient of x and of the head from
    forward until backward (and computes them when nobody backpropagates), and its head gradient, made in forward,
    must still be injected in backward past the stage-3 placeholder (see "a parameter's gradient arrives once").
    """

    @classmethod
    def apply(cls, fn, self, x, y, mask, shards, compute_params, output_reduction="mean"):
        _check_shards(shards, "TiledFusedLogitsLoss")
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"TiledFusedLogitsLoss: output_reduction={output_reduction!r}; valid values are "
                             "\"mean\" and \"sum\"")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"TiledFusedLogitsLoss: x {tuple(x.shape)} and y {tuple(y.shape)} must both be "
                             "[batch, seq, ...] with the same batch and sequence sizes")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"TiledFusedLogitsLoss: mask {tuple(mask.shape)} must be [batch, seq] = "
                             f"{tuple(x.shape[:2])}")
        params = _Parameters(compute_params, [x])
        return super().apply(fn, self, x, y, mask, shards, params, output_reduction, *params.tensors())

    @staticmethod
    def forward(ctx, fn, self, x, y, mask, shards, params, output_reduction, *param_tensors):
        ctx.fn, ctx.module, ctx.params, ctx.reduction = fn, self, params, output_reduction
        ctx.pieces = _step_pieces(x.shape[0] * x.shape[1], shards)
        ctx.save_for_backward(x, y, mask)
        with torch.no_grad():
            losses = torch.stack([_one_value(fn(*_loss_args(self, x, y, mask, start, size)))
                                  for start, size in ctx.pieces])
        return losses.mean() if output_reduction == "mean" else losses.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, y, mask = ctx.saved_tensors
        x, y = x.detach(), y.detach()
        mask = None if mask is None else mask.detach()
        weight = grad / len(ctx.pieces) if ctx.reduction == "mean" else grad
        needs = ctx.needs_input_grad[2]
        x_grad = x.new_empty(x.shape) if needs else None  # (contiguous, whatever x's strides)
        rows_grad = None if x_grad is None else x_grad.view(-1, *x.shape[2:])
        sums = _GradientSums(ctx.params.inputs)
        for start, size in ctx.pieces:
            args = _loss_args(ctx.module, x, y, mask, start, size)
            piece = args[1].requires_grad_(needs)
            with torch.enable_grad():
                loss = ctx.fn(*args)
            grads = sums.backprop(loss, weight.reshape(loss.shape), [piece] if needs else [])
            if needs:
                _put(rows_grad.narrow(0, start, size), grads[0])
        return (None, None, x_grad, None, None, None, None, None, *ctx.params.gradients(sums.finish()))


def _loss_args(module, x, y, mask, start: int, size: int) -> tuple:
    """``fn``'s arguments for rows ``start:start + size`` of the flattened batch × sequence (a new leaf for x)."""
    rows = (x.reshape(-1, *x.shape[2:]).narrow(0, start, size).detach(),
            y.reshape(-1, *y.shape[2:]).narrow(0, start, size))
    if mask is not None:
        rows += (mask.reshape(-1).narrow(0, start, size),)
    return (module, *rows)


def _one_value(loss: torch.Tensor) -> torch.Tensor:
    if loss.numel() != 1:
        raise ValueError(f"TiledFusedLogitsLoss: fn returned a tensor of shape {tuple(loss.shape)}; it must return "
                         "one loss value per piece")
    return loss.reshape(())


class _Plan:
    """What :class:`SequenceTiledCompute` does, fixed when it is applied: the pieces, the call, the reduction."""

    def __init__(self, fn, keys_to_shard, keys_to_pass, target, pieces, dim, reduction):
        self.fn, self.keys_to_shard, self.keys_to_pass, self.target = fn, keys_to_shard, keys_to_pass, target
        self.pieces, self.dim, self.reduction = pieces, dim, reduction

    def kwargs(self, args, start: int, size: int) -> dict:
        """``fn``'s keyword arguments for one piece (the sharded values narrowed along the sequence)."""
        shard = len(self.keys_to_shard)
        kwargs = {k: v.narrow(1, start, size) for k, v in zip(self.keys_to_shard, args[:shard])}
        kwargs.update(zip(self.keys_to_pass, args[shard:]))
        return kwargs

    def reduce(self, outputs: list) -> torch.Tensor:
        joined = torch.stack(outputs) if self.dim == 0 else torch.cat(outputs, dim=self.dim)
        if self.reduction is None:
            return joined
        return joined.mean() if self.reduction == "mean" else joined.sum()

    def piece_gradients(self, grad: torch.Tensor, shapes: list) -> list:
        """The gradient of each piece's output, from the gradient of the reduced output."""
        if self.reduction is not None:
            if self.reduction == "mean":
                grad = grad / sum(s.numel() for s in shapes)
            return [grad.expand(s) for s in shapes]
        if self.dim == 0:
            return list(grad.unbind(0))
        offsets = [0]
        for s in shapes:
            offsets.append(offsets[-1] + s[self.dim])
        return [grad.narrow(self.dim, offsets[i], s[self.dim]) for i, s in enumerate(shapes)]


def _check_shards(shards, what: str) -> None:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"{what}: shards={shards!r}; it must be a positive int (shards_for(seqlen, hidden) gives "
                         "the tutorial's count)")


def _even_pieces(length: int, shards: int) -> list[tuple[int, int]]:
    """(start, size) of exactly ``shards`` pieces as even as can be (the first ``length % shards`` one longer)."""
    base, longer = divmod(length, shards)
    pieces, start = [], 0
    for i in range(shards):
        size = base + (1 if i < longer else 0)
        pieces.append((start, size))
        start += size
    return pieces


def _step_pieces(length: int, shards: int) -> list[tuple[int, int]]:
    """DeepSpeed's cut: (start, size) in steps of ``ceil(length / shards)``, the last piece shorter, none empty."""
    if length == 0:
        raise ValueError("tiled compute: the sequence is empty (nothing to cut into pieces)")
    step = math.ceil(length / shards)
    return [(start, min(step, length - start)) for start in range(0, length, step)]


def _put(where: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is None:  # (fn did not use this piece of its input)
        where.zero_()
    else:
        where.copy_(grad)


def _holds_values(p: torch.Tensor) -> bool:
    """Whether ``p``'s tensor holds the values of its shape now: not so for a ZeRO-3 parameter between uses, which
    reports its full shape over an empty placeholder (see "a parameter's gradient arrives once")."""
    reported = p.shape
    with torch._C.DisableTorchFunctionSubclass():
        return p.shape == reported


class _Parameters:
    """What a tiled op gives autograd besides its own tensors (see "a parameter's gradient arrives once"):
    ``inputs``, the trainable parameters of ``compute_params`` that hold their values now, and an ``anchor`` (an
    empty tensor that requires a gradient) where only parameters reached otherwise may need one, so that the
    output requires a gradient and the backward runs."""

    def __init__(self, compute_params, tensors: list):
        listed = list({id(p): p for p in (compute_params or ()) if p.requires_grad}.values())
        self.inputs = [p for p in listed if _holds_values(p)]
        others_may_train = compute_params is None or len(self.inputs) < len(listed)
        nothing_trains = not any(t.requires_grad for t in tensors if isinstance(t, torch.Tensor)) and not self.inputs
        self.anchor = None
        if torch.is_grad_enabled() and others_may_train and nothing_trains:
            self.anchor = torch.empty(0, requires_grad=True)

    def tensors(self) -> list:
        return self.inputs if self.anchor is None else [self.anchor, *self.inputs]

    def gradients(self, input_sums: list) -> list:
        """The backward's return values for :meth:`tensors`."""
        return input_sums if self.anchor is None else [None, *input_sums]


class _Sum:
    """A running sum of gradients. The first is kept as autograd gave it, which may alias another tensor (an op
    that passes its incoming gradient through), so the first addition makes a new tensor, added into after."""

    __slots__ = ("value", "owned")

    def __init__(self):
        self.value, self.owned = None, False

    def add(self, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        if self.value is None:
            self.value = grad
        elif self.owned:
            self.value.add_(grad)
        else:
            self.value, self.owned = self.value + grad, True


class _GradientSums:
    """One backward of a tiled op: each piece's gradients, the parameters' summed (see "a parameter's gradient
    arrives once")."""

    def __init__(self, inputs: list):
        self.inputs = inputs
        self._input_sums = [_Sum() for _ in inputs]
        self._found: dict[int, tuple[GradientEdge, _Sum]] = {}  # id(parameter) -> its accumulator, its sum
        self._skip = {id(p) for p in inputs}

    def backprop(self, output: torch.Tensor, grad: torch.Tensor, leaves: list) -> list:
        """Backpropagate ``grad`` from ``output`` (one piece's recompute) to ``leaves`` (the op's own detached
        inputs: their gradients are returned) and to every parameter it reached (summed here)."""
        if not output.requires_grad:  # nothing in this piece needs a gradient
            return [None] * len(leaves)
        mine = {id(t) for t in leaves}
        reached = []
        for node in _accumulators(output.grad_fn):
            key = id(node.variable)
            if key in self._skip or key in mine:
                continue
            # The newest edge: holding it keeps the accumulator alive, so later pieces reuse it.
            self._found[key] = (GradientEdge(node, 0), self._found[key][1] if key in self._found else _Sum())
            reached.append(key)
        targets = [*leaves, *self.inputs, *(self._found[k][0] for k in reached)]
        if not targets:
            return []
        grads = torch.autograd.grad(output, targets, grad, allow_unused=True)
        n, m = len(leaves), len(self.inputs)
        for total, g in zip(self._input_sums, grads[n:n + m]):
            total.add(g)
        for key, g in zip(reached, grads[n + m:]):
            self._found[key][1].add(g)
        return list(grads[:n])

    def finish(self) -> list:
        """Hand the sums of the parameters found in the graphs to their accumulators (one backward: each is
        accumulated once) and return those of ``inputs``."""
        found = [(edge, total.value) for edge, total in self._found.values() if total.value is not None]
        if found:
            torch.autograd.backward([edge for edge, _ in found], [g for _, g in found])
        return [total.value for total in self._input_sums]


def _accumulators(root) -> list:
    """The AccumulateGrad nodes (leaf tensors that require a gradient) reachable from the autograd node ``root``."""
    seen, stack, found = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, _ACCUMULATE_GRAD):
            found.append(node)
        else:
            stack.extend(child for child, _ in node.next_functions)
    return found
