"""Layer specifications: a layer described, to be built only on the pipeline stage that runs it.

``LayerSpec(nn.Linear, 512, 512)`` is DeepSpeed's: building a 100-layer model on every rank and then
throwing away the other stages' layers would need the whole model in every rank's memory, which is what
pipeline parallelism is there to avoid. ``TiedLayerSpec`` names a module that several stages use with
the same weights (a GPT's token embedding, reused transposed as the LM head on the last stage).
"""
from __future__ import annotations

from typing import Callable

import torch


class LayerSpec:
    """``typename(*module_args, **module_kwargs)``, built by :meth:`build` on the stage that holds it."""

    def __init__(self, typename: type, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, torch.nn.Module)):
            raise TypeError(f"LayerSpec: typename must be an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> torch.nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` parameter(s) are shared by every use of ``key``, on any stage.

    The first stage holding ``key`` owns the weights: its optimizer steps them with the sum of every use's
    gradient, and the other stages' copies take its values after each step. ``forward_fn(module, inputs)``,
    when given, replaces ``module(inputs)`` for this use (e.g. the embedding reused as the LM head)."""

    def __init__(self, key: str, typename: type, *module_args, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise ValueError(f"TiedLayerSpec: key must be a non-empty string, got {key!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"
