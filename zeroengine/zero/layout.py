"""Pure shard maths: where every parameter element lives in the flat, sharded layout.

No tensors are moved and nothing is communicated here; stages 1-3 build their
buffers from these numbers.

The layout (see "Note: bucket-major sharding" below):

* parameters are grouped, in a fixed order, into *buckets* of at most
  ``bucket_numel`` elements (a larger parameter gets a bucket of its own);
* each bucket is one contiguous range of the flat buffer, padded so it splits
  into ``world`` equal *chunks* of a multiple of ``align`` elements;
* rank r owns chunk r of every bucket; its shard is those chunks.

Note: bucket-major sharding. Sharding each bucket (rather than the whole flat
buffer once) makes every bucket's gradient reduction one exact reduce-scatter
(input: the bucket, output: this rank's chunk) and every parameter refresh one
exact all-gather, with no gather/scatter copies and a communication volume of
Ψ(N-1)/N elements each way plus at most N·align-1 padding elements per bucket.
Buckets also bound the temporary memory of a reduction to one bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place: index into the parameter list, start in the flat buffer, size."""

    index: int
    flat_start: int
    numel: int

    @property
    def flat_end(self) -> int:
        return self.flat_start + self.numel


class Piece(NamedTuple):
    """The part of one parameter that falls in one rank's chunk."""

    slot: ParamSlot
    param_start: int  # within the parameter (flattened)
    param_end: int
    chunk_start: int  # within the rank's chunk

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class Bucket:
    index: int
    flat_start: int  # start of this bucket in the flat buffer
    numel: int  # real elements (before padding)
    padded_numel: int  # divisible by world * align
    slots: tuple[ParamSlot, ...]
    world: int

    @property
    def chunk_numel(self) -> int:
        return self.padded_numel // self.world

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """Flat-buffer range of ``rank``'s chunk of this bucket."""
        start = self.flat_start + rank * self.chunk_numel
        return start, start + self.chunk_numel

    def piece(self, slot: ParamSlot, rank: int) -> Piece | None:
        """The part of ``slot``'s parameter in ``rank``'s chunk of this bucket, or None."""
        lo, hi = self.chunk_range(rank)
        a, b = max(lo, slot.flat_start), min(hi, slot.flat_end)
        if a >= b:
            return None
        return Piece(slot, a - slot.flat_start, b - slot.flat_start, a - lo)

    def pieces_in_chunk(self, rank: int) -> list[Piece]:
        """One piece for each parameter overlapping ``rank``'s chunk, in layout order."""
        return [p for p in (self.piece(slot, rank) for slot in self.slots) if p is not None]


@dataclass(frozen=True)
class FlatLayout:
    buckets: tuple[Bucket, ...]
    world: int
    total_numel: int  # flat buffer size, padding included
    param_numel: int  # real parameter elements

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns (its chunks of every bucket)."""
        return self.total_numel // self.world

    def slot_of(self) -> dict[int, ParamSlot]:
        return {s.index: s for b in self.buckets for s in b.slots}

    def bucket_of_param(self) -> dict[int, int]:
        return {s.index: b.index for b in self.buckets for s in b.slots}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_layout(numels: list[int], world: int, bucket_numel: int, align: int = 16,
                 segments: list[int] | None = None) -> FlatLayout:
    """Lay out parameters of sizes ``numels`` in the order given.

    ``align`` (elements) keeps every chunk start SIMD- and cache-line-aligned.
    ``segments[i]`` (optional) names the unit parameter i belongs to; a bucket
    never spans two units, so stage 3 can gather one module's parameters
    without touching its neighbours'.
    """
    if segments is not None and len(segments) != len(numels):
        raise ValueError("segments must give one unit id per parameter")
    if world < 1 or bucket_numel < 1 or align < 1:
        raise ValueError(f"world ({world}), bucket_numel ({bucket_numel}) and align ({align}) must be positive")
    unit = world * align
    buckets: list[Bucket] = []
    pending: list[int] = []
    offset = 0

    def close() -> None:
        nonlocal offset, pending
        if not pending:
            return
        slots, start = [], offset
        for i in pending:
            slots.append(ParamSlot(i, start, numels[i]))
            start += numels[i]
        real = start - offset
        padded = max(_round_up(real, unit), unit)
        buckets.append(Bucket(len(buckets), offset, real, padded, tuple(slots), world))
        offset += padded
        pending = []

    filled = 0
    for i, n in enumerate(numels):
        new_unit = segments is not None and pending and segments[i] != segments[pending[0]]
        if pending and (filled + n > bucket_numel or new_unit):
            close()
            filled = 0
        pending.append(i)
        filled += n
    close()
    return FlatLayout(tuple(buckets), world, offset, sum(numels))
