"""Per-collective call and byte counters.

Every collective in zeroengine goes through :mod:`zeroengine.comm.collectives`,
which records two sizes here:

* ``payload_bytes``: the bytes of the tensor handed to the collective (what a
  user would call "the message").
* ``wire_bytes``: the bytes each rank sends under a bandwidth-optimal ring
  algorithm, the quantity the ZeRO paper reasons with. For N ranks and a
  payload of S bytes: all-reduce 2S(N-1)/N; reduce-scatter (S = full input)
  and all-gather (S = full output) S(N-1)/N each; broadcast S; all-to-all
  S(N-1)/N. This is what lets a test check "stage 2 communicates exactly as
  much as plain data parallel" without timing anything.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class OpCount:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0


@dataclass
class CommCounters:
    ops: dict[str, OpCount] = field(default_factory=lambda: defaultdict(OpCount))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, op: str, payload_bytes: int, wire_bytes: float) -> None:
        with self._lock:
            entry = self.ops[op]
            entry.calls += 1
            entry.payload_bytes += payload_bytes
            entry.wire_bytes += wire_bytes

    def reset(self) -> None:
        with self._lock:
            self.ops = defaultdict(OpCount)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A plain-dict copy, safe to keep while counting goes on."""
        with self._lock:
            return {op: vars(c).copy() for op, c in self.ops.items()}

    def total_wire_bytes(self) -> float:
        with self._lock:
            return sum(c.wire_bytes for c in self.ops.values())

    def total_payload_bytes(self) -> int:
        with self._lock:
            return sum(c.payload_bytes for c in self.ops.values())


def ring_wire_bytes(op: str, payload_bytes: int, world: int) -> float:
    """Bytes one rank sends for ``op`` under a ring algorithm (see module doc)."""
    if world <= 1:
        return 0.0
    share = (world - 1) / world
    if op == "all_reduce":
        return 2.0 * payload_bytes * share
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return payload_bytes * share
    if op == "broadcast":
        return float(payload_bytes)
    return 0.0


# One process-wide counter: the engine, benchmarks and tests all read this one.
counters = CommCounters()
