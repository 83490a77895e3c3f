"""Stage 3's optimizer wrapper and how its parameters are split into buffers.

The step is stage 2's (:class:`ShardedOptimizer`: each rank steps its chunk
of every bucket); what stage 3 adds is where the parameters live:

* trainable parameters are partitioned in the optimizer's buffer; those
  with fewer than ``stage3_param_persistence_threshold`` elements go to
  *persistent* buckets at the end of the layout, which stay gathered on
  every rank (their gradients and optimizer state are still partitioned);
* frozen parameters (``requires_grad=False``, or not given to the optimizer)
  are partitioned in a buffer of their own, gathered for forward and
  backward like the others, and never get gradients or optimizer state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroengine.memory import MemoryTally

from .param_guard import full_shape
from .sharded import ShardedOptimizer


@dataclass
class Stage3Params:
    """The model's parameters in stage-3 order, with the unit (segment) each belongs to."""

    params: list[torch.nn.Parameter]
    names: list[str]
    segments: list[int]
    persistent_from: int  # params[persistent_from:] are persistent


def split_params(module: torch.nn.Module, trainable_ids: set[int], persistence_threshold: int):
    """(trainable, frozen) :class:`Stage3Params`: one unit per module owning parameters, in reverse module
    order (backward order); persistent ones last. A shared parameter (a tied embedding and head) goes with the
    module registered first, the use whose backward comes last: its gradient is complete only then, and
    gradient buckets are sent in layout order, so placing it with the head would hold every other bucket's
    gradients until the end of backward. Non-floating parameters (integer tables: ids, indices) are in
    neither: they stay whole on every rank in their own dtype, as at stages 0-2 (a buffer in the training
    dtype would round them, 16777217 to 16777216)."""
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    backward_order = list(reversed(list(module.modules())))
    last_use = {}  # id(parameter) -> the unit of its last module in backward order
    for unit, m in enumerate(backward_order):
        for p in m._parameters.values():
            if p is not None:
                last_use[id(p)] = unit
    picked = {True: ([], []), False: ([], [])}  # trainable? -> (partitioned, persistent) lists of (p, unit)
    seen = set()
    for unit, m in enumerate(backward_order):
        for p in m._parameters.values():
            if p is None or id(p) in seen or not p.is_floating_point() or last_use[id(p)] != unit:
                continue
            seen.add(id(p))
            persistent = full_shape(p).numel() < persistence_threshold
            picked[id(p) in trainable_ids][persistent].append((p, unit))
    out = []
    for trainable in (True, False):
        partitioned, persistent = picked[trainable]
        ordered = partitioned + persistent
        out.append(Stage3Params([p for p, _ in ordered], [names.get(id(p), "?") for p, _ in ordered],
                                [u for _, u in partitioned] + [-1] * len(persistent), len(partitioned)))
    return out


def persistent_buckets(layout, persistent_from: int) -> frozenset[int]:
    return frozenset(b.index for b in layout.buckets if b.slots[0].index >= persistent_from)


class Stage3Optimizer(ShardedOptimizer):
    """:class:`ShardedOptimizer` over a partitioned buffer: an update goes into this rank's shard only (the
    hooks gather it when a module next runs). Holds stage 3's hooks and the frozen-parameter buffer (for
    accounting, stats and ``remove_hooks``)."""

    def __init__(self, *args, hooks=None, frozen_params=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hooks = hooks
        self.frozen_params = frozen_params
        self._written: set[int] = set()  # buckets the offloaded step already wrote into the shard

    def _offloaded_bucket_sink(self):
        """Each bucket the offloaded step finishes goes into this rank's shard at once (its staging buffer is
        written again soon)."""
        def bucket_done(b, values):
            self._written.add(b)
            return self.flat_params.write_chunk(self.layout.buckets[b], values)

        return bucket_done

    def _refresh_model_params(self) -> None:
        written, self._written = self._written, set()
        self.flat_params.after_step([None if b in written else chunk for b, chunk in enumerate(self._settled_chunks())])

    def fetch_stats(self) -> dict:
        """Gathers issued, prefetches, live elements (every buffer of the stage shares one FetchStats)."""
        s = self.flat_params.stats
        stats = {k: getattr(s, k) for k in ("on_demand", "prefetched", "waited_in_flight", "gathered_numel",
                                             "live_numel", "peak_live_numel")}
        if self.hooks is not None:
            trace = self.hooks.fetcher.trace
            stats.update(trace_state=trace.state.value, trace_events=len(trace.events),
                         trace_recordings=trace.recordings, trace_divergences=trace.divergences)
        return stats

    def remove_hooks(self) -> None:
        super().remove_hooks()
        if self.hooks is not None:
            self.hooks.remove()
        for buffer in (self.flat_params, self.frozen_params):
            if buffer is not None:
                buffer.close_swap()

    def reset_fetch_stats(self) -> None:
        self.flat_params.stats.reset()

    def add_stage_tally(self, tally: MemoryTally) -> None:
        if self.frozen_params is not None:
            tally.add("params", self.frozen_params.held_tensors())
        for buffer in (self.flat_params, self.frozen_params):
            if buffer is not None:
                tally.add("buffers", buffer.spare_tensors())
                if buffer.swap is not None:  # offload_param device "nvme": the chunks in the swap file
                    tally.add_bytes("params", "nvme", buffer.swap.drive_bytes())
