"""Matrix-wise optimizers under ZeRO: what a partition tells them, and how a flat piece maps onto its matrix.

Adafactor and SM3 keep statistics per row and per column of a matrix, not per element. ZeRO stages 1-3 hand
an optimizer flat 1-D *pieces*: the contiguous range of a parameter's flattened elements that falls in this
rank's chunk. Stepping such a piece as if it were the parameter silently computes something else (a factored
moment of a 1-D tensor is an unfactored one). The optimizers built on :class:`PartitionAware` instead

* know, for each piece, the whole parameter's shape and where the piece lies in it (:class:`PieceOf`);
* add up (or take the maximum of) their row, column and norm statistics over the pieces they hold, and then
  over the ranks that partition the parameter (:meth:`PartitionAware.reduce`): every rank ends with the
  statistics of the whole matrix, O(rows + cols) numbers per matrix, and updates only its own elements.

Why reductions rather than gathering whole matrices: the statistics are 1/min(rows, cols) of the matrix (a
1.3B GPT's matrices have 2048 or more of each: under 0.1% of the bytes a gather of the gradients would move),
every rank's work stays its own elements, and no rank ever holds a whole matrix it does not own.

Collectives must pair across ranks, and a rank may hold no piece of a parameter (or of a whole bucket). So the
statistics are laid out by a *catalog* every rank has alike: the parameters of the buckets being stepped, in
bucket order. The engine says which buckets a step covers (:func:`stepping`): all resident ones in one call,
and each offloaded bucket in its own call of the streamed CPU step. Without a partition (stage 0, or a plain
PyTorch loop) each parameter is its own piece and nothing is reduced.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from zeroengine.ops.optimizer_protocol import run_closure


@dataclass(frozen=True)
class PieceOf:
    """Where a stepped tensor lies: elements [start, end) of the flattened parameter ``key`` of ``shape``."""

    key: int
    shape: tuple[int, ...]
    start: int
    end: int
    bucket: int = 0

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == math.prod(self.shape)


@dataclass
class Partition:
    """What the ZeRO optimizer attaches: each piece's place (by ``id`` of the stepped tensor), each bucket's
    parameters as ``(key, shape)`` (identical on every rank), and the reduction over the partitioning group."""

    places: dict[int, PieceOf]
    bucket_params: list[list[tuple[int, tuple[int, ...]]]]
    reduce: Callable[[torch.Tensor, dist.ReduceOp], None]
    stepping: list[int] | None = None  # the buckets the current step() covers (None: all)
    muon_keys: frozenset = frozenset()  # parameters in Muon's groups (zeroengine/optim/muon.py)
    heads: dict = dataclasses.field(default_factory=dict)  # key -> per_head_muon's head count

    def catalog(self) -> list[tuple[int, tuple[int, ...]]]:
        buckets = range(len(self.bucket_params)) if self.stepping is None else self.stepping
        return [entry for b in buckets for entry in self.bucket_params[b]]


class PartitionAware(torch.optim.Optimizer):
    """Base of optimizers whose update needs whole-parameter statistics (see the module doc)."""

    # State keys that describe the whole parameter (not one value per element): a checkpoint stores them once
    # per piece, whole, and gives them back to every piece of the parameter, whatever the partition.
    whole_parameter_state: tuple[str, ...] = ()

    partition: Partition | None = None

    def attach_partition(self, partition: Partition) -> None:
        self.partition = partition

    def place_of(self, p: torch.Tensor) -> PieceOf:
        if self.partition is not None:
            return self.partition.places[id(p)]
        return PieceOf(id(p), tuple(p.shape), 0, p.numel())

    def stepped(self) -> list[tuple[dict, torch.Tensor, PieceOf]]:
        """(group, piece, place) of every piece with a gradient in the buckets this step covers."""
        out = []
        wanted = None if self.partition is None or self.partition.stepping is None else set(self.partition.stepping)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                place = self.place_of(p)
                if wanted is None or place.bucket in wanted:
                    out.append((group, p, place))
        return out

    def catalog(self, stepped) -> list[tuple[int, tuple[int, ...]]]:
        """The parameters whose statistics this step reduces, in an order every rank shares."""
        if self.partition is not None:
            return self.partition.catalog()
        return [(place.key, place.shape) for _, _, place in stepped]

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        stepped = self.stepped()
        # (where the step's statistics live: the pieces' device, or the host on a rank with none this call)
        self.step_pieces(stepped, stepped[0][1].device if stepped else torch.device("cpu"))
        return loss

    def step_pieces(self, stepped: list, device: torch.device) -> None:
        """Step ``stepped`` (see :meth:`stepped`); every rank calls it, with or without pieces."""
        raise NotImplementedError

    def reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """Sum (or max) ``tensor`` over the ranks partitioning the parameters, in place."""
        if self.partition is not None:
            self.partition.reduce(tensor, op)


@contextlib.contextmanager
def stepping(optimizer, buckets: list[int]):
    """Within the block, ``optimizer.step()`` covers these buckets (a no-op for elementwise optimizers)."""
    partition = getattr(optimizer, "partition", None)
    if partition is None:
        yield
        return
    before, partition.stepping = partition.stepping, list(buckets)
    try:
        yield
    finally:
        partition.stepping = before


def blocks(shape: tuple[int, ...], start: int, end: int) -> Iterator[tuple[tuple[slice, ...], tuple[int, ...]]]:
    """Cut elements [start, end) of a row-major tensor of ``shape`` into boxes, in order: each is
    ``(index, sizes)``, ``tensor[index]`` being that box of ``sizes`` (at most 2 per dimension)."""
    if start >= end:
        return
    if len(shape) == 1:
        yield (slice(start, end),), (end - start,)
        return
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(end, inner)
    if first == last:  # inside one outer index
        for index, sizes in blocks(shape[1:], head, tail):
            yield (slice(first, first + 1), *index), (1, *sizes)
        return
    if head:
        for index, sizes in blocks(shape[1:], head, inner):
            yield (slice(first, first + 1), *index), (1, *sizes)
        first += 1
    if last > first:
        yield (slice(first, last), *(slice(0, n) for n in shape[1:])), (last - first, *shape[1:])
    if tail:
        for index, sizes in blocks(shape[1:], 0, tail):
            yield (slice(last, last + 1), *index), (1, *sizes)


def boxes_of(flat: torch.Tensor, place: PieceOf):
    """``(index, box)`` of the piece's values ``flat`` (1-D, elements start..end of the parameter): each box a
    view of ``flat`` shaped as that part of the parameter."""
    offset = 0
    for index, sizes in blocks(place.shape, place.start, place.end):
        n = math.prod(sizes)
        yield index, flat[offset:offset + n].view(sizes)
        offset += n


class StatLayout:
    """Offsets of per-parameter statistics in one flat tensor, for a catalog: ``sizes(shape)`` names each
    statistic of a parameter and its element count, the same on every rank."""

    def __init__(self, catalog, sizes: Callable[[tuple[int, ...]], dict[str, int]]):
        self.offsets: dict[int, dict[str, tuple[int, int]]] = {}
        total = 0
        for key, shape in catalog:
            entry = {}
            for name, n in sizes(shape).items():
                entry[name] = (total, n)
                total += n
            self.offsets[key] = entry
        self.numel = total

    def view(self, flat: torch.Tensor, key: int, name: str) -> torch.Tensor:
        start, n = self.offsets[key][name]
        return flat[start:start + n]
