"""Tensor-parallel parameters in a checkpoint: each rank's piece stored under its own name, merged on load.

A parameter split across T tensor-parallel ranks (zeroengine.tensor_parallel) is stored as T tensors,
``<name>@tp<r>/<T>``, each in its own (piece) layout, with the :class:`TensorSplit` that cut it in the
manifest's parameter table. Loading at the same T reads a piece as any other parameter; at another T (or
with no tensor parallelism, or into ``ze_to_fp32``'s state_dict) the pieces are merged into the full tensor,
value and optimizer moments alike, and cut again the new way, one parameter at a time.
"""
from __future__ import annotations

import math
import re

import torch

from zeroengine.tensor_parallel.layers import TensorSplit

_PIECE = re.compile(r"^(?P<base>.+)@tp(?P<rank>\d+)/(?P<parts>\d+)$")


def piece_name(name: str, split: TensorSplit) -> str:
    return f"{name}@tp{split.rank}/{split.parts}"


def base_name(stored: str) -> str:
    match = _PIECE.match(stored)
    return match["base"] if match else stored


def stored_pieces(params: dict, base: str) -> list[str] | None:
    """The stored names that make up parameter ``base`` in a manifest's ``params``: itself when stored whole,
    its tensor-parallel pieces in rank order, or None when it is not there."""
    if base in params:
        return [base]
    pieces = sorted(((int(m["rank"]), int(m["parts"]), n) for n in params
                     if (m := _PIECE.match(n)) and m["base"] == base))
    if not pieces:
        return None
    parts = pieces[0][1]
    if [r for r, _, _ in pieces] != list(range(parts)) or any(p != parts for _, p, _ in pieces):
        return None  # an incomplete or mixed set of pieces: reported as missing
    return [n for _, _, n in pieces]


def full_shape_of(params: dict, names: list[str]) -> list[int]:
    info = params[names[0]]
    return list(info["split"]["full_shape"]) if "split" in info else list(info["shape"])


def merge(params: dict, names: list[str], flats: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the stored flat tensors of ``names`` (one whole, or every piece)."""
    if len(names) == 1 and "split" not in params[names[0]]:
        return flats[0].view(params[names[0]]["shape"])
    split = TensorSplit.from_dict(params[names[0]]["split"])
    return split.merge([f.view(params[n]["shape"]) for n, f in zip(names, flats)])


def numel(params: dict, name: str) -> int:
    return math.prod(params[name]["shape"])
