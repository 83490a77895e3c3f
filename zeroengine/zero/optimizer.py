"""The optimizer wrapper every ZeRO stage shares: the step skeleton.

``initialize()`` returns one of these as the "wrapped optimizer". A stage
decides *where* gradients, master weights and optimizer state live (whole or
sharded); the order of a step is the same for all of them and lives here once:

1. reduce gradients across data-parallel ranks (stage specific);
2. gather the fp32, unscaled gradients this rank steps on;
3. global gradient norm (stage specific: sharded stages sum partial norms);
4. fp16 (and bf16 with check_grad_overflow): overflow (non-finite norm)
   agreed by every rank; the loss scaler updates, and an overflowing step is
   skipped on all ranks alike;
5. clip to ``gradient_clipping`` by the global norm;
6. the wrapped torch optimizer steps;
7. refresh the model's parameters (16-bit copy-back, or all-gather of shards).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zeroengine import comm
from zeroengine.memory import MemoryTally
from zeroengine.precision.policy import PrecisionPolicy


def reduced_elsewhere(p: torch.nn.Parameter) -> bool:
    """A parameter whose gradient something else hands on (a pipeline stage's copy of a tied weight sends its
    gradient to the stage that owns and steps it): data-parallel reduction leaves it alone."""
    return getattr(p, "_ze_reduced_elsewhere", False)


def trained_group_of(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> its param group, for the parameters the sharded stages step. A frozen parameter in a
    group (``model_parameters=model.parameters()`` with part of the model frozen) is left out, as DeepSpeed
    does: it has no gradient, and stepping it would still apply weight decay to it."""
    return {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"] if p.requires_grad}


@dataclass(frozen=True)
class StatePiece:
    """Elements [start, end) of a parameter's flattened fp32 value, as one rank holds them (for checkpoints).

    ``value`` is the tensor the optimizer steps for that range (an fp32 master
    slice, a shard piece or the parameter itself); ``opt_param`` is its key in
    ``optimizer.state``. ``replicated`` pieces are held alike by every rank of
    ``group`` (stage 0), so only one of them needs to write them.
    """

    param: torch.nn.Parameter
    start: int
    end: int
    value: torch.Tensor
    opt_param: torch.Tensor
    replicated: bool = False
    group: object = None


class StepResult:
    """What one optimizer step did. The gradient norm stays a device tensor until someone reads
    ``grad_norm`` (a monitor row, ``engine.get_global_grad_norm()``): reading it waits for the device."""

    def __init__(self, applied: bool, norm, loss_scale: float | None):
        self.applied = applied
        self.loss_scale = loss_scale
        self._norm = norm

    @property
    def grad_norm(self) -> float:
        if isinstance(self._norm, torch.Tensor):
            self._norm = float(self._norm)
        return self._norm


# The optimizer state of a ZeRO stage lives in pieces on every rank (and on the host under offload): one
# rank's state_dict() is not the optimizer's. Checkpoints hold it by parameter name and range instead.
_NO_STATE_DICT = ("the ZeRO optimizer's state is split across ranks and has no state_dict(): save and load it "
                  "with engine.save_checkpoint / engine.load_checkpoint (any world size and stage), and read one "
                  "parameter's with zeroengine.zero.safe_get_full_optimizer_state")


class ZeroOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, policy: PrecisionPolicy, loss_scaler, gradient_clipping: float):
        self.optimizer = optimizer
        self.policy = policy
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        # bf16's check_grad_overflow (DeepSpeed's default): a step whose gradients are not finite is skipped
        # on every rank, as fp16's loss scaler does, instead of writing inf/nan into the weights.
        self.skip_nonfinite_steps = False
        self.overflow = False  # DeepSpeed's flag: whether the last step was skipped for non-finite gradients
        self.steps_applied = 0  # optimizer steps not skipped (restored by a checkpoint load)
        # Model parallelism (zeroengine.parallel.mesh): this rank holds one slice of the model, so the global
        # gradient norm also adds up over the ranks holding the other slices (the mesh's ``model`` group,
        # None there meaning the world). Set by the factory; overflow follows the norm, so every rank agrees.
        self.model_parallel = False
        self.model_group = None
        # Parameters every tensor-parallel rank holds alike (norms, a row-parallel bias): their gradient counts
        # in the norm on the first tensor rank only (set_norm_skip on the others).
        self.norm_skip: set[int] = set()

    def set_norm_skip(self, param_ids: set[int]) -> None:
        """Leave these parameters' gradients out of this rank's share of the global norm."""
        self.norm_skip = set(param_ids)

    # -- what torch.optim users and LR schedulers reach for ------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name for the current loss scale (scripts log ``engine.optimizer.cur_scale``)."""
        return self.loss_scale

    # DeepSpeed's optimizer has these; here they are properties that raise AttributeError with a hint, so
    # hasattr() stays False (no __getattr__: it would mask AttributeErrors raised inside other properties).
    @property
    def state_dict(self):
        raise AttributeError(f"{type(self).__name__}.state_dict: {_NO_STATE_DICT}")

    @property
    def load_state_dict(self):
        raise AttributeError(f"{type(self).__name__}.load_state_dict: {_NO_STATE_DICT}")

    # -- stage-specific pieces ------------------------------------------------
    def begin_backward(self, is_boundary: bool) -> None:
        """Called before every micro-step's backward (stages that reduce during backward get ready)."""

    def finish_backward(self, is_boundary: bool) -> None:
        """Called after every micro-step's backward: reduce gradients as the stage requires."""
        raise NotImplementedError

    def cancel_backward(self) -> None:
        """Called instead of :meth:`finish_backward` when the backward raised."""

    def _unscaled_fp32_grads(self, inv_scale: float) -> list[torch.Tensor]:
        raise NotImplementedError

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global gradient norm, a 0-dim float64 tensor on the gradients' device, the same on every rank
        (inf when not finite)."""
        raise NotImplementedError

    def _clip_grads(self, grads: list[torch.Tensor], coef: torch.Tensor) -> None:
        torch._foreach_mul_(grads, coef)

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    def _refresh_model_params(self) -> None:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        """Take the strategy's hooks off the model's parameters and modules (engine.destroy()); stages 0-1
        register none."""

    def memory_tally(self) -> MemoryTally:
        raise NotImplementedError

    def checkpoint_params(self) -> list[torch.nn.Parameter]:
        """The model parameters whose values the pieces of all ranks together hold (the rest: module extras)."""
        raise NotImplementedError

    def checkpoint_pieces(self) -> list[StatePiece]:
        """This rank's fp32 values and optimizer-state keys, by parameter and flat range."""
        raise NotImplementedError

    def after_checkpoint_load(self) -> None:
        """The pieces' values were overwritten: bring the model's parameters in line with them."""
        raise NotImplementedError

    def release_checkpoint_pieces(self, modified: bool = False) -> None:
        """The caller is done with :meth:`checkpoint_pieces` (``modified``: it wrote their values or state):
        state kept on NVMe goes back to the drive and its host memory is freed."""

    def land_delayed_update(self) -> None:
        """offload_optimizer.delayed_update: write the update still on its way into the model's parameters
        (collective). At the next step's start, before a save and a modifying GatheredParameters."""

    def discard_delayed_update(self) -> None:
        """Wait for a delayed update and forget its write-back (local): a checkpoint load overwrites masters,
        optimizer state and weights, or destroy() leaves (a pending update is then logged as not landed)."""

    # -- the shared step ------------------------------------------------------
    @torch.no_grad()
    def step(self) -> StepResult:
        grads = self._unscaled_fp32_grads(1.0 / self.loss_scale)
        norm = self._grad_norm(grads)  # on the device; one collective where the gradients are sharded
        scale_before = self.loss_scale
        if self.loss_scaler is not None or self.skip_nonfinite_steps:
            # The step's one wait for the device: skipping is decided on the host. The norm is global (the same
            # on every rank), and a non-finite gradient anywhere makes it so: no collective of its own.
            overflow = not bool(torch.isfinite(norm))
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(overflow)
            self.overflow = overflow
            if overflow:
                self.zero_grad()
                return StepResult(applied=False, norm=norm, loss_scale=scale_before)
        if self.gradient_clipping > 0 and grads:
            # torch.nn.utils.clip_grad_norm_'s coefficient, clamped on the device instead of compared on the
            # host (a factor of exactly 1 changes nothing), so parity with a plain torch loop is exact.
            coef = torch.clamp(self.gradient_clipping / (norm + 1e-6), max=1.0)
            self._clip_grads(grads, coef)
        self._optimizer_step()
        self._refresh_model_params()
        self.zero_grad()
        self.steps_applied += 1
        return StepResult(applied=True, norm=norm, loss_scale=scale_before)

    @staticmethod
    def local_norm_sq(grads: list[torch.Tensor], device=None) -> torch.Tensor:
        """Sum of squares of ``grads``, a 0-dim float64 tensor where they are (``device`` when there are none)."""
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device or comm.device_for_backend())
        if grads[0].dtype == torch.float32:
            norms = torch._foreach_norm(grads)
        else:  # widen one tensor at a time: a widened copy of all of them would cost 4 bytes per element
            norms = [torch._foreach_norm([g.float()])[0] for g in grads]
        return torch.stack(norms).double().pow(2).sum()


def finite_sqrt(total: torch.Tensor) -> torch.Tensor:
    """The norm from a sum of squares: inf when that is not finite (an overflow can make it nan), as DeepSpeed."""
    return torch.where(torch.isfinite(total), total.sqrt(), torch.full_like(total, math.inf))
