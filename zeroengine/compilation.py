"""``engine.compile()``: torch.compile block by block, at every ZeRO stage.

Note: why per block.
A transformer is a stack of identical blocks. Compiling each block's
``forward`` (torchtitan's and FSDP2's practice) keeps what runs between the
blocks eager, and the blocks share one compiled graph: their code and
shapes are the same and their parameters are graph inputs, not constants,
so compile time does not grow with depth.

At stage 3 it is also what makes compiling possible at all. The engine
gathers a module's parameters in Python hooks around its call, and a traced
region must not reach into them (they issue collectives and swap storage).
So before the blocks are compiled, stage 3 regroups its fetches
(:meth:`Stage3Hooks.fetch_whole`): each block's hooks gather every
parameter of the block before its compiled forward runs and free them
after, and the modules inside run without hooks: FSDP2's unit, a
``fully_shard``ed block. The hooks run outside the compiled region, in the
block's ``__call__``; the compiled ``forward`` sees plain, gathered
parameters.

The blocks are the children of the model's ``nn.ModuleList``s (the outermost
lists: a block's own lists stay inside it). A model without one: stages 0-2
compile the whole model's forward; stage 3 compiles each top-level child
that holds parameters (the top module's own forward stays eager, since its
hooks start every pass).
"""
from __future__ import annotations

import torch

from zeroengine.zero.blocks import find_blocks

_DEEPCOMPILE = ("DeepSpeed's DeepCompile (schedule=..., the compile config's deepcompile) is not supported: "
                "zeroengine compiles each block with torch.compile and keeps its ZeRO hooks outside the compiled "
                "regions")


def compile_targets(model: torch.nn.Module, stage: int) -> list[torch.nn.Module]:
    """What ``engine.compile()`` compiles: the blocks, else (see the module note) the model or its children."""
    blocks = find_blocks(model)
    if blocks:
        return blocks
    if stage < 3:
        return [model]
    return [child for child in model.children() if any(True for _ in child.parameters())]


def compile_forward(module: torch.nn.Module, backend, options: dict) -> None:
    """Replace ``module.forward`` by its compiled version; ``module.__call__`` (and its hooks) stays eager."""
    module.forward = torch.compile(module.forward, backend=backend, **options)


def check_supported(schedule, compiled_autograd_enabled: bool) -> None:
    if schedule is not None:
        raise ValueError(f"engine.compile(schedule=...): {_DEEPCOMPILE}")
    if compiled_autograd_enabled:
        raise ValueError("engine.compile(compiled_autograd_enabled=True) is not supported: the backward runs "
                         "through torch's autograd, each block's compiled backward included (ZeRO's gradient "
                         "hooks run between them)")
