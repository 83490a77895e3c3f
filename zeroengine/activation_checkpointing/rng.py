"""RNG state capture and restore, so a recomputed segment draws the same random numbers.

Dropout inside a checkpointed segment runs twice: once in the forward (whose
activations are thrown away) and once in the recompute. The gradients are only
right if both runs see the same masks, so the forward records every generator
the segment may draw from and the recompute runs with exactly those states,
then puts the generators back where they were (the rest of the backward, and
the next forward, must not notice that a recompute happened).

Generators recorded: the CPU default generator, the CUDA default generator of
each device the segment's inputs live on (plus the current device), and the
named states of the model-parallel tracker (Megatron-style tensor-parallel
dropout draws from the tracker's 'model-parallel-rng' state).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class RNGStatesTracker:
    """Named generator states that code can fork into (``with tracker.fork(): dropout(x)``).

    DeepSpeed's and Megatron's ``CudaRNGStatesTracker``: each name holds a
    separate stream of random numbers (e.g. one seeded per tensor-parallel rank
    for dropout inside tensor-parallel regions, so ranks draw different masks).
    The states live on the accelerator's default generator; on a machine
    without CUDA they live on the CPU generator, which is what dropout on CPU
    tensors draws from, so the same model code works on both.
    """

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    @staticmethod
    def _on_cuda() -> bool:
        return torch.cuda.is_available()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self._on_cuda() else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self._on_cuda():
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def reset(self) -> None:
        self.states = {}
        self.seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds.add(seed)
        saved = self._get()
        if self._on_cuda():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = self._get()
        self._set(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from the named state inside the block; the default state is untouched afterwards."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not in the tracker (add it first)")
        saved = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(saved)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (DeepSpeed's name; it also works without CUDA)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, model_parallel_rank: int | None = None) -> None:
    """Seed like Megatron: the default generator gets ``seed`` (the same on every tensor-parallel rank),
    the tracker's 'model-parallel-rng' state gets ``seed + 2718 + tp_rank`` (different per rank).

    ``model_parallel_rank`` defaults to the rank in the model-parallel group given to ``configure``.
    """
    if model_parallel_rank is None:
        from .config import current

        model_parallel_rank = current().mp_rank
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + model_parallel_rank)


@dataclass
class RNGState:
    """Everything a segment's random draws depend on, captured at the start of its forward."""

    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor] = field(default_factory=dict)
    tracker: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def capture(cls, tensors) -> "RNGState":
        cuda = {}
        if _cuda_ready():
            devices = {t.device.index for t in tensors if t.is_cuda}
            devices.add(torch.cuda.current_device())
            cuda = {d: torch.cuda.get_rng_state(d) for d in devices if d is not None}
        return cls(torch.get_rng_state(), cuda, _TRACKER.get_states())

    def _apply(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda.items():
            torch.cuda.set_rng_state(state, device)
        _TRACKER.set_states(self.tracker)


@contextlib.contextmanager
def replay(state: RNGState):
    """Run the block with the generators as they were when ``state`` was captured, then restore them."""
    now = RNGState(torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in state.cuda},
                   _TRACKER.get_states())
    state._apply()
    try:
        yield
    finally:
        now._apply()
