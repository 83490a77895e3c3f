"""Bytes of optimizer state per parameter shape, by optimizer type (the formulas of docs/concepts.md):
what ``estimate_memory(optimizer=...)`` predicts and ``engine.memory_breakdown()`` measures."""
from __future__ import annotations

import math

ELEMENTWISE_BYTES = {"Adam": 8, "AdamW": 8, "CPUAdam": 8, "FusedAdam": 8}  # two fp32 moments per element


def state_bytes(optimizer: str, shape: tuple[int, ...], params: dict | None = None, name: str = "") -> int:
    """fp32 optimizer state of one parameter of ``shape`` (named ``name`` in its model) under ``optimizer`` with
    ``params`` (its config params; step counters aside). Matrices are ``[..., rows, cols]``; anything of one
    dimension is a vector."""
    params = params or {}
    numel = math.prod(shape)
    if optimizer == "Muon":  # Muon's momentum for the matrices it steps, Adam's two moments for the rest
        from .muon import is_muon_parameter

        return (4 if is_muon_parameter(name, shape) else 8) * numel
    if optimizer in ELEMENTWISE_BYTES:
        return ELEMENTWISE_BYTES[optimizer] * numel
    if optimizer == "SGD":
        return 4 * numel if params.get("momentum", 0) else 0
    if optimizer == "Adafactor":  # a row and a column second moment per matrix; a vector's is per element
        from .adafactor import factored_sizes

        return 4 * (sum(factored_sizes(shape).values()) if len(shape) > 1 else numel)
    if optimizer == "SM3":  # one accumulator per index of each dimension (per element for a vector), momentum
        from .sm3 import accumulator_sizes

        accumulators = sum(accumulator_sizes(shape).values()) if len(shape) > 1 else numel
        return 4 * accumulators + (4 * numel if params.get("momentum", 0) else 0)
    raise ValueError(f"no state formula for optimizer {optimizer!r}; known: "
                     f"{', '.join([*ELEMENTWISE_BYTES, 'SGD', 'Adafactor', 'SM3', 'Muon'])}")


def needs_shapes(optimizer: str) -> bool:
    """Whether the state depends on the parameters' shapes (not only on their element count)."""
    return optimizer in ("Adafactor", "SM3", "Muon")
