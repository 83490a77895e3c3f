"""How the ranks of a save or load agree: JSON payloads over the store handshake, and one way to report failures."""
from __future__ import annotations

import json

from zeroengine import comm

from .files import CheckpointError


def exchange(name: str, payload, advice: str = "") -> list:
    """Every rank's ``payload`` (JSON-able), in rank order; a rank that never arrives is named, not waited for."""
    return _agreed(comm.handshakes.exchange, name, payload, advice)


def gather_to_rank0(name: str, payload, advice: str = "") -> list | None:
    """Every rank's ``payload`` on rank 0 (None elsewhere; see ``Handshakes.gather``)."""
    return _agreed(comm.handshakes.gather, name, payload, advice)


def _agreed(handshake, name: str, payload, advice: str) -> list | None:
    try:
        raw = handshake(name, json.dumps(payload).encode())
    except comm.HandshakeTimeout as err:
        raise CheckpointError(f"{name.split('/')[0]} is collective: every rank must call it, but rank(s) "
                              f"{err.missing} did not reach it in time ({err}){advice}") from None
    return None if raw is None else [json.loads(r) for r in raw]


def raise_failures(failed: dict[int, str], what: str) -> None:
    """One error naming each rank that failed and why (nothing when ``failed`` is empty)."""
    if failed:
        lines = "\n".join(f"  rank {r}: {msg}" for r, msg in sorted(failed.items()))
        raise CheckpointError(f"{what} on rank(s) {sorted(failed)}:\n{lines}")
