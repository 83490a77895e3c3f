"""The checkpoint directory and its manifest: what a complete tag is, and where each value lives.

    save_dir/
      latest                  the newest complete tag (written last)
      <tag>/manifest.json     written once every rank's files are in place: a tag without it is incomplete
      <tag>/common.pt         counters, scheduler, loss scaler, param groups, buffers, client_state
      <tag>/shard_00000.pt    rank 0's slices: fp32 values and optimizer state by (parameter name, flat range)
      ...

A tag is written in a staging directory and renamed into place when complete,
so saving again under an existing tag never leaves a half-old, half-new one.
Values are addressed by parameter name and a range of the flattened parameter,
never by rank, which is what lets any world size and ZeRO stage read them.
"""
from __future__ import annotations

import bisect
import math
import os
import re
from dataclasses import dataclass, field

from .deepspeed.layout import looks_like_deepspeed
from .files import CheckpointError, load_json, load_tensors, verify

FORMAT = "zeroengine-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
COMMON = "common.pt"
LATEST = "latest"
_TAG = re.compile(r"^[A-Za-z0-9_.+=-][A-Za-z0-9_.+=@-]*$")


def shard_file(rank: int) -> str:
    return f"shard_{rank:05d}.pt"


def staging_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".staging-{tag}")


def replaced_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".replaced-{tag}")


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not _TAG.match(tag) or tag in (".", ".."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain directory name "
                              "(letters, digits, '_', '-', '.', '+', '=', '@'; no path separators)")
    # save_dir's own entries: the 'latest' file, and the staging / replaced directories of saves
    if tag == LATEST or tag.startswith((".staging-", ".replaced-")):
        raise CheckpointError(f"checkpoint tag {tag!r} is reserved (save_dir uses that name itself); pick another")
    return tag


@dataclass(frozen=True)
class Entry:
    """Elements [start, end) of the flattened parameter ``name`` are in ``file`` (entry ``index`` there)."""

    start: int
    end: int
    file: str
    index: int


@dataclass
class Manifest:
    tag_dir: str
    data: dict
    _entries: dict[str, list[Entry]] = field(default_factory=dict)

    @classmethod
    def read(cls, tag_dir: str) -> "Manifest":
        path = os.path.join(tag_dir, MANIFEST)
        if not os.path.isdir(tag_dir):
            raise CheckpointError(f"checkpoint directory {tag_dir} does not exist")
        if not os.path.exists(path):
            if looks_like_deepspeed(tag_dir):
                raise CheckpointError(f"{tag_dir} is a DeepSpeed checkpoint: read it with "
                                      "zeroengine.checkpoint.formats.read_manifest")
            raise CheckpointError(f"checkpoint {tag_dir} is incomplete (no {MANIFEST}): the save that wrote it "
                                  "did not finish; load another tag")
        data = load_json(path)
        if data.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a zeroengine checkpoint manifest")
        if data.get("version", 0) > VERSION:
            raise CheckpointError(f"{path} has format version {data['version']}; this zeroengine reads up to "
                                  f"{VERSION}: upgrade zeroengine")
        manifest = cls(tag_dir, data)
        moved = _merge_per_rank_stacks(data["params"])
        for file, info in data["files"].items():
            for i, (name, start, end) in enumerate(info.get("entries", [])):
                name, offset = moved.get(name, (name, 0))
                manifest._entries.setdefault(name, []).append(Entry(start + offset, end + offset, file, i))
        for entries in manifest._entries.values():
            entries.sort(key=lambda e: e.start)
        return manifest

    @property
    def params(self) -> dict:
        return self.data["params"]

    def path(self, file: str) -> str:
        return os.path.join(self.tag_dir, file)

    def verify_file(self, file: str) -> str:
        path = self.path(file)
        verify(path, self.data["files"][file])
        return path

    def open(self, file: str) -> dict:
        """The contents of one of the checkpoint's files, checked against the manifest (memory-mapped)."""
        return load_tensors(self.verify_file(file))

    def entries_overlapping(self, name: str, start: int, end: int) -> list[Entry]:
        """The entries covering [start, end) of ``name``; an error if any element is missing."""
        entries = self._entries.get(name, [])
        i = max(bisect.bisect_right([e.start for e in entries], start) - 1, 0)
        found, covered = [], start
        for e in entries[i:]:
            if e.start >= end:
                break
            if e.end <= covered:
                continue
            if e.start > covered:
                break
            found.append(e)
            covered = e.end
        if covered < end:
            raise CheckpointError(f"checkpoint {self.tag_dir} lacks elements [{covered}, {end}) of parameter "
                                  f"{name!r}: a shard file is missing from its manifest")
        return found


# Stacked MoE experts as checkpoints before global stacked names stored them: one name per rank's stack.
_PER_RANK_STACK = re.compile(r"^(?P<name>.+)\.experts_(?P<first>\d+)_(?P<last>\d+)$")


def _merge_per_rank_stacks(params: dict) -> dict[str, tuple[str, int]]:
    """Read ``<name>.experts_<a>_<b>`` (experts a..b of a stacked parameter, one entry per rank, as
    zeroengine wrote them before) as elements ``a * per_expert ..`` of one ``<name>`` shaped
    ``[num_experts, ...]``, today's layout, so such checkpoints load at any ep_size too. Rewrites
    ``params``; returns {old name: (new name, element offset)} for the entries."""
    stacks: dict[str, list[tuple[str, int, int]]] = {}
    for old in params:
        match = _PER_RANK_STACK.match(old)
        if match and match["name"] not in params:
            stacks.setdefault(match["name"], []).append((old, int(match["first"]), int(match["last"])))
    moved = {}
    for name, parts in stacks.items():
        first_info = params[parts[0][0]]
        per_expert = math.prod(first_info["shape"][1:])
        params[name] = {**first_info, "shape": [max(last for _, _, last in parts) + 1, *first_info["shape"][1:]]}
        for old, first, _ in parts:
            moved[old] = (name, first * per_expert)
            del params[old]
    return moved


def read_latest(save_dir: str) -> str | None:
    path = os.path.join(save_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    if not tag:
        raise CheckpointError(f"{path} is empty: pass the tag to load")
    return tag


def resolve_tag_dir(load_dir: str, tag: str | None) -> str | None:
    """The directory of ``tag`` (or of the tag ``latest`` names, or ``load_dir`` itself when it is one tag's
    directory); None when there is no checkpoint at all."""
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            if os.path.exists(os.path.join(load_dir, MANIFEST)) or looks_like_deepspeed(load_dir):
                return load_dir  # one tag's directory (as ze_to_fp32 takes it); Manifest.read says if foreign
            return None
    tag = check_tag(tag)
    tag_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(tag_dir) and os.path.exists(os.path.join(replaced_dir(load_dir, tag), MANIFEST)):
        # A save under an existing tag was interrupted between its two renames: the old copy is whole.
        return replaced_dir(load_dir, tag)
    return tag_dir


def find_tag_dir(checkpoint_dir: str, tag: str | None) -> str:
    """The tag directory a tool reads: ``checkpoint_dir`` itself when it is one tag's directory, else
    ``checkpoint_dir/tag`` (or the tag ``latest`` names); an error that says what to pass when there is none."""
    if tag is None and os.path.exists(os.path.join(checkpoint_dir, MANIFEST)):
        return checkpoint_dir
    tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    if tag_dir is None:
        raise CheckpointError(f"{checkpoint_dir} has no 'latest' file and no {MANIFEST}: pass --tag, or the "
                              "directory save_checkpoint wrote to")
    return tag_dir
