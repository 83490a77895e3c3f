"""``ze_from_deepspeed SRC DST``: a DeepSpeed checkpoint rewritten in zeroengine's format, offline.

``engine.load_checkpoint`` reads DeepSpeed folders directly; converting once is for keeping the run's
history in one format (checksums, any-world-size loading without DeepSpeed's metadata quirks). The
conversion streams: DeepSpeed's files are memory-mapped and the output is written in shard files of at
most ``--shard_mb`` MiB (or one tensor, when a tensor is larger), so memory stays bounded by the larger of
the two, never the model. The tag is written in a staging folder, gets its sha256 manifest, is renamed into
place, and ``latest`` is written last, as ``save_checkpoint`` does.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch

from .. import manifest as mf
from ..files import CheckpointError, fsync_dir, save_json, save_tensors, save_text
from ..formats import read_manifest
from .reader import DeepSpeedManifest

DEFAULT_SHARD_MB = 256


def convert_from_deepspeed(src: str, dst: str, tag: str | None = None, shard_mb: int = DEFAULT_SHARD_MB) -> str:
    """Write DeepSpeed checkpoint ``src`` (a save_dir with ``latest``, or one tag folder) to ``dst/<tag>`` in
    zeroengine's format; returns the tag folder written. Refuses a ``dst/<tag>`` that exists."""
    tag_dir = mf.find_tag_dir(src, tag)
    source = read_manifest(tag_dir)
    if not isinstance(source, DeepSpeedManifest):
        raise CheckpointError(f"{tag_dir} is a zeroengine checkpoint already")
    out_tag = mf.check_tag(source.data["tag"])
    final = os.path.join(dst, out_tag)
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists already; pass another destination (nothing was written)")
    os.makedirs(dst, exist_ok=True)
    staging = mf.staging_dir(dst, out_tag)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        files = _write_shards(source, staging, shard_mb << 20)
        files[mf.COMMON] = save_tensors(source.open(mf.COMMON), os.path.join(staging, mf.COMMON))
        data = {key: value for key, value in source.data.items() if key != "files"}
        data.update(format=mf.FORMAT, version=mf.VERSION, tag=out_tag, created=time.time(), files=files,
                    converted_from=f"deepspeed:{os.path.abspath(tag_dir)}")
        save_json(data, os.path.join(staging, mf.MANIFEST))
        fsync_dir(staging)
        os.replace(staging, final)
        fsync_dir(dst)
        save_text(out_tag + "\n", os.path.join(dst, mf.LATEST))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def _write_shards(source: DeepSpeedManifest, staging: str, budget: int) -> dict:
    """Every virtual file's entries, copied out of DeepSpeed's mapped files into shards of at most ``budget``
    bytes each (one entry alone when it is larger)."""
    files, pending, pending_bytes, count = {}, [], 0, 0

    def flush():
        nonlocal pending, pending_bytes, count
        if not pending:
            return
        name = mf.shard_file(count)
        entries = [{"value": e["value"].clone(),
                    "state": {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in e["state"].items()}}
                   for _, e in pending]
        info = save_tensors({"rank": count, "entries": entries}, os.path.join(staging, name))
        files[name] = {**info, "rank": count, "entries": [where for where, _ in pending]}
        pending, pending_bytes, count = [], 0, count + 1

    for file, info in source.data["files"].items():
        if file == mf.COMMON:
            continue
        entries = source.open(file)["entries"]
        for where, entry in zip(info["entries"], entries):
            size = _bytes(entry)
            if pending and pending_bytes + size > budget:
                flush()
            pending.append((list(where), entry))
            pending_bytes += size
    flush()
    return files


def _bytes(entry: dict) -> int:
    tensors = [entry["value"], *(v for v in entry["state"].values() if isinstance(v, torch.Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ze_from_deepspeed",
        description="Convert a DeepSpeed checkpoint (ZeRO stage 0-3, fp32/bf16/fp16, any data-parallel size, or a "
                    "universal folder) into zeroengine's format, which loads at any world size and stage.")
    parser.add_argument("src", help="DeepSpeed's save_dir (with 'latest') or one tag folder")
    parser.add_argument("dst", help="the zeroengine save_dir to write the tag into")
    parser.add_argument("-t", "--tag", default=None, help="the tag to convert (default: the one 'latest' names)")
    parser.add_argument("--shard_mb", type=int, default=DEFAULT_SHARD_MB,
                        help=f"largest output shard file in MiB (default {DEFAULT_SHARD_MB}); bounds the memory used")
    args = parser.parse_args(argv)
    try:
        written = convert_from_deepspeed(args.src, args.dst, args.tag, args.shard_mb)
    except CheckpointError as err:
        print(f"ze_from_deepspeed: {err}", file=sys.stderr)
        return 1
    print(f"ze_from_deepspeed: wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
