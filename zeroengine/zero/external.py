"""``register_external_parameter``: a module that uses another module's parameter in its forward.

Stage 3 gathers a parameter while the module that owns it runs. A parent
whose forward reads a child's weight directly (``F.linear(x,
self.emb.weight)``) would find it empty; registering it as an *external*
parameter of the parent makes the parent's forward and backward fetch it too,
as DeepSpeed's function of the same name does. Outside stage 3 registration is
recorded and has no effect. It may be called before ``initialize`` (in the
model's ``__init__``, under ``zero.Init`` or not) or after it.
"""
from __future__ import annotations

import weakref

import torch

_ATTR = "_ze_external_params"  # on the module: {id(param): param}
# Told of every registration made after they were built: stage 3's hooks of a live model (which may refuse
# it). Weak, so a dropped engine's hooks go with it; they call watch_registrations themselves.
_WATCHERS: weakref.WeakSet = weakref.WeakSet()


def watch_registrations(watcher) -> None:
    """From now on ``watcher.external_registered(module, parameter)`` runs at each registration."""
    _WATCHERS.add(watcher)


def unwatch_registrations(watcher) -> None:
    _WATCHERS.discard(watcher)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Fetch ``parameter`` whenever ``module`` runs forward or backward (stage 3)."""
    _check_types(module, parameter, "register_external_parameter")
    for watcher in list(_WATCHERS):  # models already hooked for stage 3 learn of it now (and may refuse it)
        watcher.external_registered(module, parameter)
    module.__dict__.setdefault(_ATTR, {})[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    _check_types(module, parameter, "unregister_external_parameter")
    registered = module.__dict__.get(_ATTR, {})
    if id(parameter) not in registered:
        raise ValueError(f"unregister_external_parameter: the parameter (shape {tuple(parameter.shape)}) is not a "
                         f"registered external parameter of this {type(module).__name__}")
    del registered[id(parameter)]


def external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters registered as external to ``module`` (its own are not included)."""
    return list(module.__dict__.get(_ATTR, {}).values())


def _check_types(module, parameter, fn: str) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{fn}: the first argument must be the nn.Module that uses the parameter, got "
                        f"{type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"{fn}: the second argument must be a torch.nn.Parameter, got {type(parameter).__name__}")
