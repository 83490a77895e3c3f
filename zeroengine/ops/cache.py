"""Where built ops live on disk, and the small file primitives that make the
cache safe to share between processes (an exclusive lock, atomic JSON files)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import torch

CACHE_ENV = "ZEROENGINE_CACHE_DIR"


def cache_root() -> Path:
    """``$ZEROENGINE_CACHE_DIR`` (default ``~/.cache/zeroengine/ops``) / ``<torch>-<py tag>``.

    Builds link against one torch and one Python ABI, so each pair gets its own tree.
    """
    base = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "zeroengine" / "ops"
    py_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return Path(base).expanduser() / f"{torch.__version__}-{py_tag}"


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an fcntl lock on ``path`` (created if needed).

    The kernel drops the lock when the holder exits, even on a crash, so a dead
    rank can never leave the others waiting forever.
    """
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` so that readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=1)
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
