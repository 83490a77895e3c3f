"""Stage 0: plain data parallelism.

Every rank keeps full parameters, gradients and optimizer state; gradients are
averaged across ranks with bucketed all-reduces at the gradient-accumulation
boundary (no communication between boundaries).
"""
from __future__ import annotations

import torch

from zeroengine import comm
from zeroengine.comm.bucketing import all_reduce_mean_in_buckets
from zeroengine.memory import MemoryTally
from zeroengine.precision.master_weights import MasterWeights

from .optimizer import StatePiece, ZeroOptimizer, finite_sqrt, reduced_elsewhere


class DataParallelOptimizer(ZeroOptimizer):
    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        policy,
        loss_scaler,
        gradient_clipping: float,
        master_weights: MasterWeights | None,
        reduce_bucket_size: int,
        comm_dtype: torch.dtype | None = None,
        group=None,
    ):
        super().__init__(optimizer, policy, loss_scaler, gradient_clipping)
        self.module = module
        self.master_weights = master_weights
        # Every trainable parameter is reduced, like DDP, in a fixed order so
        # all ranks flatten identical buckets.
        self.trainable = [p for p in module.parameters() if p.requires_grad and not reduced_elsewhere(p)]
        self.reduce_bucket_bytes = int(reduce_bucket_size) * self.trainable[0].element_size() if self.trainable else 0
        self.comm_dtype = comm_dtype
        self.group = group

    def finish_backward(self, is_boundary: bool) -> None:
        if not is_boundary:
            return  # gradients accumulate locally; nothing is communicated between boundaries
        for p in self.trainable:
            # A parameter unused on this rank still joins the bucket as zeros,
            # or the flattened buckets would differ between ranks.
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_mean_in_buckets(
            [p.grad for p in self.trainable], self.reduce_bucket_bytes, group=self.group, comm_dtype=self.comm_dtype
        )

    def _unscaled_fp32_grads(self, inv_scale: float) -> list[torch.Tensor]:
        if self.master_weights is not None:
            self.master_weights.load_grads(inv_scale)
            return [m.grad for m in self.master_weights.masters if m.grad is not None]
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if inv_scale != 1.0:
            torch._foreach_mul_(grads, inv_scale)
        return grads

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        # Gradients are already identical on every data-parallel rank: no communication, except over the ranks
        # holding the model's other slices under model parallelism. A non-finite total is inf (as at stages 1-3
        # and in DeepSpeed), also when an overflow made it nan.
        if self.norm_skip:
            grads = self._counted_grads()
        total = self.local_norm_sq(grads)
        if self.model_parallel:
            total = comm.all_reduce_value(total, group=self.model_group)
        return finite_sqrt(total)

    def _counted_grads(self) -> list[torch.Tensor]:
        """The (unscaled) gradients of the stepped parameters not in ``norm_skip``."""
        if self.master_weights is not None:
            pairs = zip(self.master_weights.model_params, self.master_weights.masters)
        else:
            pairs = ((p, p) for g in self.optimizer.param_groups for p in g["params"])
        return [stepped.grad for p, stepped in pairs if stepped.grad is not None and id(p) not in self.norm_skip]

    def _refresh_model_params(self) -> None:
        if self.master_weights is not None:
            self.master_weights.write_back()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)
        if self.master_weights is not None:
            self.master_weights.zero_grad()

    def memory_tally(self) -> MemoryTally:
        tally = MemoryTally()
        tally.add("params", self.module.parameters())
        tally.add("grads", (p.grad for p in self.module.parameters()))
        if self.master_weights is not None:
            tally.add("master_params", self.master_weights.masters)
            tally.add("grads", (m.grad for m in self.master_weights.masters))
        tally.add_optimizer_state(self.optimizer)
        tally.add("buffers", self.module.buffers())
        return tally

    def checkpoint_params(self) -> list[torch.nn.Parameter]:
        if self.master_weights is not None:
            return list(self.master_weights.model_params)
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def checkpoint_pieces(self) -> list[StatePiece]:
        params = self.checkpoint_params()
        values = self.master_weights.masters if self.master_weights is not None else params
        return [StatePiece(p, 0, p.numel(), v, v, replicated=True, group=self.group) for p, v in zip(params, values)]

    @torch.no_grad()
    def after_checkpoint_load(self) -> None:
        if self.master_weights is not None:
            self.master_weights.write_back()
