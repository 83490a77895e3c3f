"""The value "auto": where it is accepted and what it becomes.

HuggingFace's DeepSpeed integration writes ``"auto"`` into template configs
and fills the values from its Trainer arguments and the model. zeroengine has
no Trainer, so each "auto" below resolves either from the model (its
``hidden_size``) or from the rest of the config, or else to the fixed value in
the table below, with a warning naming the key and the value (a fixed guess,
e.g. an lr of 1e-3, is not what a Trainer would have chosen for this run).
"auto" anywhere else is an error (see ``translate.py``); the batch keys are
resolved by the batch-size triangle in ``batch.py``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from .errors import ConfigError
from .sections.zero import ZeroConfig

logger = logging.getLogger(__name__)


class AutoContext(NamedTuple):
    data: Dict[str, Any]          # the whole raw config, "auto"s above this rule already resolved
    hidden_size: Optional[int]    # the model's hidden size, when known


class AutoRule(NamedTuple):
    path: str
    becomes: str                  # for the reference
    resolve: Callable[[AutoContext], Any]
    derived: bool = False         # from the model or the rest of the config (no warning)


def _zero_default(key: str) -> Any:
    return ZeroConfig.model_fields[key].default


def _from_hidden(key: str, formula: Callable[[int], int]) -> Callable[[AutoContext], int]:
    def resolve(ctx: AutoContext) -> int:
        return formula(ctx.hidden_size) if ctx.hidden_size is not None else _zero_default(key)
    return resolve


def _optimizer_lr(ctx: AutoContext) -> Any:
    """The lr the optimizer will get; None (each param group's own lr) without an optimizer section."""
    optimizer = ctx.data.get("optimizer")
    if not isinstance(optimizer, dict):
        return None
    params = optimizer.get("params")
    return params.get("lr", 1e-3) if isinstance(params, dict) else 1e-3


def _cannot_infer(ctx: AutoContext) -> Any:
    raise ConfigError("scheduler.params.total_num_steps",
                      "'auto' cannot be resolved outside a trainer (zeroengine does not know how many steps "
                      "you will train); set the number of optimizer steps")


AUTO_RULES: List[AutoRule] = [
    AutoRule("gradient_clipping", "1.0", lambda ctx: 1.0),
    AutoRule("optimizer.params.lr", "1e-3", lambda ctx: 1e-3),
    AutoRule("optimizer.params.betas", "[0.9, 0.999]", lambda ctx: [0.9, 0.999]),
    AutoRule("optimizer.params.eps", "1e-8", lambda ctx: 1e-8),
    AutoRule("optimizer.params.weight_decay", "0.0", lambda ctx: 0.0),
    # Must come after optimizer.params.lr, which it reads.
    AutoRule("scheduler.params.warmup_min_lr", "0", lambda ctx: 0.0),
    AutoRule("scheduler.params.warmup_max_lr", "optimizer.params.lr (1e-3 if not set; each param group's "
             "own lr without an optimizer section)", _optimizer_lr, derived=True),
    AutoRule("scheduler.params.warmup_num_steps", "0 (no warmup)", lambda ctx: 0),
    AutoRule("scheduler.params.total_num_steps", "an error: it cannot be inferred; set it", _cannot_infer),
    AutoRule("fp16.enabled", "false", lambda ctx: False),
    AutoRule("bf16.enabled", "false", lambda ctx: False),
    AutoRule("zero_optimization.reduce_bucket_size", "hidden_size * hidden_size (default without "
             "hidden_size)", _from_hidden("reduce_bucket_size", lambda h: h * h), derived=True),
    AutoRule("zero_optimization.stage3_prefetch_bucket_size", "int(0.9 * hidden_size * hidden_size) "
             "(default without hidden_size)", _from_hidden("stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h)),
             derived=True),
    AutoRule("zero_optimization.stage3_param_persistence_threshold", "10 * hidden_size (default without "
             "hidden_size)", _from_hidden("stage3_param_persistence_threshold", lambda h: 10 * h), derived=True),
]


def resolve_auto(data: Dict[str, Any], hidden_size: Optional[int]) -> None:
    """Replace every accepted "auto" in ``data`` (the raw top-level dict) in place."""
    ctx = AutoContext(data, hidden_size)
    for rule in AUTO_RULES:
        *parents, key = rule.path.split(".")
        block: Any = data
        for part in parents:
            block = block.get(part) if isinstance(block, dict) else None
        if isinstance(block, dict) and isinstance(block.get(key), str) and block[key] == "auto":
            block[key] = rule.resolve(ctx)
            if not rule.derived:
                logger.warning('config: %s "auto" -> %r (a fixed default: zeroengine has no trainer to fill it '
                               'in; set the value to choose it)', rule.path, block[key])
