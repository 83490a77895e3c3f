"""ZeRO stages 0-2 for models with MoE layers: expert parameters form their own reduction domain.

Note: expert gradients. An expert parameter lives on the W/E ranks of its
expert-data-parallel (EDP) group (W ranks, ``ep_size`` E). Its local gradient
already sums the contributions of all tokens its expert-parallel group routed
to it (the all-to-all backward brought them home), so the EDP group's sum
covers every rank's tokens once. Dense gradients are averaged over the W
ranks; to mean the same thing, expert gradients are summed over the EDP group
and divided by W, not W/E (so results do not depend on ``ep_size``). ZeRO
stages 1-2 partition expert parameters, their gradients and optimizer state
within the EDP group: every expert element is owned by exactly one rank of
the world, as every dense element is.

Note: global gradient norm. Clipping uses the norm over all parameters, each
counted once. Stages 1-2: every element (dense or expert) is owned by one
rank, so one world all-reduce of the per-rank sums of squares. Stage 0:
dense gradients are replicated (local sum); expert gradients are replicated
across an EDP group, and each expert-parallel group holds every expert once,
so the expert part is summed over the expert-parallel group.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from zeroengine import comm
from zeroengine.comm.bucketing import all_reduce_mean_in_buckets
from zeroengine.memory import MemoryTally

from .optimizer import StatePiece, ZeroOptimizer, finite_sqrt
from .sharded import ShardedOptimizer
from .stage0 import DataParallelOptimizer


@dataclass
class ParamDomain:
    """Parameters reduced (and, at stages 1-2, partitioned) over one process group."""

    params: list[torch.nn.Parameter]
    group: object  # None: the world
    rank: int  # in ``group``
    world: int  # size of ``group``
    divisor: int  # what the gradient sum is divided by
    norm_group: object = None  # stage 0: over which group the replicated norm parts add up
    is_expert: bool = False


def split_domains(params: list[torch.nn.Parameter]) -> list[ParamDomain]:
    """The dense domain first, then one per ``ep_size`` among the expert parameters; [] without experts."""
    from zeroengine.moe.groups import expert_groups
    from zeroengine.moe.params import expert_tag

    dense, by_ep = [], {}
    for p in params:
        tag = expert_tag(p)
        if tag is None:
            dense.append(p)
        else:
            by_ep.setdefault(tag.ep_size, []).append(p)
    if not by_ep:
        return []
    world = comm.get_world_size()
    domains = [ParamDomain(dense, None, comm.get_rank(), world, world)]
    for ep_size in sorted(by_ep):
        groups = expert_groups(ep_size)
        domains.append(ParamDomain(by_ep[ep_size], groups.edp_group, groups.edp_rank, groups.edp_size, world,
                                   norm_group=groups.ep_group, is_expert=True))
    return domains


class ExpertDataParallelOptimizer(DataParallelOptimizer):
    """Stage 0 with expert domains (see the module notes)."""

    def __init__(self, *args, domains: list[ParamDomain], **kwargs):
        super().__init__(*args, **kwargs)
        self.expert_domains = [d for d in domains if d.is_expert]
        expert_ids = {id(p) for d in self.expert_domains for p in d.params}
        self.trainable = [p for p in self.trainable if id(p) not in expert_ids]  # the dense all-reduce
        self._stepped_grads_of: list[set[int]] = []

    def finish_backward(self, is_boundary: bool) -> None:
        super().finish_backward(is_boundary)
        if not is_boundary:
            return
        for d in self.expert_domains:
            for p in d.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_mean_in_buckets([p.grad for p in d.params], self.reduce_bucket_bytes, group=d.group,
                                       comm_dtype=self.comm_dtype, divisor=d.divisor)

    def _stepped(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self.master_weights.master_of[id(p)] if self.master_weights is not None else p

    def _unscaled_fp32_grads(self, inv_scale: float) -> list[torch.Tensor]:
        grads = super()._unscaled_fp32_grads(inv_scale)
        self._stepped_grads_of = [{id(self._stepped(p).grad) for p in d.params} for d in self.expert_domains]
        return grads

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        expert_ids = set().union(*self._stepped_grads_of) if self._stepped_grads_of else set()
        total = self.local_norm_sq([g for g in grads if id(g) not in expert_ids])
        for d, ids in zip(self.expert_domains, self._stepped_grads_of):
            part = self.local_norm_sq([g for g in grads if id(g) in ids], total.device)
            total = total + comm.all_reduce_value(part, group=d.norm_group)
        return finite_sqrt(total)

    def checkpoint_pieces(self) -> list[StatePiece]:
        # An expert parameter is replicated over its EDP group only: one of that group writes it.
        group_of = {id(p): d.group for d in self.expert_domains for p in d.params}
        return [dataclasses.replace(piece, group=group_of[id(piece.param)]) if id(piece.param) in group_of else piece
                for piece in super().checkpoint_pieces()]


class ExpertShardedOptimizer(ZeroOptimizer):
    """Stages 1-3 with expert domains: one :class:`ShardedOptimizer` (stage 3: ``Stage3Optimizer``) per domain,
    one torch optimizer. At stage 3 the first part holds the hooks every part's units share."""

    def __init__(self, parts: list[ShardedOptimizer], optimizer, policy, loss_scaler, gradient_clipping):
        super().__init__(optimizer, policy, loss_scaler, gradient_clipping)
        self.parts = parts
        self.module = parts[0].module

    @property
    def hooks(self):
        """Stage 3's hooks (shared by the parts), None at stages 1-2."""
        return getattr(self.parts[0], "hooks", None)

    def fetch_stats(self) -> dict:
        return self.parts[0].fetch_stats()  # one FetchStats serves every buffer

    def reset_fetch_stats(self) -> None:
        self.parts[0].reset_fetch_stats()

    def begin_backward(self, is_boundary: bool) -> None:
        for part in self.parts:
            part.begin_backward(is_boundary)

    def finish_backward(self, is_boundary: bool) -> None:
        for part in self.parts:
            part.finish_backward(is_boundary)

    def cancel_backward(self) -> None:
        for part in self.parts:
            part.cancel_backward()

    def _unscaled_fp32_grads(self, inv_scale: float) -> list[torch.Tensor]:
        return [g for part in self.parts for g in part._unscaled_fp32_grads(inv_scale)]

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        # Every element is owned once in the world; each part knows which of its gradients are still scaled.
        return finite_sqrt(comm.all_reduce_value(sum(part.local_grad_norm_sq() for part in self.parts)))

    def _clip_grads(self, grads: list[torch.Tensor], coef: torch.Tensor) -> None:
        for part in self.parts:
            part._clip_grads(grads, coef)

    def _optimizer_step(self) -> None:
        # One torch optimizer holds every part's pieces: one step for all resident buckets, then each
        # part streams its offloaded buckets (see ShardedOptimizer._optimizer_step).
        if any(part.resident_buckets for part in self.parts):
            self.optimizer.step()
        for part in self.parts:
            part.drop_resident_grads()
        for part in self.parts:
            part.step_offloaded(self.steps_applied)

    def _refresh_model_params(self) -> None:
        for part in self.parts:
            part._refresh_model_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def remove_hooks(self) -> None:
        for part in self.parts:
            part.remove_hooks()

    def land_delayed_update(self) -> None:
        for part in self.parts:
            part.land_delayed_update()

    def discard_delayed_update(self) -> None:
        for part in self.parts:
            part.discard_delayed_update()

    def memory_tally(self) -> MemoryTally:
        for part in self.parts:
            part.wait_if_creating_state()
        tally = MemoryTally()  # one tally, so storages shared between parts count once
        for part in self.parts:
            tally.add("params", part.flat_params.held_tensors())
        tally.add("params", self.module.parameters())
        for part in self.parts:
            tally.add("grads", part.grad_store.held_tensors())
            tally.add("grads", part._fp32_chunk_grads)
            tally.add("master_params", part.chunks)  # views of the parameters were counted above
            tally.add("buffers", part.offload_buffers())
            part.add_nvme_tally(tally)
        tally.add_optimizer_state(self.optimizer)
        tally.add("buffers", self.module.buffers())
        for part in self.parts:
            tally.add("buffers", part.grad_store.comm_buffers())
            part.add_stage_tally(tally)
        return tally

    def checkpoint_params(self) -> list[torch.nn.Parameter]:
        return [p for part in self.parts for p in part.checkpoint_params()]

    def checkpoint_pieces(self) -> list[StatePiece]:
        return [piece for part in self.parts for piece in part.checkpoint_pieces()]

    def after_checkpoint_load(self) -> None:
        for part in self.parts:
            part.after_checkpoint_load()

    def release_checkpoint_pieces(self, modified: bool = False) -> None:
        for part in self.parts:
            part.release_checkpoint_pieces(modified)
