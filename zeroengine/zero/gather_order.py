"""Stage 3: check, before each parameter fetch, that every rank is at the same point.

Why: ranks that take different code paths (a module skipped on one rank)
issue their k-th all-gather for different buckets. If the sizes differ,
gloo aborts the whole process from a background thread ("Received data size
doesn't match expected size"), which Python cannot catch, and NCCL hangs;
if they happen to match, the gathers pair silently and every rank trains on
a mix of two layers' weights. Neither says which module diverged.

So every rank contributes a few integers to a tiny all-gather on a gloo
group of its own (a host-side round trip, never queued behind the device's
work, and always the same size, so it cannot itself mismatch) at two kinds
of points:

* each *fetch event* of the stage-3 hooks (a module about to run forward or
  backward): the module, the phase and the units it needs. Checking events
  rather than gathers matters once prefetch replays the recorded order: a
  module whose parameters were fetched ahead gathers nothing itself, so a
  rank that runs a different module there would otherwise go on unseen
  until the ranks' collectives no longer pair (a hang until the deadline,
  named at an unrelated gather). The gathers an event starts (its own and
  the prefetches) follow from the events and the recorded trace, which are
  the same on every rank once the events agree, so they are not checked again.
* each gather outside the hooks (GatheredParameters, checkpoint and
  full-value reads): the buffer and bucket.

When the ranks' rows differ, every rank raises the same error naming what
each rank was about to do, before any real collective can abort or pair
wrongly. A rank that runs other collectives instead (it skipped the rest of
forward) leaves the others waiting here until the collective timeout, which
then names this rank's module and check number.

``ZEROENGINE_STAGE3_ORDER_CHECK=0`` turns the check off; under ``comm_debug``
it stands aside, since that mode compares every collective (labels included).
"""
from __future__ import annotations

import os
import zlib
from contextlib import contextmanager

import torch

from zeroengine import comm
from zeroengine.comm.groups import new_group
from zeroengine.comm.handshake import default_timeout_s

from .layout import Bucket

# What GatheredParameters gathers for: known to every rank, so a rank that never entered the block can
# still name it when a peer did.
GATHERED_PARAMETERS_LABEL = "zeroengine.zero.GatheredParameters (collective: every rank must enter it)"


class Stage3DivergenceError(RuntimeError):
    """Ranks were about to fetch stage-3 parameters for different modules or buckets."""


def enabled() -> bool:
    raw = os.environ.get("ZEROENGINE_STAGE3_ORDER_CHECK", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"ZEROENGINE_STAGE3_ORDER_CHECK must be 0 or 1, got {raw!r}")
    return raw == "1"


class GatherOrderCheck:
    """Collective at construction (creates a gloo group over the world): every rank builds one, in step."""

    # A row: [check number, kind, buffer tag, bucket, label hash, phase, hash of the event's units].
    _GATHER, _EVENT = 0, 1

    def __init__(self, bucket_names: dict[int, list[list[str]]]):
        """``bucket_names[tag][b]``: the parameter names in bucket ``b`` of the buffer tagged ``tag``."""
        self.bucket_names = bucket_names
        self.world = comm.get_world_size()
        self.rank = comm.get_rank()
        # its own timeout: the handshake deadline (ZEROENGINE_HANDSHAKE_TIMEOUT, else the comm timeout)
        self.group = new_group(list(range(self.world)), backend="gloo", timeout_s=default_timeout_s())
        self.count = 0
        self._covered = False  # inside a checked fetch event: its gathers follow from it
        # hash -> label, for naming what other ranks gathered for
        self._labels: dict[int, str] = {zlib.crc32(GATHERED_PARAMETERS_LABEL.encode()): GATHERED_PARAMETERS_LABEL}

    def verify(self, tag: int, bucket: Bucket, label: str) -> None:
        """Before a gather: every rank gathers this bucket now, or all raise."""
        if self._covered:
            return
        self._check(self._GATHER, tag, bucket.index, label, units_key=0)

    @contextmanager
    def event(self, module: str, phase: str, first: tuple[int, int], units: tuple[int, ...]):
        """A stage-3 fetch event (``module`` about to run its ``phase``; ``first`` = (buffer tag, bucket) of
        the first unit it needs, ``units`` all of them): every rank is at the same event, or all raise.
        The gathers inside the block are not checked again (see the module docstring)."""
        self._check(self._EVENT, *first, f"module {module} ({phase})", zlib.crc32(repr(units).encode()))
        self._covered = True
        try:
            yield
        finally:
            self._covered = False

    def _check(self, kind: int, tag: int, bucket: int, label: str, units_key: int) -> None:
        if comm.sequence_check_active():  # comm_debug compares every collective, with its label, already
            return
        self.count += 1
        key = zlib.crc32(label.encode())
        self._labels.setdefault(key, label)
        phase = next((i for i, p in enumerate(_PHASES) if label.endswith(f"({p})")), -1)
        mine = torch.tensor([self.count, kind, tag, bucket, key, phase, units_key], dtype=torch.int64)
        everyone = torch.empty(self.world * mine.numel(), dtype=torch.int64)
        try:
            comm.control_all_gather(everyone, mine, group=self.group)
        except RuntimeError as exc:  # a peer never came (it ran other collectives) or died
            raise Stage3DivergenceError(
                f"rank {self.rank}: stage-3 check #{self.count} ({self._describe(*mine.tolist()[1:])}) "
                f"was not joined by every rank ({exc}). A rank that skipped the rest of this pass, or runs other "
                f"collectives, leaves the others waiting: every rank must run the same modules in the same order. "
                f"Run with \"comm_debug\": true to name every rank's collective.") from exc
        rows = everyone.view(self.world, -1).tolist()
        if all(_agree(row, rows[0]) for row in rows):
            return
        lines = [f"  rank {r}: {self._describe(*row[1:])}" for r, row in enumerate(rows)]
        raise Stage3DivergenceError(
            f"rank {self.rank}: ranks diverged at stage-3 check #{self.count}; each was about to fetch parameters "
            "for something else:\n" + "\n".join(lines) + "\nEvery rank must run the same modules in the same "
            "order (a module skipped or called on some ranks only, e.g. under a data-dependent branch, "
            "desynchronises stage 3's gathers; Hugging Face generate() on several ranks needs synced_gpus=True, "
            "so a rank that finishes early keeps running forwards with the others). Nothing was gathered: the "
            "step cannot continue.")

    def _describe(self, kind: int, tag: int, bucket: int, key: int, phase: int, _units_key: int) -> str:
        names = self.bucket_names.get(tag, [])
        params = names[bucket] if 0 <= bucket < len(names) else ["?"]
        shown = ", ".join(params[:4]) + (f", ... ({len(params)} parameters)" if len(params) > 4 else "")
        where = f"{'frozen ' if tag else ''}bucket {bucket} [{shown}]"
        purpose = self._labels.get(key)
        if purpose is None:  # a label this rank never used: name the module from its parameters' names
            owner = _common_module(params)
            purpose = f"module {owner} ({_PHASES[phase]})" if owner and phase >= 0 else "a use this rank never made"
        if kind == self._EVENT:
            return f"{purpose}, needing {where}"
        return f"{where} for {purpose}"


def _agree(row: list[int], other: list[int]) -> bool:
    """Two ranks' rows pair: the same gather (kind, buffer, bucket), or for an event also the same module,
    phase and units."""
    if row[1:4] != other[1:4]:
        return False
    return row[1] == GatherOrderCheck._GATHER or row[4:] == other[4:]


_PHASES = ("forward", "backward")


def _common_module(param_names: list[str]) -> str:
    paths = [n.split(".")[:-1] for n in param_names]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
