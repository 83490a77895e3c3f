"""The per-run scratch folder NVMe offload keeps its swap files in.

Each process makes its own folder under ``nvme_path``
(``zeroengine-swap-<host>-<pid>-<random>``), so ranks sharing a drive never
coordinate. The folder is removed at ``engine.destroy()`` and at interpreter exit;
a process that was killed cannot remove its own, so a new one removes the
folders of this host's processes that are gone. Swap files are scratch: the
run's state survives through checkpoints, which are written elsewhere.

Every file is reserved at its full size when it is made (``posix_fallocate``),
so a drive too small is an error before training starts, naming the path and
the bytes needed, never a failed write in the middle of a step.
"""
from __future__ import annotations

import atexit
import errno
import os
import secrets
import shutil
import socket

from zeroengine.config.errors import ConfigError

PREFIX = "zeroengine-swap-"


class SwapFolder:
    """This process's folder under ``nvme_path``; ``key`` is the config key that named it (for errors)."""

    def __init__(self, nvme_path: str, key: str):
        self.key = key
        root = os.path.abspath(os.path.expanduser(nvme_path))
        if not os.path.isdir(root):
            raise ConfigError(key, f"{root} does not exist or is not a folder: make it (on a fast local drive) "
                                   "or point nvme_path at one")
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigError(key, f"{root} is not writable by this process (uid {os.getuid()})")
        self.host = socket.gethostname()
        remove_stale_folders(root, self.host)
        self.path = os.path.join(root, f"{PREFIX}{self.host}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(self.path, 0o700)
        except OSError as err:
            raise ConfigError(key, f"cannot make the swap folder {self.path}: {err.strerror}") from None
        self._files: dict[str, int] = {}  # name -> bytes reserved
        atexit.register(self.remove)

    def reserve(self, name: str, nbytes: int) -> str:
        """Make (or grow) file ``name`` to ``nbytes`` bytes with its blocks allocated; return its path."""
        path = os.path.join(self.path, name)
        if self._files.get(name, -1) >= nbytes:
            return path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                stats = os.statvfs(self.path)
                free = stats.f_bavail * stats.f_frsize
                raise ConfigError(self.key, f"the drive of {self.path} is too small: the swap file {name} needs "
                                            f"{nbytes} bytes ({self.bytes_reserved() + nbytes} in all for this "
                                            f"process), {free} are free") from None
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here: the writes grow the file
                raise ConfigError(self.key, f"cannot reserve {nbytes} bytes for {path}: {err.strerror}") from None
        finally:
            os.close(fd)
        self._files[name] = nbytes
        return path

    def bytes_reserved(self) -> int:
        return sum(self._files.values())

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._files.clear()
        atexit.unregister(self.remove)


def remove_stale_folders(root: str, host: str) -> None:
    """Remove swap folders under ``root`` left by processes of this host that no longer run."""
    mine = PREFIX + host + "-"
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(mine):
            continue
        pid_text = name[len(mine):].split("-", 1)[0]
        if pid_text.isdigit() and not _alive(int(pid_text)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
