"""Rank-local state of the script's own objects in a checkpoint: a torchdata ``StatefulDataLoader``, a sampler,
a stream reader, anything with ``state_dict()`` and ``load_state_dict()``.

Each rank's loader is at its own position, so these states are saved per rank, in the rank's shard file, not in
rank 0's common.pt. Two ways in:

- ``engine.register_stateful(name, obj)``: saved with every checkpoint and loaded back into ``obj`` by
  ``load_checkpoint``;
- a top-level ``client_state`` value with those two methods: its ``state_dict()`` is saved, and the
  ``client_state`` ``load_checkpoint`` returns holds, under the same key, the state this rank saved (for the
  script to load into its object).

Only a load at the world size of the save can hand rank r what rank r saved; at another world size these states
are not restored, and the load says so (the engine's own loader, ``initialize(training_data=...)``, resumes
at any world size).
"""
from __future__ import annotations

import torch

from .state import check_plain


def is_stateful(obj) -> bool:
    return (not isinstance(obj, (torch.Tensor, dict, list, tuple)) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def split_client_state(client_state: dict | None) -> tuple[dict, dict]:
    """``client_state`` as (its plain part, for common.pt; this rank's states of its stateful values), both
    checked for what a weights-only load can read."""
    client_state = {} if client_state is None else client_state
    if not isinstance(client_state, dict):
        return check_plain(client_state), {}
    plain = {k: v for k, v in client_state.items() if not is_stateful(v)}
    states = {k: check_plain(v.state_dict(), f"client_state[{k!r}].state_dict()")
              for k, v in client_state.items() if is_stateful(v)}
    check_plain(plain)
    return plain, states


def registered_states(registry: dict) -> dict:
    return {name: check_plain(obj.state_dict(), f"the registered {name!r}'s state_dict()")
            for name, obj in registry.items()}


def restore(saved: dict | None, registry: dict, client_state: dict, saved_world: int, world: int) -> list[str]:
    """Load this rank's ``saved`` states (its shard's ``stateful`` entry) into the registered objects and into
    ``client_state`` (in place). Returns what could not be restored, for the caller to say."""
    saved = saved or {"client_state": {}, "registered": {}}
    unrestored = []
    if saved_world != world:
        unrestored += [f"{name!r} (saved by {saved_world} ranks, loaded by {world}: rank-local states do not "
                       "carry over to another world size)" for name in saved["registered"]]
        unrestored += [f"client_state[{key!r}] (idem)" for key in saved["client_state"]]
        return unrestored
    client_state.update(saved["client_state"])
    for name, obj in registry.items():
        if name in saved["registered"]:
            obj.load_state_dict(saved["registered"][name])
        else:
            unrestored.append(f"{name!r} (registered, but not in this checkpoint)")
    return unrestored
