"""How the ranks of a save or load agree: JSON payloads over the store handshake, and one way to report failures."""
from __future__ import annotations

import json

from zeroengine import comm

from .files import CheckpointError


def exchange(name: str, payload, advice: str = "", first: bool = True) -> list:
    """Every rank's ``payload`` (JSON-able), in rank order; a rank that never arrives is named, not waited for.
    ``first``: the operation's first round (a rank missing there may not have called it at all; in a later
    round every rank had called it, so a missing one crashed or hangs)."""
    return _agreed(comm.handshakes.exchange, name, payload, advice, first)


def gather_to_rank0(name: str, payload, advice: str = "", first: bool = True) -> list | None:
    """Every rank's ``payload`` on rank 0 (None elsewhere; see ``Handshakes.gather``)."""
    return _agreed(comm.handshakes.gather, name, payload, advice, first)


def _agreed(handshake, name: str, payload, advice: str, first: bool) -> list | None:
    try:
        raw = handshake(name, json.dumps(payload).encode())
    except comm.HandshakeTimeout as err:
        operation = name.split("/")[0]
        if err.store_lost:  # a crash, not a call missing from the script: no advice about calling it
            raise CheckpointError(f"{operation} failed: {err}") from None
        if not first:
            raise CheckpointError(f"{operation}: rank(s) {err.missing} called it with the others but did not reach "
                                  f"its next step in time ({err}): they crashed, were killed, or hang (a slow "
                                  "filesystem?); see their output") from None
        raise CheckpointError(f"{operation} is collective: every rank must call it, but rank(s) "
                              f"{err.missing} did not reach it in time ({err}){advice}") from None
    return None if raw is None else [json.loads(r) for r in raw]


def raise_failures(failed: dict[int, str], what: str) -> None:
    """One error naming each rank that failed and why (nothing when ``failed`` is empty)."""
    if failed:
        lines = "\n".join(f"  rank {r}: {msg}" for r, msg in sorted(failed.items()))
        raise CheckpointError(f"{what} on rank(s) {sorted(failed)}:\n{lines}")
