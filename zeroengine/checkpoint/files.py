"""Files of a checkpoint: atomic writes, checksums, and loading that never runs code.

Every file is written under a temporary name in the same directory, flushed,
fsynced and renamed over its final name, then the directory is fsynced: a
crash leaves either the old file or the new one, never half of one. Every
file is read back with ``torch.load(weights_only=True)``, so a checkpoint is
data: opening one cannot execute its author's code.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import uuid
import zipfile

import torch


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file, tag or rank."""


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write) -> None:
    """``write(f)`` into a temporary file beside ``path``, fsynced and renamed over it (see the module's note)."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def save_tensors(obj, path: str) -> dict:
    """``torch.save`` ``obj`` to ``path`` atomically; returns ``{"sha256", "bytes"}`` of the file written."""
    atomic_write(path, lambda f: torch.save(obj, f))
    return {"sha256": sha256_of(path), "bytes": os.path.getsize(path)}


def save_text(text: str, path: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def save_json(obj, path: str) -> None:
    save_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", path)


def sha256_of(path: str, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: str, expected: dict) -> None:
    """Refuse a file that is missing, truncated or altered since the manifest recorded it."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing (the manifest lists it)")
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is {size} bytes, the manifest recorded {expected['bytes']}: "
                              "it is truncated or was overwritten")
    if sha256_of(path) != expected["sha256"]:
        raise CheckpointError(f"checkpoint file {path} fails its sha256 checksum: it is corrupted")


def load_tensors(path: str, mmap: bool = True):
    """Read a file written by :func:`save_tensors`: weights only, memory-mapped (pages are read as used)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, zipfile.BadZipFile, EOFError) as err:
        raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None


def load_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}): the file is damaged") from None
