"""``zero_optimization.offload_optimizer`` / ``offload_param``: moving model states off the accelerator.

``device: "cpu"`` keeps them in host memory; ``device: "nvme"`` (DeepSpeed's
ZeRO-Infinity) keeps them in files under ``nvme_path`` and brings them through
a bounded pool of host buffers when they are needed (:mod:`zeroengine.offload.nvme`,
tuned by the ``aio`` section).
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, PrivateAttr, model_validator

from ..base import ConfigModel, Fraction, NonNegativeInt, PositiveInt, rule_error
from .aio import AioConfig

OffloadDevice = Literal["cpu", "nvme", "none"]

_NVME_PATH = ("Folder (on a fast local drive) under which this run keeps its swap files, in a per-run folder "
              "removed at engine.destroy() or exit. Required with device 'nvme'; it must exist, be writable and "
              "have room for the swapped state (checked before training starts).")


class _OffloadBlock(ConfigModel):
    _aio: AioConfig | None = PrivateAttr(None)  # the run's aio section, set by the root config

    @property
    def aio(self) -> AioConfig:
        """The ``aio`` settings the NVMe swap uses (the section's defaults for a block built on its own)."""
        return self._aio if self._aio is not None else AioConfig()

    @model_validator(mode="after")
    def _nvme_needs_a_path(self):
        if self.device == "nvme" and not self.nvme_path:
            raise rule_error("device 'nvme' needs nvme_path: the folder to keep the swap files in", ("nvme_path",))
        return self


class OffloadOptimizerConfig(_OffloadBlock):
    """Keep fp32 master weights and optimizer states off the accelerator and step the optimizer on the CPU."""

    device: OffloadDevice = Field(
        description="'cpu' (host memory) or 'nvme' (files under nvme_path, streamed through host buffers) to "
                    "offload; 'none' disables offload (the same as leaving the block out). "
                    "Required: a block without a device would otherwise do nothing.")
    pin_memory: bool = Field(False, description="Use page-locked CPU buffers, for faster and asynchronous "
                                                "GPU<->CPU copies (needs CUDA).")
    nvme_path: Optional[str] = Field(None, description="device 'nvme': " + _NVME_PATH)
    buffer_count: PositiveInt = Field(
        4, description="device 'nvme': host buffers the swap streams through, each one reduce bucket's share "
                       "of masters and optimizer state (host memory: buffer_count x that). With pipeline_read, "
                       "up to buffer_count - 1 buckets are read ahead of the one stepping.")
    pipeline_read: bool = Field(False, description="device 'nvme': read the next buckets' state while the CPU "
                                                   "steps this one (false: read each when its turn comes).")
    pipeline_write: bool = Field(False, description="device 'nvme': write a stepped bucket's state back while the "
                                                    "CPU steps the next (false: wait for each write).")
    fast_init: bool = Field(False, description="device 'nvme': accepted, no effect: the masters are always "
                                               "written to the drive one bucket at a time as they are made, and "
                                               "the optimizer state at its first step.")
    ratio: Fraction = Field(
        1.0, description="Fraction of this rank's optimizer state kept in CPU memory and stepped by the CPU "
                         "optimizer; the rest stays on the accelerator and steps there, while the CPU steps its "
                         "part (DeepSpeed's partial offload). Rounded to whole buckets (reduce_bucket_size); "
                         "any ZeRO stage 1-3.")
    delayed_update: bool = Field(
        False, description="ZeRO-Offload's one-step delayed parameter update (DPU): the CPU optimizer steps "
                           "with this step's gradients in a background thread while the next step's forward "
                           "and backward run, and its result reaches the model one step later (each update "
                           "uses gradients one step stale). Opt-in: it changes the training trajectory "
                           "(benchmarks/bench_delayed_update.py measures by how much). Offloaded buckets "
                           "only; resident ones (ratio below 1) update at once. Costs one fp32 copy of the "
                           "offloaded gradient shard in CPU memory. Between steps the module's weights lag the "
                           "masters by that one update (engine.module.state_dict() at stages 1-2, a read-only "
                           "GatheredParameters at stage 3); save_checkpoint, save_16bit_model and a modifying "
                           "GatheredParameters apply it first, destroy() does not. device 'cpu' only.")
    delayed_update_warmup_steps: NonNegativeInt = Field(
        40, description="Optimizer steps taken without delay before delayed_update starts (as ZeRO-Offload "
                        "does: the first steps, when weights move most, use fresh gradients).")

    @model_validator(mode="after")
    def _no_delayed_update_on_nvme(self) -> "OffloadOptimizerConfig":
        if self.device == "nvme" and self.delayed_update:
            raise rule_error("delayed_update with device 'nvme' is not implemented: the background step would "
                             "stream the state from the drive during the next forward; use device 'cpu' for the "
                             "delayed update, or set delayed_update to false",
                             ("delayed_update",))
        return self


class OffloadParamConfig(_OffloadBlock):
    """Keep 16-bit parameter shards off the accelerator between uses (ZeRO stage 3 only)."""

    device: OffloadDevice = Field(
        description="'cpu' (host memory) or 'nvme' (a swap file under nvme_path, read when a gather needs it) to "
                    "offload; 'none' disables offload (the same as leaving the block out). "
                    "Required: a block without a device would otherwise do nothing.")
    pin_memory: bool = Field(False, description="Use page-locked CPU buffers, for faster and asynchronous "
                                                "GPU<->CPU copies (needs CUDA).")
    nvme_path: Optional[str] = Field(None, description="device 'nvme': " + _NVME_PATH)
    buffer_count: PositiveInt = Field(
        5, description="device 'nvme': host buffers the gathers read parameter chunks into; a prefetch holds one "
                       "until its collective is done, so this also bounds the reads in flight.")
    buffer_size: PositiveInt = Field(
        100_000_000, description="device 'nvme': elements per buffer (at most; a buffer is this rank's largest "
                                 "bucket chunk, which must fit: reduce_bucket_size / world).")
    max_in_cpu: NonNegativeInt = Field(
        1_000_000_000, description="device 'nvme': parameter elements (this rank's chunks, in layout order) kept in "
                                   "host memory rather than on the drive; 0 puts every chunk on the drive.")
