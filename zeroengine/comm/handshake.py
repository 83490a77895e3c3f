"""Agreement among ranks through the process group's key-value store, with a deadline.

A collective that one rank never joins hangs the others until the backend's
timeout, with no word on who is missing. Operations that users call by hand
and commonly call on one rank only by mistake (``save_checkpoint`` under
``if rank == 0:``) first meet here: every rank posts a small payload under
the operation's name and waits, with a deadline, for every peer's. A peer
that never arrives turns into a :class:`HandshakeTimeout` naming it, and each
rank gets every peer's payload (the tag it is saving, whether its shard was
written, ...) without any collective that could itself hang.
"""
from __future__ import annotations

import math
import os
from datetime import timedelta

import torch.distributed as dist


class HandshakeTimeout(RuntimeError):
    """Some ranks did not reach the same handshake within the deadline."""

    def __init__(self, message: str, missing: list[int], store_lost: bool = False):
        super().__init__(message)
        self.missing = missing
        self.store_lost = store_lost  # rank 0, which hosts the store, is gone


def seconds_from_env(var: str) -> float | None:
    """``var`` as a positive number of seconds (None when unset); anything else is an error naming it."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{var}={raw!r}: expected a positive number of seconds (e.g. {var}=600)")
    return value


def comm_timeout_s() -> float:
    """``ZEROENGINE_COMM_TIMEOUT`` seconds, else 600: how long a collective waits (read when the group is made)."""
    return seconds_from_env("ZEROENGINE_COMM_TIMEOUT") or 600.0


def default_timeout_s() -> float:
    """``ZEROENGINE_HANDSHAKE_TIMEOUT`` seconds, else the collective timeout (``ZEROENGINE_COMM_TIMEOUT``, 600)."""
    return seconds_from_env("ZEROENGINE_HANDSHAKE_TIMEOUT") or comm_timeout_s()


class Handshakes:
    """Per-process numbering of handshakes, so the k-th call of an operation meets the peers' k-th."""

    def __init__(self):
        self._count: dict[str, int] = {}

    def exchange(self, name: str, payload: bytes, timeout_s: float | None = None) -> list[bytes]:
        """Post ``payload`` and return every rank's, in rank order (the whole world takes part)."""
        store, keys, seq = self._post(name, payload)
        if store is None:
            return [payload]
        rank = dist.get_rank()
        payloads = self._wait_and_read(store, keys, name, timeout_s)
        if seq:
            # Every rank has posted this round, so every rank has read the previous one: its key can go,
            # and the store (hosted by rank 0) keeps one round per operation instead of all of them.
            _delete(store, [f"ze_hs/{name}/{seq - 1}/{rank}"])
        return payloads

    def gather(self, name: str, payload: bytes, timeout_s: float | None = None) -> list[bytes] | None:
        """Post ``payload``; rank 0 gets every rank's, in rank order (others get None at once and do not
        wait). For payloads only rank 0 needs (a save's file tables): every rank downloading every rank's
        would grow with the square of the world size."""
        store, keys, _ = self._post(name, payload)
        if store is None:
            return [payload]
        if dist.get_rank() != 0:
            return None
        payloads = self._wait_and_read(store, keys, name, timeout_s)
        _delete(store, keys)  # rank 0 is the only reader
        return payloads

    def _post(self, name: str, payload: bytes):
        """Number this call of ``name`` and post ``payload``; ``(store, every rank's key, number)``, with no
        store in a world of one."""
        seq = self._count.get(name, 0)
        self._count[name] = seq + 1
        rank, world = dist.get_rank(), dist.get_world_size()
        if world == 1:
            return None, [], seq
        store = _store()
        prefix = f"ze_hs/{name}/{seq}"
        store.set(f"{prefix}/{rank}", payload)
        return store, [f"{prefix}/{r}" for r in range(world)], seq

    @staticmethod
    def _wait_and_read(store, keys: list[str], name: str, timeout_s: float | None) -> list[bytes]:
        rank = dist.get_rank()
        timeout = default_timeout_s() if timeout_s is None else timeout_s
        try:
            store.wait(keys, timedelta(seconds=timeout))
            return [store.get(k) for k in keys]
        except dist.DistNetworkError:
            raise HandshakeTimeout(f"rank {rank} lost the connection to the store (hosted by rank 0) during "
                                   f"'{name}': rank 0 has died", [0], store_lost=True) from None
        except Exception:  # the store raises a plain RuntimeError/DistStoreError on timeout
            missing = [r for r in range(len(keys)) if not store.check([keys[r]])]
            raise HandshakeTimeout(
                f"rank {rank} waited {timeout:.0f}s for '{name}' but rank(s) {missing} never called it", missing
            ) from None


def _delete(store, keys: list[str]) -> None:
    for key in keys:
        try:
            store.delete_key(key)
        except (RuntimeError, NotImplementedError):
            pass  # a store without delete: only memory is at stake


def _store():
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


handshakes = Handshakes()
