"""Random numbers across tensor ranks: Megatron's discipline, which AutoTP applies by itself.

Note: replicated and split activations.
A tensor-parallel transformer holds two kinds of activation. *Replicated* ones (the hidden states between
blocks: a column-parallel layer's input, a row-parallel layer's summed output) are one tensor that every tensor
rank holds a copy of. Nothing reconciles those copies, so dropout on them must draw the same mask on every tensor
rank: otherwise the copies drift apart, and with them the gradients of the replicated parameters (layer norms,
row-parallel biases, position embeddings), which then differ from rank to rank for good. *Split* ones (between a
column-parallel layer and the row-parallel layer after it: this rank's attention heads, its part of the MLP's
features) are different tensors on each rank, and one process would draw an independent mask for every head;
the same mask on each rank would drop head h and head h + H/T together. So (Shoeybi et al. 2019, section 3):

* replicated activations draw from the default generator, which :func:`share_generators` makes agree across the
  tensor group;
* split activations draw inside the tracker's fork (its 'model-parallel-rng' stream is seeded
  ``seed + 2718 + tensor rank``); :class:`SplitRegion` runs the stretch of a converted attention or MLP block from
  its entry to its row-parallel layer in that fork. Hugging Face models drop attention probabilities inside the
  attention function (eager's ``F.dropout``, or SDPA's own ``dropout_p``), not through a module that a hook could
  reach, so the whole stretch is forked: it draws nothing else (the projections and rotary embeddings are not
  random), and the residual dropout after the row-parallel layer is outside it.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from zeroengine import comm
from zeroengine.activation_checkpointing.rng_tracker import (
    MODEL_PARALLEL_RNG,
    MODEL_PARALLEL_SEED_OFFSET,
    get_cuda_rng_tracker,
)

from .ops import TensorGroup

logger = logging.getLogger("zeroengine")

_HEADER = 16  # two int64: this rank's initial seed, its tracker stream's seed (-1: none)


def _packed_generators(with_cuda: bool) -> torch.Tensor:
    """This rank's seeds and default generator states as one byte tensor (one collective moves them)."""
    tracker = get_cuda_rng_tracker().get_states().get(MODEL_PARALLEL_RNG)
    header = torch.tensor([torch.initial_seed() % 2**63, -1 if tracker is None else tracker["seed"] % 2**63],
                          dtype=torch.int64)
    parts = [header.view(torch.uint8), torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if with_cuda else [])
    return torch.cat(parts)


def share_generators(tg: TensorGroup) -> None:
    """Make random numbers follow the note above on this tensor group: every rank takes tensor rank 0's default
    generators (so replicated dropout agrees), and the tracker's 'model-parallel-rng' stream is seeded
    ``seed0 + 2718 + tensor rank`` (seed0: tensor rank 0's initial seed). Collective over ``tg``.

    Taken from tensor rank 0, not reseeded: a script that seeds ``seed + rank`` keeps the stream it seeded, at the
    position it has reached, on every tensor rank of a group. Data-parallel replicas keep their own streams (each
    group's rank 0's): they see different data and share nothing that dropout could desynchronise, and a script
    that seeds every rank alike still gets one stream everywhere, as Megatron (which seeds them alike) does.
    The CUDA generator is shared too when the group communicates over NCCL, i.e. the model runs on CUDA.

    A stream the script seeded itself (``model_parallel_cuda_manual_seed``) stands when it differs on every tensor
    rank; one seeded alike on them (e.g. before any mesh told it the tensor rank) would drop every rank's heads
    together, so it is replaced, with a warning.
    """
    if tg.size == 1:
        return
    device = comm.device_for_backend()
    mine = _packed_generators(device.type == "cuda").to(device)
    everyone = torch.empty(tg.size * mine.numel(), dtype=torch.uint8, device=device)
    comm.all_gather(everyone, mine, group=tg.group)
    everyone = everyone.view(tg.size, -1).cpu()
    first = everyone[0]
    cpu_end = _HEADER + torch.get_rng_state().numel()
    torch.set_rng_state(first[_HEADER:cpu_end].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(first[cpu_end:].clone())
    seed0, _ = first[:_HEADER].clone().view(torch.int64).tolist()
    streams = everyone[:, :_HEADER].clone().view(torch.int64)[:, 1].tolist()
    if -1 not in streams and len(set(streams)) == tg.size:
        return  # the script's own per-rank stream
    if tg.rank == 0 and any(seed != -1 for seed in streams):
        logger.warning("the model-parallel RNG tracker's stream was seeded alike on several tensor ranks (was "
                       "model_parallel_cuda_manual_seed called before the tensor rank was known?): reseeding it "
                       "per tensor rank, so that the ranks' attention heads drop independently")
    get_cuda_rng_tracker().reseed(MODEL_PARALLEL_RNG, seed0 + MODEL_PARALLEL_SEED_OFFSET + tg.rank)


class SplitRegion:
    """The stretch of one block from its entry to its row-parallel layer, run inside the tracker's fork.

    Entered by the block's forward pre-hook, left by the row-parallel layer's pre-hook; the block's forward hook
    (called even when the forward raises) leaves it too, so an exception, or a forward that returns before its
    row-parallel layer, never leaves the default generators switched. The tracker is looked up at each entry:
    a script that reseeds or resets it (``model_parallel_cuda_manual_seed``) is followed.
    """

    def __init__(self):
        self._open: contextlib.ExitStack | None = None

    def enter(self, *_) -> None:
        self.leave()
        stack = contextlib.ExitStack()
        stack.enter_context(get_cuda_rng_tracker().fork(MODEL_PARALLEL_RNG))
        self._open = stack

    def leave(self, *_) -> None:
        if self._open is not None:
            stack, self._open = self._open, None
            stack.close()

    @property
    def is_open(self) -> bool:
        return self._open is not None

    @classmethod
    def around(cls, block: torch.nn.Module, row_layer: torch.nn.Module) -> "SplitRegion":
        """A region over ``block`` up to ``row_layer`` (one of its children), its hooks registered."""
        region = cls()
        block.register_forward_pre_hook(region.enter)
        row_layer.register_forward_pre_hook(region.leave)
        block.register_forward_hook(region.leave, always_call=True)
        return region
