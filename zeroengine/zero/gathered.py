"""``zeroengine.zero.GatheredParameters``: full stage-3 parameters inside a ``with`` block.

Like DeepSpeed's, it is collective: every rank enters it with the same
parameters. Inside, the parameters hold their full values. With
``modifier_rank=r``, rank r's edits are broadcast on exit and written back
into every rank's shard (and its fp32 master chunk), so the next step starts
from them. Parameters that are not partitioned pass through untouched.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from zeroengine import comm

from .gather_order import GATHERED_PARAMETERS_LABEL
from .init import InitShard, is_init_partitioned
from .param_guard import info_of, mark_gathered, mark_partitioned
from .records import record_of


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a stage-3 parameter (empty between uses, or persistent: whole on every rank while its
    gradient and optimizer state are partitioned), or one built under zero.Init."""
    record = record_of(param)
    return (record is not None and record.partitioned) or is_init_partitioned(param)


class GatheredParameters:
    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if fwd_module is not None:
            # DeepSpeed registers the parameters as external ones of fwd_module (gathered whenever it runs);
            # here they would be released on exit while autograd still holds them for backward.
            raise NotImplementedError("GatheredParameters(fwd_module=...) is not supported: register the "
                                      "parameters once with zeroengine.zero.register_external_parameter(fwd_module, "
                                      "param), and fwd_module's forward and backward fetch them")
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params) if isinstance(params, Iterable) else [params]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._gathered: list[tuple] = []
        self._init_gathered: list[tuple[torch.nn.Parameter, InitShard]] = []
        self._flat: dict[tuple, tuple] = {}

    def __enter__(self):
        if not self.enabled:
            return self
        seen, passed_through = {}, 0
        for p in self.params:
            if is_init_partitioned(p):
                if all(p is not q for q, _ in self._init_gathered):
                    # Built under zero.Init, not yet given to initialize(): per-parameter slices.
                    shard = info_of(p).init_shard
                    with torch._C.DisableTorchFunction():
                        p.data = shard.full_flat().view(info_of(p).shape)
                    mark_gathered(p)
                    self._init_gathered.append((p, shard))
                continue
            record = record_of(p)
            if record is not None and record.partitioned:
                seen[(id(record.buffer), record.bucket.index)] = (record.buffer, record.bucket.index, record.owner)
            elif self.modifier_rank is not None and record is not None and record.buffer.group is None:
                # Stages 1-2 (world-wide buffers): the parameters are whole on every rank, but the optimizer
                # steps its own master chunks, so a modifier's edit is broadcast and taken into them on exit.
                self._flat[(id(record.buffer), record.bucket.index)] = (record.buffer, record.bucket.index,
                                                                         record.owner)
            elif isinstance(p, torch.Tensor):
                passed_through += 1
        if passed_through and self.modifier_rank is not None and comm.get_world_size() > 1:
            _warn_passed_through(passed_through, self.modifier_rank)
        if self.modifier_rank is not None:
            # offload's delayed update reaches the weights first: the edit is made on them, and taken into the
            # masters on exit, instead of the masters' newer values being overwritten by older weights
            owners = [o for _, _, o in list(seen.values()) + list(self._flat.values()) if o is not None]
            for owner in {id(o): o for o in owners}.values():  # first-use order: the same on every rank
                owner.land_delayed_update()
        # The same order on every rank: the gathers are collectives.
        for _, (buffer, index, owner) in sorted(seen.items(), key=lambda kv: kv[0][1]):
            bucket = buffer.layout.buckets[index]
            was_gathered = buffer.is_gathered(bucket)
            buffer.gather(bucket, GATHERED_PARAMETERS_LABEL)
            buffer.pin(bucket)  # a forward inside the block (generate, evaluation) must not release it
            # Read-only (no modifier_rank): edits are dropped on exit, as DeepSpeed does. A bucket that was
            # already gathered (persistent, or kept) would keep them in this rank's live copy only.
            snapshot = buffer.full[bucket.index].clone() if was_gathered and self.modifier_rank is None else None
            self._gathered.append((buffer, bucket, owner, was_gathered, snapshot))
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        for buffer, bucket, owner, was_gathered, snapshot in self._gathered:
            buffer.unpin(bucket)
            # `p.data = new` inside the block: the modifier's new values go into the bucket (then broadcast)
            buffer.take_replaced_data(bucket, keep_values=self.modifier_rank == buffer.rank and exc_type is None)
            if snapshot is not None:
                with torch.no_grad():
                    buffer.full[bucket.index].copy_(snapshot)
            if self.modifier_rank is not None and exc_type is None:
                full = buffer.full[bucket.index]
                comm.broadcast(full, src=self.modifier_rank, group=buffer.group)
                with torch.no_grad():
                    lo, hi = bucket.chunk_range(buffer.rank)
                    start = lo - bucket.flat_start
                    buffer.store_chunk(bucket, full[start:start + (hi - lo)])
                if owner is not None:  # frozen parameters have no master chunk
                    owner.load_chunk_from_params(bucket.index)
            if not was_gathered:
                buffer.release(bucket)
        self._gathered = []
        if self.modifier_rank is not None and exc_type is None:
            for _, (buffer, index, owner) in sorted(self._flat.items(), key=lambda kv: kv[0][1]):
                bucket = buffer.layout.buckets[index]
                comm.broadcast(buffer.bucket_view(bucket), src=self.modifier_rank, group=buffer.group)
                if owner is not None:
                    owner.load_chunk_from_params(index)
        self._flat = {}
        for p, shard in self._init_gathered:
            with torch.no_grad(), torch._C.DisableTorchFunction():
                full = p.detach().reshape(-1)
                if self.modifier_rank is not None and exc_type is None:
                    comm.broadcast(full, src=self.modifier_rank, group=shard.group)
                    shard.set_own(full)
                # (read-only: the slices keep their values; an edit on one rank would land in its slice only)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            mark_partitioned(p)
        self._init_gathered = []
        return False


_warned_passed_through = False


def _warn_passed_through(count: int, modifier_rank: int) -> None:
    global _warned_passed_through
    if _warned_passed_through:
        return
    _warned_passed_through = True
    from zeroengine.progress import get_logger

    get_logger().warning(
        f"GatheredParameters(modifier_rank={modifier_rank}): {count} of the parameters are not sharded (ZeRO "
        f"stage 0, or not in the engine) and pass through untouched, as in DeepSpeed: an edit made on rank "
        f"{modifier_rank} only stays there. Load or edit them on every rank (this is logged once)")
