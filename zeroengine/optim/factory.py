"""Build the optimizer named by a DeepSpeed ``optimizer`` config section.

How DeepSpeed names map to optimizers (``DeepSpeedEngine._configure_basic_optimizer``)
--------------------------------------------------------------------------------------
DeepSpeed builds "Adam" and "AdamW" as its FusedAdam (or DeepSpeedCPUAdam under
ZeRO-Offload) with ``adam_w_mode = (type == "AdamW") or params.adam_w_mode``,
where ``adam_w_mode`` defaults to **True**. So a plain ``"type": "Adam"``
config trains with *decoupled* weight decay (AdamW), and only
``"adam_w_mode": false`` gives classic Adam with L2 weight decay. FusedAdam's
and CPUAdam's ``weight_decay`` default is 0. We build::

    type     adam_w_mode   ->  torch.optim class
    Adam     true (default)    AdamW
    Adam     false             Adam
    AdamW    any               AdamW   (DeepSpeed ignores adam_w_mode here too)

using torch's implementations, whose numbers FusedAdam/CPUAdam match, with
``weight_decay`` defaulting to 0 like DeepSpeed's kernels. ``torch_adam: true``
is DeepSpeed's switch to torch's own classes, constructed with torch's own
defaults; we honour that too, so AdamW then defaults to weight_decay=0.01.

``offload_optimizer=True`` (optimizer state on CPU) reproduces DeepSpeed's
other branch: Adam/AdamW without ``torch_adam`` build ``CPUAdam``, falling back
to torch's class with a warning when the op cannot be imported.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Dict, List

import torch

from zeroengine.config.errors import ConfigError


class OptimizerParamsError(ConfigError, ValueError):
    """A bad ``optimizer.params`` entry: a ConfigError naming the key, and a ValueError for direct callers."""


logger = logging.getLogger(__name__)

OPTIMIZER_NAMES = ("Adam", "AdamW", "SGD", "CPUAdam", "Adafactor", "SM3", "Muon")
DEFAULT_LR = 1e-3

# FusedAdam / DeepSpeedCPUAdam options with no torch counterpart. Their only
# supported values equal torch's behaviour, so those are accepted and dropped.
_DEEPSPEED_ONLY_FLAGS = {"bias_correction": True, "set_grad_none": True, "fp32_optimizer_states": True}


def build_optimizer(type_name: str, params: Dict[str, Any] | None, parameters,
                    *, offload_optimizer: bool = False,
                    bf16_masters_state_dtype: torch.dtype | None = None) -> torch.optim.Optimizer:
    """``optimizer {type, params}`` -> a torch optimizer over ``parameters``.

    ``type_name`` is matched case-insensitively (DeepSpeed lower-cases its own
    optimizer names). ``parameters`` is an iterable of tensors or of
    param-group dicts. ``bf16_masters_state_dtype`` (``bf16.bf16_master_weights_and_grads``): Adam/AdamW step
    bf16 parameters themselves, moments in that dtype (zeroengine/optim/lean_adam.py).
    """
    name = _canonical_name(type_name)
    kwargs = dict(params or {})
    if "max_grad_norm" in kwargs:
        raise ValueError("optimizer.params.max_grad_norm is not supported; use the top-level "
                         "'gradient_clipping' setting instead (as in DeepSpeed)")
    groups = _normalize_parameters(parameters)
    _betas_to_tuple(kwargs, "optimizer.params")
    if bf16_masters_state_dtype is not None:
        return _build_lean_adam(name, kwargs, groups, bf16_masters_state_dtype, offload_optimizer)
    return _BUILDERS[name](name, kwargs, groups, offload_optimizer)


def _build_lean_adam(name: str, kwargs: dict, groups: list, state_dtype: torch.dtype,
                     offload_optimizer: bool) -> torch.optim.Optimizer:
    """bf16 masters: LeanAdam where the parameters are, the C++ CPUAdam (bf16 params; fp32 or bf16 moments,
    DeepSpeed's ``fp32_optimizer_states``) with ``offload_optimizer``."""
    from .lean_adam import LeanAdam

    if name not in ("Adam", "AdamW"):
        raise OptimizerParamsError("bf16.bf16_master_weights_and_grads", f"bf16 masters are built for Adam and "
                                   f"AdamW, not {name}")
    if _pop_bool(kwargs, "torch_adam", False):
        # DeepSpeed hands bf16 masters to torch's AdamW here, whose moments and arithmetic are then bf16 too:
        # neither the fp32 moments DeepSpeed documents for this mode nor what bf16_optimizer_states asks.
        raise OptimizerParamsError("optimizer.params.torch_adam", "bf16 masters step with zeroengine's Adam "
                                   "(fp32 arithmetic, moments in fp32 or bf16 as configured), not torch's: remove "
                                   "torch_adam, or bf16.bf16_master_weights_and_grads")
    adam_w_mode = _pop_bool(kwargs, "adam_w_mode", True)
    if kwargs.pop("amsgrad", False):
        raise OptimizerParamsError("optimizer.params.amsgrad", "amsgrad is not built with bf16 masters")
    kwargs.pop("fused", None)
    kwargs.pop("foreach", None)
    # DeepSpeed's CPU Adam keeps bf16 moments for bf16 params when told fp32_optimizer_states=false (and
    # bf16_optimizer_states overrides it to that); honoured likewise where the CPU Adam steps.
    if kwargs.pop("fp32_optimizer_states", True) is False and offload_optimizer:
        state_dtype = torch.bfloat16
    _drop_deepspeed_flags(kwargs)
    kwargs.setdefault("weight_decay", 0.0)
    cls = _import_cpu_adam(required=True) if offload_optimizer else LeanAdam
    return _construct(cls, groups, {**kwargs, "adamw_mode": name == "AdamW" or adam_w_mode,
                                    "state_dtype": state_dtype}, name)


# --------------------------------------------------------------------------- per type


def _build_adam(name: str, kwargs: dict, groups: list, offload_optimizer: bool) -> torch.optim.Optimizer:
    torch_adam = _pop_bool(kwargs, "torch_adam", False)
    adam_w_mode = _pop_bool(kwargs, "adam_w_mode", True)
    if name == "AdamW" and not adam_w_mode:
        logger.warning("optimizer type AdamW with adam_w_mode=false: AdamW always decouples weight decay "
                       "(DeepSpeed ignores adam_w_mode for AdamW too)")
    decoupled = name == "AdamW" or adam_w_mode
    _drop_deepspeed_flags(kwargs)
    if not torch_adam:
        kwargs.setdefault("weight_decay", 0.0)
        if offload_optimizer:
            cpu_adam = _import_cpu_adam(required=False)
            if cpu_adam is not None:
                if kwargs.get("amsgrad"):
                    raise OptimizerParamsError("optimizer.params.amsgrad",
                                               "the offloaded optimizer step runs zeroengine's CPUAdam, which has "
                                               "no amsgrad: set it to false, or turn "
                                               "zero_optimization.offload_optimizer off")
                kwargs.pop("amsgrad", None)
                return _construct(cpu_adam, groups, {**kwargs, "adamw_mode": decoupled}, "CPUAdam",
                                  why=" (zero_optimization.offload_optimizer steps with zeroengine's CPUAdam)")
            logger.warning("CPUAdam op unavailable; offloaded %s runs torch.optim.%s on CPU instead",
                           name, "AdamW" if decoupled else "Adam")
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return _construct(cls, groups, kwargs, name)


def _build_sgd(name: str, kwargs: dict, groups: list, offload_optimizer: bool) -> torch.optim.Optimizer:
    return _construct(torch.optim.SGD, groups, kwargs, name)


def _build_cpu_adam(name: str, kwargs: dict, groups: list, offload_optimizer: bool) -> torch.optim.Optimizer:
    if _pop_bool(kwargs, "torch_adam", False):
        raise ValueError("optimizer type CPUAdam with torch_adam=true is contradictory; "
                         "use type Adam/AdamW with torch_adam=true for torch's implementation")
    for key in ("fused", "foreach"):
        if kwargs.pop(key, None):
            raise ValueError(f"optimizer.params.{key} is a torch.optim option; CPUAdam has its own "
                             f"vectorised kernel (remove '{key}')")
    if "adam_w_mode" in kwargs and "adamw_mode" in kwargs and kwargs["adam_w_mode"] != kwargs["adamw_mode"]:
        raise ValueError("optimizer.params: adam_w_mode and adamw_mode disagree; give one of them")
    adamw_mode = _pop_bool(kwargs, "adam_w_mode", True)
    adamw_mode = _pop_bool(kwargs, "adamw_mode", adamw_mode)
    if kwargs.pop("amsgrad", False):
        raise ValueError("optimizer.params.amsgrad=true is not supported by CPUAdam")
    _drop_deepspeed_flags(kwargs)
    return _construct(_import_cpu_adam(required=True), groups, {**kwargs, "adamw_mode": adamw_mode}, name)


def _build_adafactor(name: str, kwargs: dict, groups: list, offload_optimizer: bool) -> torch.optim.Optimizer:
    """torch.optim.Adafactor's parameters and update, on the pieces ZeRO partitions (zeroengine/optim/adafactor.py);
    with offload it steps the pieces in host memory the same way."""
    from .adafactor import Adafactor

    if "eps" in kwargs:
        eps = kwargs["eps"]
        if not isinstance(eps, (list, tuple)) or len(eps) != 2:
            raise OptimizerParamsError("optimizer.params.eps", f"Adafactor's eps is a pair [eps1 or null, eps2], "
                                       f"got {eps!r}")
        kwargs["eps"] = (None if eps[0] is None else float(eps[0]), float(eps[1]))
    kwargs.setdefault("lr", 1e-2)  # torch's default (the global DEFAULT_LR is Adam's)
    return _construct(Adafactor, groups, kwargs, name)


def _build_sm3(name: str, kwargs: dict, groups: list, offload_optimizer: bool) -> torch.optim.Optimizer:
    from .sm3 import SM3

    kwargs.setdefault("lr", 0.1)
    return _construct(SM3, groups, kwargs, name)


def _build_muon(name: str, kwargs: dict, groups: list, offload_optimizer: bool) -> torch.optim.Optimizer:
    """DeepSpeed's Muon with its auxiliary Adam (zeroengine/optim/muon.py); the parameters carry ``use_muon``."""
    from .muon import ADAM_KEYS, MUON_KEYS, Muon, muon_param_groups

    adam_w_mode = _pop_bool(kwargs, "adam_w_mode", True)
    kwargs.pop("per_head_muon", None)  # (read where the model is: initialize() tags the projections)
    known = {*MUON_KEYS, *ADAM_KEYS, "muon_lr", "adam_lr"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise OptimizerParamsError(f"optimizer.params.{unknown[0]}", f"not a parameter of Muon: unknown {unknown}; "
                                   f"accepted: {', '.join(sorted(known | {'adam_w_mode', 'per_head_muon'}))}")
    return Muon(muon_param_groups(groups, kwargs), adam_w_mode=adam_w_mode)


_BUILDERS: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "Adam": _build_adam, "AdamW": _build_adam, "SGD": _build_sgd, "CPUAdam": _build_cpu_adam,
    "Adafactor": _build_adafactor, "SM3": _build_sm3, "Muon": _build_muon,
}


# --------------------------------------------------------------------------- helpers


def _canonical_name(type_name: str) -> str:
    for name in OPTIMIZER_NAMES:
        if isinstance(type_name, str) and type_name.lower() == name.lower():
            return name
    raise ValueError(f"unknown optimizer type {type_name!r}; valid types: {', '.join(OPTIMIZER_NAMES)}")


def _normalize_parameters(parameters) -> list:
    """A list of tensors or of param-group dicts (copied, betas made tuples)."""
    if isinstance(parameters, torch.Tensor):
        raise TypeError("parameters must be an iterable of tensors or param-group dicts, got a single tensor")
    items = list(parameters)
    groups: List[Any] = []
    for index, item in enumerate(items):
        if isinstance(item, dict):
            group = dict(item)
            _betas_to_tuple(group, f"param group {index}")
            groups.append(group)
        else:
            groups.append(item)
    return groups


def _betas_to_tuple(kwargs: dict, where: str) -> None:
    if "betas" in kwargs:
        betas = kwargs["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError(f"{where}.betas must be a pair [beta1, beta2], got {betas!r}")
        kwargs["betas"] = (float(betas[0]), float(betas[1]))


def _pop_bool(kwargs: dict, key: str, default: bool) -> bool:
    value = kwargs.pop(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"optimizer.params.{key} must be true or false, got {value!r}")
    return value


def _drop_deepspeed_flags(kwargs: dict) -> None:
    for key, supported in _DEEPSPEED_ONLY_FLAGS.items():
        if key in kwargs:
            value = kwargs.pop(key)
            if value != supported:
                raise ValueError(f"optimizer.params.{key}={value!r} is not supported (only {supported!r})")


def _import_cpu_adam(required: bool):
    try:
        from zeroengine.ops.adam import CPUAdam
    except ImportError as err:
        if required:
            raise RuntimeError(f"the CPUAdam op is unavailable (zeroengine.ops.adam.CPUAdam could not be "
                               f"imported: {err}); use optimizer type Adam/AdamW instead") from err
        return None
    return CPUAdam


def _construct(cls, groups: list, kwargs: dict, type_name: str, why: str = "") -> torch.optim.Optimizer:
    """``cls(groups, **kwargs)`` after checking every key is one ``cls`` accepts."""
    kwargs.setdefault("lr", DEFAULT_LR)
    # decoupled_weight_decay (torch.optim.Adam) is spelled adam_w_mode in DeepSpeed configs.
    accepted = [n for n in inspect.signature(cls.__init__).parameters
                if n not in ("self", "params", "decoupled_weight_decay", "adamw_mode", "state_dtype")]
    unknown = sorted(set(kwargs) - set(accepted) - {"adamw_mode", "state_dtype"})
    if unknown:
        raise OptimizerParamsError(f"optimizer.params.{unknown[0]}", f"not a parameter of {type_name}{why}: "
                                   f"unknown {unknown}; accepted: {', '.join(accepted)}")
    return cls(groups, **kwargs)
