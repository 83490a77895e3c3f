"""A model's *blocks*: the repeated layers (a transformer's), found as the children of its ``nn.ModuleList``s.

Stage 3 can fetch a block's parameters as one (``stage3_fetch_unit: "block"``), and ``engine.compile()``
compiles block by block; both take their blocks from here."""
from __future__ import annotations

import torch


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the model's outermost ``nn.ModuleList``s, in order (a block's own lists stay inside it)."""
    blocks: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList):
                blocks.extend(child)
            else:
                visit(child)

    visit(model)
    return blocks
