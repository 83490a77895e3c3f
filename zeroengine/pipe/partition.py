"""Splitting a layer list into contiguous pipeline stages of balanced weight.

``partition_method`` (DeepSpeed's names): ``"uniform"`` balances the number of layers; ``"parameters"``
balances trainable parameter counts; ``"type:<regex>"`` balances the layers whose class name matches (e.g.
``"type:TransformerBlock"``: the same number of blocks per stage, the embedding and head riding along).
"""
from __future__ import annotations

import re

import torch


def balanced_parts(weights: list[float], num_parts: int) -> list[int]:
    """Stage boundaries ``[0, b1, ..., len(weights)]``: contiguous parts, none empty, with the heaviest part as
    light as possible (ties broken towards the earliest boundaries). Dynamic programming, O(parts · n²)."""
    n = len(weights)
    if num_parts < 1 or n < num_parts:
        raise ValueError(f"cannot split {n} layer(s) into {num_parts} non-empty pipeline stage(s)")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # cost[k][i]: the lightest heaviest part when the first i layers form k parts; cut[k][i]: where part k starts
    cost = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    cost[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                value = max(cost[k - 1][j], prefix[i] - prefix[j])
                if value < cost[k][i]:
                    cost[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def layer_weights(method: str, layers: list, count_params) -> list[float]:
    """Each layer's weight under ``method``; ``count_params(i)`` counts layer i's trainable parameters."""
    method_l = method.lower()
    if method_l == "uniform":
        return [1.0] * len(layers)
    if method_l == "parameters":
        return [float(count_params(i)) for i in range(len(layers))]
    if method_l.startswith("type:"):
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
        weights = [1.0 if pattern.search(_type_name(layer)) else 0.0 for layer in layers]
        if not any(weights):
            raise ValueError(f"partition_method {method!r}: no layer's class name matches "
                             f"(layers: {sorted({_type_name(layer) for layer in layers})})")
        return weights
    raise ValueError(f"partition_method {method!r} is not one of \"parameters\", \"uniform\", \"type:<regex>\"")


def _type_name(layer) -> str:
    from .spec import LayerSpec

    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, torch.nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)  # a plain function
