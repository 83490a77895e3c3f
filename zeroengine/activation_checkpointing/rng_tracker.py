"""The model-parallel RNG tracker: named random streams that code forks into (Megatron's and DeepSpeed's
``CudaRNGStatesTracker``, ``get_cuda_rng_tracker``, ``model_parallel_cuda_manual_seed``).

Why named streams: under tensor parallelism some activations are replicated (every tensor rank holds the same
tensor) and some are split (each rank holds its own heads or features). Dropout on a replicated activation must
draw the same mask on every tensor rank, so it uses the default generator, seeded alike on all of them; dropout
on a split activation must draw an independent mask per rank (the one-process model draws one per head), so it
runs inside ``get_cuda_rng_tracker().fork()``, whose 'model-parallel-rng' stream is seeded per tensor rank.
docs/parallelism.md ("Random numbers across tensor ranks") says how AutoTP applies this.

Device-agnostic: DeepSpeed's tracker lives on the accelerator's generator only. Here a stream holds one state
per device type and ``fork`` switches the CPU generator, and the current CUDA device's when CUDA is in use, so
dropout forks correctly wherever its tensor lives (a CPU model on a machine that has a GPU included). A device's
state is made from the stream's seed the first time that device is used, which gives the same numbers as seeding
it up front (a freshly seeded generator is the same whenever it is made) without starting CUDA in CPU-only runs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from zeroengine.parallel.mesh import current_mesh

from .config import current

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset of the model-parallel seed from the default one ("any positive value will work"): kept, so a
# seed gives the masks it gives there.
MODEL_PARALLEL_SEED_OFFSET = 2718


def _devices_in_use() -> list[str]:
    """The generators a fork switches: the CPU's always, the current CUDA device's once CUDA has started (before
    that nothing can draw from it, and asking for its state would start it)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return ["cpu", "cuda"]
    return ["cpu"]


def _get(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _set(device: str, state: torch.Tensor) -> None:
    if device == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


@dataclass
class _Stream:
    """One named stream: its seed and, per device type, where the stream has got to."""

    seed: int
    states: dict[str, torch.Tensor] = field(default_factory=dict)

    def state(self, device: str) -> torch.Tensor:
        if device not in self.states:
            self.states[device] = torch.Generator(device=device).manual_seed(self.seed).get_state()
        return self.states[device]

    def as_dict(self) -> dict:
        # plain values, so a checkpoint holding tracker states loads with torch.load(weights_only=True)
        return {"seed": self.seed, **{device: state.clone() for device, state in self.states.items()}}

    @classmethod
    def from_dict(cls, name: str, saved) -> "_Stream":
        if not isinstance(saved, dict) or not isinstance(saved.get("seed"), int):
            raise TypeError(f"RNG tracker state {name!r}: expected what get_states() returns (a dict with 'seed' and "
                            f"a state per device type), got {type(saved).__name__}")
        return cls(saved["seed"], {k: v.clone() for k, v in saved.items() if k != "seed"})


class RNGStatesTracker:
    """Named random streams to fork into: ``with tracker.fork(): x = dropout(x)``.

    ``add(name, seed)`` starts a stream; ``fork(name)`` draws from it inside the block and leaves the default
    generators exactly where they were; ``get_states`` / ``set_states`` save and restore every stream (activation
    checkpointing replays them in the recompute, Megatron checkpoints store them). As in Megatron a name and a
    seed may each be added only once: two streams with one seed would draw the same masks, the very correlation
    the tracker exists to avoid.
    """

    def __init__(self):
        self._streams: dict[str, _Stream] = {}

    def reset(self) -> None:
        self._streams = {}

    @property
    def states(self) -> dict[str, dict]:
        """Every stream as :meth:`get_states` gives it (read-only view; Megatron's ``states_``)."""
        return self.get_states()

    @property
    def seeds(self) -> set[int]:
        return {stream.seed for stream in self._streams.values()}

    def __contains__(self, name: str) -> bool:
        return name in self._streams

    def get_states(self) -> dict[str, dict]:
        return {name: stream.as_dict() for name, stream in self._streams.items()}

    def set_states(self, states: dict[str, dict]) -> None:
        self._streams = {name: _Stream.from_dict(name, saved) for name, saved in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self._streams:
            raise ValueError(f"RNG state {name!r} already exists in the tracker (reset() it, or pick another name)")
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker: a second stream with it would draw the "
                             "same numbers as the first")
        self._streams[name] = _Stream(seed)

    def reseed(self, name: str, seed: int) -> None:
        """Restart stream ``name`` from ``seed`` (DeepSpeed's ``model_parallel_reconfigure_tp_seed``)."""
        if seed in {s.seed for n, s in self._streams.items() if n != name}:
            raise ValueError(f"seed {seed} already belongs to another stream of the RNG tracker")
        self._streams[name] = _Stream(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from stream ``name`` inside the block; the default generators are untouched afterwards."""
        stream = self._streams.get(name)
        if stream is None:
            raise KeyError(f"RNG state {name!r} is not in the tracker: seed it first (model_parallel_cuda_manual_seed"
                           "(seed), which zeroengine.initialize does itself under tensor parallelism, or add())")
        devices = _devices_in_use()  # fixed at entry: CUDA starting inside the block has nothing of ours to restore
        outer = {device: _get(device) for device in devices}
        for device in devices:
            _set(device, stream.state(device))
        try:
            yield
        finally:
            for device in devices:
                stream.states[device] = _get(device)
                _set(device, outer[device])


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (DeepSpeed's name; it works without CUDA too)."""
    return _TRACKER


def _tensor_rank() -> int:
    """This rank's place in its tensor-parallel group: the mpu's given to ``checkpointing.configure`` /
    ``initialize(mpu=...)``, else the process mesh's (AutoTP)."""
    if current().mp_world_size > 1:
        return current().mp_rank
    return current_mesh().tp_rank


def model_parallel_cuda_manual_seed(seed: int, model_parallel_rank: int | None = None) -> None:
    """Seed like Megatron: the default generators get ``seed`` (call it with the same seed on every tensor rank);
    the tracker's 'model-parallel-rng' stream gets ``seed + 2718 + tensor rank`` (a different one on each).

    ``model_parallel_rank`` defaults to this rank's tensor-parallel rank (see :func:`_tensor_rank`).
    """
    rank = _tensor_rank() if model_parallel_rank is None else model_parallel_rank
    torch.manual_seed(seed)  # the CPU's and every CUDA device's
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + rank)


def model_parallel_reconfigure_tp_seed(seed: int, model_parallel_rank: int | None = None) -> None:
    """Restart only the 'model-parallel-rng' stream from ``seed + 2718 + tensor rank`` (DeepSpeed's name), leaving
    the default generators and any other stream as they are."""
    rank = _tensor_rank() if model_parallel_rank is None else model_parallel_rank
    _TRACKER.reseed(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + rank)
