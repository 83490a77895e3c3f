"""Stage 3: check that every rank fetches parameters for the same modules in the same order.

Why: ranks that take different code paths (a module skipped on one rank)
issue their k-th all-gather for different buckets. If the sizes differ,
gloo aborts the whole process from a background thread ("Received data size
doesn't match expected size"), which Python cannot catch, and NCCL hangs;
if they happen to match, the gathers pair silently and every rank trains on
a mix of two layers' weights. Neither says which module diverged.

What is compared: a *row* of a few integers per point, on a gloo group of
the check's own (host-side, never queued behind the device's work, always
the same size, so it cannot itself mismatch):

* each *fetch event* of the stage-3 hooks (a module about to run forward or
  backward): the module, the phase and the units it needs. Events rather
  than gathers, because prefetch replays the recorded order: a module whose
  parameters were fetched ahead gathers nothing itself. The gathers an
  event starts follow from the events and the recorded trace, which are the
  same on every rank once the events agree, so they are not checked again;
* each gather outside the hooks (GatheredParameters, checkpoint and
  full-value reads): the buffer and bucket.

When, is the cost: a host round trip whose latency grows with the world size.

* *per event* (``ZEROENGINE_STAGE3_ORDER_CHECK=event``; and in every pass that
  records the fetch order, the first one and any after the order changed, or
  that runs without autograd): each row is all-gathered before its fetch. A
  divergence is named before any data collective can abort or pair wrongly,
  and a rank that runs other collectives instead is named at the check's
  deadline.
* *per pass* (the default once the order is recorded and replayed): each
  rank keeps its rows, and the end of the pass (the end of backward, before
  any optimizer step can use its gradients) compares their count and CRC:
  one 16-byte all-gather per pass whatever the model's module count. On a mismatch the ranks exchange their rows to name, for each rank,
  the first point where they differ; the step is never applied. Between the
  divergence and the pass's end the data collectives may pair wrongly (then
  the comparison names it) or, with different sizes, abort (gloo) or hang
  (NCCL): the per-event mode names those at the module.
* gathers outside a pass are always checked when they happen (they are not
  part of a training step's steady state).

``ZEROENGINE_STAGE3_ORDER_CHECK=0`` turns the check off; under ``comm_debug``
it stands aside, since that mode compares every collective (labels included)
before it runs.
"""
from __future__ import annotations

import os
import struct
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


_MODES = {"0": "off", "1": "pass", "pass": "pass", "event": "event"}


def mode() -> str:
    """``ZEROENGINE_STAGE3_ORDER_CHECK``: "pass" (default, also "1"), "event", or "off" ("0")."""
    raw = os.environ.get("ZEROENGINE_STAGE3_ORDER_CHECK", "1")
    if raw not in _MODES:
        raise ValueError(f"ZEROENGINE_STAGE3_ORDER_CHECK must be 0, 1 (per pass), pass or event, got {raw!r}")
    return _MODES[raw]


def enabled() -> bool:
    return mode() != "off"


_ROW_LEN = 6  # kind, buffer tag, bucket, label hash, phase, hash of the event's units
_ROW = struct.Struct(f"<{_ROW_LEN}q")  # a row as the pass's CRC folds it


class GatherOrderCheck:
    """Collective at construction (creates a gloo group over the world): every rank builds one, in step."""

    # A row: [kind, buffer tag, bucket, label hash, phase, hash of the event's units].
    _GATHER, _EVENT = 0, 1

    def __init__(self, bucket_names: dict[int, list[list[str]]], per_event: bool = False,
                 buffer_labels: dict[int, str] | None = None):
        """``bucket_names[tag][b]``: the parameter names in bucket ``b`` of the buffer tagged ``tag``;
        ``per_event``: check every row when it happens, in every pass (``ZEROENGINE_STAGE3_ORDER_CHECK=event``);
        ``buffer_labels[tag]``: how errors name the buffer ("frozen", "expert"; none for the trainable one)."""
        self.bucket_names = bucket_names
        self.buffer_labels = buffer_labels or {}
        self.always_per_event = per_event
        self.world = comm.get_world_size()
        self.rank = comm.get_rank()
        # its own timeout: the handshake deadline (ZEROENGINE_HANDSHAKE_TIMEOUT, else the comm timeout)
        self.group = new_group(list(range(self.world)), backend="gloo", timeout_s=default_timeout_s())
        self.count = 0  # rows so far, in all passes: the check number errors quote
        self._covered = False  # inside a fetch event, or a refresh every rank makes alike: its gathers follow
        self._deferred = False  # in a pass whose rows are compared at its end
        self._rows: list[tuple[int, ...]] = []  # this pass's rows, while deferred
        # hash -> label, for naming what other ranks gathered for
        self._labels: dict[int, str] = {zlib.crc32(GATHERED_PARAMETERS_LABEL.encode()): GATHERED_PARAMETERS_LABEL}

    # -- pass boundaries (the stage-3 hooks) -----------------------------------------------
    @property
    def per_event(self) -> bool:
        """Whether the rows of the pass now running are compared as they happen."""
        return not self._deferred

    def begin_pass(self, replaying: bool) -> None:
        """A pass begins. One that replays the recorded fetch order is compared at its end; one that records
        it (or runs without autograd) row by row. Every rank decides alike: the order was compared."""
        self._forget()
        self._deferred = replaying and not self.always_per_event

    def end_pass(self, completed: bool = True) -> None:
        """The pass is over. ``completed`` (its backward finished on this rank): compare what this rank did
        with the others (collective). Not completed (a forward or backward raised here): forget it, since
        the others may never arrive and the local error is the one to report."""
        rows, deferred = self._rows, self._deferred
        self._forget()
        if not (completed and deferred and rows) or comm.sequence_check_active():
            return
        mine = torch.tensor([len(rows), _crc_of(rows)], dtype=torch.int64)
        everyone = self._gather(mine, f"the end of a pass of {len(rows)} stage-3 fetches")
        if bool((everyone == mine.repeat(self.world)).all()):
            return
        self._name_divergence(rows, everyone.view(self.world, 2)[:, 0].tolist())

    def _forget(self) -> None:
        self._rows, self._deferred = [], False

    # -- the rows ----------------------------------------------------------------------------
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
        with self.covered():
            yield

    @contextmanager
    def covered(self):
        """Gathers that follow from what was checked (an event's, or every gathered bucket's refresh after the
        step, which every rank makes alike) are not checked again."""
        was, self._covered = self._covered, True
        try:
            yield
        finally:
            self._covered = was

    def _check(self, kind: int, tag: int, bucket: int, label: str, units_key: int) -> None:
        if comm.sequence_check_active():  # comm_debug compares every collective, with its label, already
            return
        self.count += 1
        key = zlib.crc32(label.encode())
        self._labels.setdefault(key, label)
        phase = next((i for i, p in enumerate(_PHASES) if label.endswith(f"({p})")), -1)
        row = (kind, tag, bucket, key, phase, units_key)
        if self._deferred:
            self._rows.append(row)
            return
        everyone = self._gather(torch.tensor([self.count, *row], dtype=torch.int64), self._describe(*row))
        rows = everyone.view(self.world, -1).tolist()
        if all(_agree(r[1:], rows[0][1:]) for r in rows):
            return
        self._raise_diverged(self.count, [self._describe(*r[1:]) for r in rows], "Nothing was gathered")

    def _gather(self, mine: torch.Tensor, doing: str) -> torch.Tensor:
        everyone = torch.empty(self.world * mine.numel(), dtype=torch.int64)
        try:
            comm.control_all_gather(everyone, mine, group=self.group)
        except RuntimeError as exc:  # a peer never came (it ran other collectives) or died
            raise Stage3DivergenceError(
                f"rank {self.rank}: stage-3 check #{self.count} ({doing}) was not joined by every rank ({exc}). "
                f"A rank that skipped the rest of this pass, or runs other collectives, leaves the others "
                f"waiting: every rank must run the same modules in the same order. Run with \"comm_debug\": true "
                f"to name every rank's collective.") from exc
        return everyone

    def _name_divergence(self, rows: list[tuple[int, ...]], counts: list[int]) -> None:
        """The pass's (count, CRC) differ between ranks: exchange the rows (padded to the longest pass) and
        name each rank's first one that differs."""
        longest = max(counts)
        padded = torch.full((longest, _ROW_LEN), -1, dtype=torch.int64)
        if rows:
            padded[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
        everyone = self._gather(padded.flatten(), "naming a divergence").view(self.world, longest, _ROW_LEN)
        logs = [everyone[r, :counts[r]].tolist() for r in range(self.world)]
        first = next((i for i in range(longest)
                      if any(i >= len(log) for log in logs) or not all(_agree(log[i], logs[0][i]) for log in logs)),
                     None)
        if first is None:  # (cannot happen: the CRC folds what _agree compares)
            return
        lines = [self._describe(*log[first]) if first < len(log) else "nothing: its pass had ended" for log in logs]
        self._raise_diverged(self.count - len(rows) + first + 1, lines,
                             "The pass was compared at its end (ZEROENGINE_STAGE3_ORDER_CHECK=event compares every "
                             "fetch before it happens); its gradients are dropped")

    def _raise_diverged(self, number: int, lines: list[str], consequence: str) -> None:
        listed = "\n".join(f"  rank {r}: {line}" for r, line in enumerate(lines))
        raise Stage3DivergenceError(
            f"rank {self.rank}: ranks diverged at stage-3 check #{number}; each was about to fetch parameters "
            f"for something else:\n{listed}\nEvery rank must run the same modules in the same "
            "order (a module skipped or called on some ranks only, e.g. under a data-dependent branch, "
            "desynchronises stage 3's gathers; Hugging Face generate() on several ranks needs synced_gpus=True, "
            f"so a rank that finishes early keeps running forwards with the others). {consequence}: the "
            "step cannot continue.")

    def _describe(self, kind: int, tag: int, bucket: int, key: int, phase: int, _units_key: int) -> str:
        names = self.bucket_names.get(tag, [])
        params = names[bucket] if 0 <= bucket < len(names) else ["?"]
        shown = ", ".join(params[:4]) + (f", ... ({len(params)} parameters)" if len(params) > 4 else "")
        label = self.buffer_labels.get(tag, "")
        where = f"{label + ' ' if label else ''}bucket {bucket} [{shown}]"
        purpose = self._labels.get(key)
        if purpose is None:  # a label this rank never used: name the module from its parameters' names
            owner = _common_module(params)
            purpose = f"module {owner} ({_PHASES[phase]})" if owner and phase >= 0 else "a use this rank never made"
        if kind == self._EVENT:
            return f"{purpose}, needing {where}"
        return f"{where} for {purpose}"


def _crc_of(rows: list[tuple[int, ...]]) -> int:
    """What :func:`_agree` compares, folded: a gather's label does not count (every rank names its own)."""
    crc = 0
    for row in rows:
        crc = zlib.crc32(_ROW.pack(*(row if row[0] == GatherOrderCheck._EVENT else (*row[:3], 0, 0, 0))), crc)
    return crc


def _agree(row: list[int], other: list[int]) -> bool:
    """Two ranks' rows pair: the same gather (kind, buffer, bucket), or for an event also the same module,
    phase and units."""
    if row[:3] != other[:3]:
        return False
    return row[0] == GatherOrderCheck._GATHER or row[3:] == other[3:]


_PHASES = ("forward", "backward")


def _common_module(param_names: list[str]) -> str:
    paths = [n.split(".")[:-1] for n in param_names]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
