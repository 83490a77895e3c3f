"""Debug mode: check that every rank issues the same sequence of collectives.

A rank that skips or reorders a collective normally shows up as a silent hang:
the others wait forever inside the collective. With the check on
(``"comm_debug": true`` in the config or ``ZEROENGINE_COMM_DEBUG=1``), each
rank first posts a fingerprint of the collective it is about to run (op, dtype,
size, call site) to the process group's key-value store under its sequence
number, then waits, with a timeout, for every peer's fingerprint of the same
number. Two outcomes replace the hang:

* the fingerprints differ: a :class:`CollectiveMismatchError` lists, per rank,
  the op and call site it issued;
* some ranks never post within the timeout: the error names them and shows the
  last collective each of them did reach.

The store is a side channel (no collective is used to check collectives), so
the check itself cannot deadlock. It costs a few store round-trips per
collective, which is why it is a debug mode.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from datetime import timedelta

_THIS_PACKAGE = os.path.dirname(os.path.abspath(__file__))


class CollectiveMismatchError(RuntimeError):
    """Ranks disagree on (or fail to reach) the next collective."""


@dataclass(frozen=True)
class Fingerprint:
    op: str
    dtype: str
    numel: int
    callsite: str
    sizes_must_match: bool = True
    # What the collective is for, when the caller says (comm.collective_context), e.g. the stage-3
    # module whose parameters are gathered; two labelled collectives must carry the same label.
    label: str = ""

    def encode(self) -> bytes:
        label = self.label.replace("|", "/")
        return f"{self.op}|{self.dtype}|{self.numel}|{int(self.sizes_must_match)}|{label}|{self.callsite}".encode()

    @staticmethod
    def decode(raw: bytes) -> "Fingerprint":
        op, dtype, numel, must, label, callsite = raw.decode().split("|", 5)
        return Fingerprint(op, dtype, int(numel), callsite, bool(int(must)), label)

    def describe(self) -> str:
        label = f" for {self.label}" if self.label else ""
        return f"{self.op}({self.dtype}[{self.numel}]){label} at {self.callsite}"

    def agrees_with(self, other: "Fingerprint") -> bool:
        same_kind = self.op == other.op and self.dtype == other.dtype
        if self.label and other.label and self.label != other.label:
            return False
        if not (self.sizes_must_match and other.sizes_must_match):
            return same_kind
        return same_kind and self.numel == other.numel


def caller_site() -> str:
    """The first stack frame outside zeroengine.comm: the code that asked for the collective."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(frame.filename).startswith(_THIS_PACKAGE):
            return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return "<unknown>"


class CollectiveSequenceChecker:
    """Per-process checker; one sequence counter per process group."""

    def __init__(self, store, rank: int, timeout_s: float, generation: int = 0):
        self.store = store
        self.rank = rank
        self.timeout = timedelta(seconds=timeout_s)
        self._seq: dict[str, int] = {}
        # Each checker counts from 0 again: its keys must not meet an earlier checker's in the store.
        self._ns = f"g{generation}"

    def check(self, group_key: str, group_ranks: list[int], fp: Fingerprint) -> None:
        seq = self._seq.get(group_key, 0)
        self._seq[group_key] = seq + 1
        prefix = f"ze_seq/{self._ns}/{group_key}/{seq}"
        self.store.set(f"{prefix}/{self.rank}", fp.encode())
        self.store.set(f"ze_last/{self._ns}/{group_key}/{self.rank}", f"#{seq} {fp.describe()}".encode())
        keys = [f"{prefix}/{r}" for r in group_ranks]
        try:
            self.store.wait(keys, self.timeout)
        except Exception:  # the store raises a plain RuntimeError/DistStoreError on timeout
            raise CollectiveMismatchError(self._describe_missing(group_key, group_ranks, seq, fp)) from None
        prints = {r: Fingerprint.decode(self.store.get(f"{prefix}/{r}")) for r in group_ranks}
        if not all(p.agrees_with(fp) for p in prints.values()):
            lines = "\n".join(f"  rank {r}: {p.describe()}" for r, p in sorted(prints.items()))
            raise CollectiveMismatchError(
                f"ranks issued different collectives as #{seq} in group {group_key}:\n{lines}"
            )

    def _describe_missing(self, group_key: str, group_ranks: list[int], seq: int, fp: Fingerprint) -> str:
        prefix = f"ze_seq/{self._ns}/{group_key}/{seq}"
        missing = [r for r in group_ranks if not self.store.check([f"{prefix}/{r}"])]
        lines = []
        for r in missing:
            last_key = f"ze_last/{self._ns}/{group_key}/{r}"
            last = self.store.get(last_key).decode() if self.store.check([last_key]) else "none yet"
            lines.append(f"  rank {r}: last collective reached: {last}")
        return (
            f"rank {self.rank} waited {self.timeout.total_seconds():.0f}s at collective #{seq} "
            f"{fp.describe()} in group {group_key}, but ranks {missing} never issued it "
            f"(a code path taken on some ranks only?):\n" + "\n".join(lines)
        )
