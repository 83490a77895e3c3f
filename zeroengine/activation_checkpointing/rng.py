"""RNG state capture and restore, so a recomputed segment draws the same random numbers.

Dropout inside a checkpointed segment runs twice: once in the forward (whose
activations are thrown away) and once in the recompute. The gradients are only
right if both runs see the same masks, so the forward records every generator
the segment may draw from and the recompute runs with exactly those states,
then puts the generators back where they were (the rest of the backward, and
the next forward, must not notice that a recompute happened).

Generators recorded: the CPU default generator, the CUDA default generator of
each device the segment's inputs live on (plus the current device), and the
streams of the model-parallel tracker (rng_tracker.py: tensor-parallel dropout
draws from its 'model-parallel-rng' stream, as Megatron's CheckpointFunction
replays it too).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .rng_tracker import get_cuda_rng_tracker

_TRACKER = get_cuda_rng_tracker()


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass
class RNGState:
    """Everything a segment's random draws depend on, captured at the start of its forward."""

    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor] = field(default_factory=dict)
    tracker: dict[str, dict] = field(default_factory=dict)  # the tracker's get_states()

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
