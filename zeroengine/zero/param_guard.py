"""The marker a stage-3 parameter carries while it is partitioned: its full shape, and a clear error on use.

Note: why a class swap on the parameter, and an empty placeholder.
Between uses a partitioned parameter's ``.data`` is a 0-element tensor (this
rank's values live in a flat shard elsewhere). DeepSpeed leaves it at that,
and its users see zero-sized tensors, shape errors far from the cause, or
silently empty results (``p.data.fill_`` on 0 elements does nothing). Here a
partitioned parameter's Python class is switched to :class:`PartitionedParameter`
when it is released and back to ``nn.Parameter`` when it is gathered, so

* while gathered (inside the module's forward/backward, or inside
  ``GatheredParameters``) it is a plain Parameter: no per-op overhead at all;
* while partitioned, Python code that *reads or writes its values* (any torch
  function or method, ``.data``, ``state_dict()``'s ``detach``) raises
  :class:`PartitionedParameterError` naming the parameter and the ways to get
  its values (``GatheredParameters``, ``safe_get_full_fp32_param``);
* metadata still answers for the *full* parameter: ``shape``, ``size()``,
  ``numel()``, ``dim()`` (so ``sum(p.numel() ...)`` counts the real model),
  ``dtype``, ``device``, ``requires_grad``, ``grad`` (None), hashing.

The placeholder stays 0-element on purpose: C++ code that bypasses Python
(autograd unpacking a saved parameter that was released too early) fails with
a shape error instead of computing with stand-in values.

Note: what ``state_dict()`` gives at stage 3.
``module.state_dict()`` detaches every parameter. Refusing that ``detach`` broke
code that only wants the names and shapes (Hugging Face's ``from_pretrained``
lists ``model.state_dict().keys()`` before loading under ZeRO-3), while DeepSpeed's
answer, its empty placeholders, is how ZeRO-3 users end up saving empty weights.
So ``detach()`` of a partitioned parameter gives a :class:`PartitionedPlaceholder`:
it answers for the full parameter's name, shape, dtype and device, and refuses
everything that reads or writes values, ``data_ptr``/``untyped_storage`` (what
safetensors reads) and pickling (``torch.save``) included. A state_dict taken
outside ``GatheredParameters`` can be listed and compared by shape, and cannot be
saved: no path writes an empty weight silently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class PartitionedParameterError(RuntimeError):
    """A partitioned (stage-3) parameter was used outside the engine's forward/backward."""


@dataclass
class ShardInfo:
    """What a partitioned parameter remembers about itself (the one attribute it carries: ``_ze``)."""

    name: str
    shape: torch.Size
    # Set by zero.Init before initialize(): this rank's flat slice (see zeroengine.zero.init); None once an
    # engine's partitioned buffer owns the values.
    init_shard: object = None


def op_name(func) -> str:
    """The name a ``__torch_function__`` call is known by here (``"add"``, ``"data.__get__"``)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        return f"{getattr(owner, '__name__', '?')}.{name}"
    return name


# Answered for the full parameter, from ShardInfo.shape.
def _size(info, *args, **kwargs):
    dim = args[0] if args else kwargs.get("dim")
    return info.shape if dim is None else info.shape[dim]


FULL_METADATA = {
    "shape.__get__": lambda info: info.shape,
    "size": _size,
    "numel": lambda info: info.shape.numel(),
    "nelement": lambda info: info.shape.numel(),
    "dim": lambda info: len(info.shape),
    "ndimension": lambda info: len(info.shape),
    "ndim.__get__": lambda info: len(info.shape),
    "__len__": lambda info: info.shape[0],
}

# Run on the placeholder itself: they do not read values.
PASS_THROUGH = frozenset({
    "dtype.__get__", "device.__get__", "layout.__get__", "requires_grad.__get__", "requires_grad.__set__",
    "requires_grad_", "is_leaf.__get__", "grad.__get__", "grad.__set__", "grad_fn.__get__",
    "is_floating_point", "is_complex", "element_size", "untyped_storage", "is_cuda.__get__", "is_cpu.__get__",
    "is_meta.__get__", "is_sparse.__get__", "is_quantized.__get__", "is_nested.__get__", "_is_view",
    "__hash__", "_has_compatible_shallow_copy_type", "register_hook", "register_post_accumulate_grad_hook",
    "_backward_hooks.__get__", "_backward_hooks.__set__", "_post_accumulate_grad_hooks.__get__",
    "_post_accumulate_grad_hooks.__set__", "name.__get__", "names.__get__",
    "storage_offset", "data_ptr", "get_device", "is_contiguous", "stride",
})

# Conversions (module.to(...) walks every parameter): a no-op is fine; a real one needs the values.
_CONVERSIONS = frozenset({"to", "float", "half", "bfloat16", "double", "cpu", "cuda", "type"})


class PartitionedParameter(torch.nn.Parameter):
    """The class of a stage-3 parameter while it is partitioned (see module note)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        target = next((a for a in args if isinstance(a, PartitionedParameter)), None)
        if target is None:
            target = _first_partitioned(args, kwargs)
        if target is not None and args and args[0] is target:
            info = target._ze
            answer = FULL_METADATA.get(name)
            if answer is not None:
                return answer(info, *args[1:], **kwargs)
            if name == "__repr__" or name == "__format__":
                return describe(target)
        if name == "data.__set__" and target is args[0] and _sets_values(args[1]):
            raise PartitionedParameterError(_replaced_data_message(target))
        with torch._C.DisableTorchFunctionSubclass():
            if target is None or name in PASS_THROUGH or name == "data.__set__":
                return func(*args, **kwargs)
            if name == "detach" and target is args[0]:
                return _placeholder(target, func(*args, **kwargs))
            if name in _CONVERSIONS and target is args[0]:
                converted = func(*args, **kwargs)
                if converted is target:
                    return converted
                convert = getattr(target._ze.init_shard, "convert", None)
                if convert is not None:  # zero.Init shard before initialize(): convert the shard alongside
                    return convert(target, func, args[1:], kwargs)
        raise PartitionedParameterError(_message(target, name))

    def __repr__(self):
        return describe(self)


# What a placeholder answers itself: metadata that reads no values (not data_ptr, storage or strides, which
# let native code such as safetensors' writer read memory the placeholder does not have).
_PLACEHOLDER_METADATA = frozenset({
    "dtype.__get__", "device.__get__", "layout.__get__", "requires_grad.__get__", "is_leaf.__get__",
    "grad.__get__", "grad_fn.__get__", "is_floating_point", "is_complex", "element_size", "is_cuda.__get__",
    "is_cpu.__get__", "is_meta.__get__", "is_sparse.__get__", "is_quantized.__get__", "is_nested.__get__",
    "__hash__", "name.__get__", "names.__get__", "get_device", "_is_view",
})


class PartitionedPlaceholder(torch.Tensor):
    """``detach()`` of a partitioned parameter, as ``state_dict()`` lists it: the full parameter's metadata and
    no values (see "what state_dict() gives at stage 3")."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        target = args[0] if args and isinstance(args[0], PartitionedPlaceholder) else None
        if target is not None:
            answer = FULL_METADATA.get(name)
            if answer is not None:
                return answer(target._ze, *args[1:], **kwargs)
            if name == "__repr__" or name == "__format__":
                return describe(target)
            if name in _PLACEHOLDER_METADATA:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
        placeholder = target if target is not None else next(
            a for a in op_arguments(args, kwargs) if isinstance(a, PartitionedPlaceholder))
        raise PartitionedParameterError(_placeholder_message(placeholder, name))

    def __repr__(self):
        return describe(self)


def _placeholder(target: "PartitionedParameter", detached: torch.Tensor) -> PartitionedPlaceholder:
    with torch._C.DisableTorchFunctionSubclass():
        placeholder = detached.as_subclass(PartitionedPlaceholder)
    placeholder.__dict__["_ze"] = target._ze
    return placeholder


def _placeholder_message(p, op: str) -> str:
    info = p._ze
    return (f"'{op}' on {info.name!r} (shape {tuple(info.shape)}) as detached from its parameter (a state_dict() "
            f"entry, say), which ZeRO stage 3 partitions across ranks: it holds no values here, so nothing can be "
            f"read or saved from it (an empty weight is never written). For the full weights: "
            f"engine.save_16bit_model() or Hugging Face's trainer.save_model() with "
            f"zero_optimization.stage3_gather_16bit_weights_on_model_save=true, engine.save_checkpoint() then "
            f"ze_to_fp32, take the state_dict inside `with zeroengine.zero.GatheredParameters(list(model."
            f"parameters())):` (collective: every rank enters it), or use "
            f"zeroengine.zero.safe_get_full_fp32_param(param) for one parameter.")


def op_arguments(args, kwargs):
    """Every argument an op was given, by position or keyword (``torch.add(x, other=p)``), with the items
    of list and tuple arguments (``torch.cat([x, p])``) in place of the sequence."""
    for value in (*args, *kwargs.values()):
        yield from (value if isinstance(value, (list, tuple)) else (value,))


def _first_partitioned(args, kwargs):
    return next((a for a in op_arguments(args, kwargs) if isinstance(a, PartitionedParameter)), None)


def describe(p) -> str:
    info = p._ze
    return (f"{type(p).__name__}({info.name}, shape={tuple(info.shape)}, dtype={p.dtype}; partitioned across "
            f"ranks: read it inside zeroengine.zero.GatheredParameters)")


def _message(p, op: str) -> str:
    info = p._ze
    if torch.compiler.is_compiling():  # dynamo tracing the model reaches the placeholders, not a user's code
        return (f"torch.compile is not supported at ZeRO stage 3: tracing reached the partitioned parameter "
                f"{info.name!r} ('{op}'), whose values exist only while its module runs. Train uncompiled at "
                "stage 3, or compile at stages 0-2")
    in_backward = ""
    if torch._C._current_graph_task_id() != -1:
        # The usual way to get here in backward: torch's reentrant checkpoint recomputing a segment that reads
        # its module's parameter directly, after that parameter's gradient was complete and it was released.
        in_backward = (" This happened during backward: if it is an activation-checkpoint recompute "
                       "(torch.utils.checkpoint with use_reentrant=True) of code that uses the parameter "
                       "directly, use zeroengine.checkpointing.checkpoint, which keeps the enclosing "
                       "module's parameters gathered for the recompute, or use_reentrant=False.")
    return (f"parameter {info.name!r} (shape {tuple(info.shape)}) is partitioned across ranks by ZeRO stage 3 "
            f"and holds no values here, so '{op}' cannot run on it. Its values are gathered only while the "
            f"module that owns it runs forward or backward: outside the engine's forward/backward, or inside "
            f"it from another module (e.g. F.linear(x, self.emb.weight) in a parent: register it with "
            f"zeroengine.zero.register_external_parameter(parent, param), or use it through its own module). "
            f"To read or edit it outside training, wrap the code in `with zeroengine.zero.GatheredParameters([param], "
            f"modifier_rank=...)` (collective: every rank enters it), or use "
            f"zeroengine.zero.safe_get_full_fp32_param(param) / safe_set_full_fp32_param(param, value)."
            + in_backward)


def _sets_values(new) -> bool:
    """Whether ``p.data = new`` would give a partitioned parameter values of its own. Not when ``new`` is the
    parameter itself or an empty placeholder: ``module.to(...)`` assigns the (converted) placeholder back."""
    with torch._C.DisableTorchFunctionSubclass():
        return isinstance(new, torch.Tensor) and not isinstance(new, PartitionedParameter) and new.numel() > 0


def _replaced_data_message(p) -> str:
    info = p._ze
    return (f"`{info.name}.data = ...`: parameter {info.name!r} (shape {tuple(info.shape)}) is partitioned across "
            f"ranks by ZeRO stage 3, and its values live in that partitioned storage, so the new tensor would be "
            f"lost. Set it inside `with zeroengine.zero.GatheredParameters([param], modifier_rank=0):` (collective: "
            f"every rank enters it; there `param.data = t` or `param.copy_(t)` under torch.no_grad() on rank 0 "
            f"is kept), or with zeroengine.zero.safe_set_full_fp32_param(param, value).")


def mark_partitioned(p: torch.nn.Parameter, name: str | None = None, shape: torch.Size | None = None) -> None:
    """From now on ``p`` is a placeholder: give it the marker (name and full shape are kept from before)."""
    info = p.__dict__.get("_ze")
    if info is None:
        info = ShardInfo(name or "<unnamed>", torch.Size(shape if shape is not None else p.shape))
        p.__dict__["_ze"] = info
    elif name is not None:
        info.name = name
    p.__class__ = PartitionedParameter


def mark_gathered(p: torch.nn.Parameter) -> None:
    """``p`` holds its full value again: a plain Parameter (no checks, no overhead)."""
    p.__class__ = torch.nn.Parameter


def info_of(p: torch.Tensor) -> ShardInfo | None:
    return p.__dict__.get("_ze") if isinstance(p, torch.nn.Parameter) else None


def full_shape(p: torch.Tensor) -> torch.Size:
    """The full shape of a parameter, partitioned or not."""
    info = info_of(p)
    return info.shape if info is not None else p.shape
