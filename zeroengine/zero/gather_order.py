"""Stage 3: check, before each parameter gather, that every rank gathers the same bucket.

Why: ranks that take different code paths (a module skipped on one rank)
issue their k-th all-gather for different buckets. If the sizes differ,
gloo aborts the whole process from a background thread ("Received data size
doesn't match expected size"), which Python cannot catch, and NCCL hangs;
if they happen to match, the gathers pair silently and every rank trains on
a mix of two layers' weights. Neither says which module diverged.

So before each stage-3 gather every rank contributes five integers (gather
number, buffer, bucket, a hash of what it gathers for, the pass) to a tiny all-gather
on a gloo group of its own: a host-side round trip (tens of microseconds on
one machine), never queued behind the device's work, and always the same
size, so it cannot itself mismatch. When the buckets differ, every rank
raises the same error naming each rank's bucket, its parameters and the
module it was gathering for, before the real gather can abort or pair
wrongly. A rank that runs other collectives instead (it skipped the rest of
forward) leaves the others waiting here until the collective timeout, which
then names this rank's module and gather number.

``ZEROENGINE_STAGE3_ORDER_CHECK=0`` turns the check off; under ``comm_debug``
it stands aside, since that mode compares every collective (labels included).
"""
from __future__ import annotations

import os
import zlib

import torch

from zeroengine import comm
from zeroengine.comm.groups import new_group
from zeroengine.comm.handshake import default_timeout_s

from .layout import Bucket


# What GatheredParameters gathers for: known to every rank, so a rank that never entered the block can
# still name it when a peer did.
GATHERED_PARAMETERS_LABEL = "zeroengine.zero.GatheredParameters (collective: every rank must enter it)"


class Stage3DivergenceError(RuntimeError):
    """Ranks were about to gather different stage-3 parameter buckets."""


def enabled() -> bool:
    raw = os.environ.get("ZEROENGINE_STAGE3_ORDER_CHECK", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"ZEROENGINE_STAGE3_ORDER_CHECK must be 0 or 1, got {raw!r}")
    return raw == "1"


class GatherOrderCheck:
    """Collective at construction (creates a gloo group over the world): every rank builds one, in step."""

    def __init__(self, bucket_names: dict[int, list[list[str]]]):
        """``bucket_names[tag][b]``: the parameter names in bucket ``b`` of the buffer tagged ``tag``."""
        self.bucket_names = bucket_names
        self.world = comm.get_world_size()
        self.rank = comm.get_rank()
        # its own timeout: the handshake deadline (ZEROENGINE_HANDSHAKE_TIMEOUT, else the comm timeout)
        self.group = new_group(list(range(self.world)), backend="gloo", timeout_s=default_timeout_s())
        self.count = 0
        # hash -> label, for naming what other ranks gathered for
        self._labels: dict[int, str] = {zlib.crc32(GATHERED_PARAMETERS_LABEL.encode()): GATHERED_PARAMETERS_LABEL}

    def verify(self, tag: int, bucket: Bucket, label: str) -> None:
        if comm.sequence_check_active():  # comm_debug compares every collective, with its label, already
            return
        self.count += 1
        key = zlib.crc32(label.encode())
        self._labels.setdefault(key, label)
        phase = next((i for i, p in enumerate(_PHASES) if label.endswith(f"({p})")), -1)
        mine = torch.tensor([self.count, tag, bucket.index, key, phase], dtype=torch.int64)
        everyone = torch.empty(self.world * mine.numel(), dtype=torch.int64)
        try:
            comm.control_all_gather(everyone, mine, group=self.group)
        except RuntimeError as exc:  # a peer never came (it ran other collectives) or died
            raise Stage3DivergenceError(
                f"rank {self.rank}: stage-3 parameter gather #{self.count} ({self._describe(tag, bucket.index, key, phase)}) "
                f"was not joined by every rank ({exc}). A rank that skipped the rest of this pass, or runs other "
                f"collectives, leaves the others waiting: every rank must run the same modules in the same order. "
                f"Run with \"comm_debug\": true to name every rank's collective.") from exc
        rows = everyone.view(self.world, -1).tolist()
        if all(row[1:3] == rows[0][1:3] for row in rows):  # same buffer and bucket: the gather pairs right
            return
        lines = [f"  rank {r}: {self._describe(*row[1:])}" for r, row in enumerate(rows)]
        raise Stage3DivergenceError(
            f"rank {self.rank}: ranks diverged at stage-3 parameter gather #{self.count}; each was about to gather a "
            "different bucket:\n" + "\n".join(lines) + "\nEvery rank must run the same modules in the same order "
            "(a module skipped or called on some ranks only, e.g. under a data-dependent branch, desynchronises "
            "stage 3's gathers). Nothing was gathered: the step cannot continue.")

    def _describe(self, tag: int, bucket: int, key: int, phase: int) -> str:
        names = self.bucket_names.get(tag, [])
        params = names[bucket] if 0 <= bucket < len(names) else ["?"]
        shown = ", ".join(params[:4]) + (f", ... ({len(params)} parameters)" if len(params) > 4 else "")
        purpose = self._labels.get(key)
        if purpose is None:  # a label this rank never used: name the module from its parameters' names
            owner = _common_module(params)
            purpose = f"module {owner} ({_PHASES[phase]})" if owner and phase >= 0 else "a use this rank never made"
        return f"{'frozen ' if tag else ''}bucket {bucket} [{shown}] for {purpose}"


_PHASES = ("forward", "backward")


def _common_module(param_names: list[str]) -> str:
    paths = [n.split(".")[:-1] for n in param_names]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
