"""Checkpoint every module of given classes (e.g. each transformer block) without editing the model.

``checkpoint_modules(model, Block)`` gives each matching module a subclass of
its own class whose ``__call__`` goes through :func:`checkpoint` (the pattern
FSDP2's ``fully_shard`` uses). The whole call is checkpointed, module hooks
included: under ZeRO stage 3 the block's gather/release hooks run in the
forward and again in the recompute. The parameters, buffers, state_dict keys
and ``isinstance`` checks are unchanged, so optimizers, engines and checkpoints
see the same model; :func:`uncheckpoint_modules` restores the original classes.
(A model holding wrapped modules cannot be pickled whole with ``torch.save(model)``;
save its ``state_dict``, as usual.)
"""
from __future__ import annotations

from typing import Iterable, Union

import torch

from .checkpoint import checkpoint

_SUBCLASSES: dict[type, type] = {}


def _checkpointed_subclass(cls: type) -> type:
    if cls not in _SUBCLASSES:
        def __call__(self, *args, **kwargs):
            def run(*a, **kw):
                return super(sub, self).__call__(*a, **kw)

            run._zeroengine_checkpoint_name = self._zeroengine_checkpoint_name
            return checkpoint(run, *args, **kwargs)

        sub = type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": __call__, "_zeroengine_original_class": cls})
        sub.__module__ = cls.__module__
        _SUBCLASSES[cls] = sub
    return _SUBCLASSES[cls]


def _matches(module: torch.nn.Module, classes: tuple) -> bool:
    cls = getattr(type(module), "_zeroengine_original_class", type(module))
    return any(cls.__name__ == c if isinstance(c, str) else issubclass(cls, c) for c in classes)


def checkpoint_modules(model: torch.nn.Module, classes: Union[type, str, Iterable[Union[type, str]]]) -> list[str]:
    """Checkpoint each submodule of ``model`` that is an instance of ``classes`` (classes or class names).

    Returns the names of the wrapped modules. Wrapping twice is harmless.
    """
    classes = (classes,) if isinstance(classes, (type, str)) else tuple(classes)
    wrapped = []
    for name, module in model.named_modules():
        if not _matches(module, classes):
            continue
        if not hasattr(type(module), "_zeroengine_original_class"):
            module.__class__ = _checkpointed_subclass(type(module))
        module._zeroengine_checkpoint_name = name or type(module).__name__
        wrapped.append(name)
    if not wrapped:
        raise ValueError(f"no module of {model.__class__.__name__} is an instance of {classes}")
    return wrapped


def uncheckpoint_modules(model: torch.nn.Module) -> list[str]:
    """Undo :func:`checkpoint_modules` everywhere in ``model``; returns the names restored."""
    restored = []
    for name, module in model.named_modules():
        original = getattr(type(module), "_zeroengine_original_class", None)
        if original is not None:
            module.__class__ = original
            del module._zeroengine_checkpoint_name
            restored.append(name)
    return restored
