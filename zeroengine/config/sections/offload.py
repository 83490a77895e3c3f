"""``zero_optimization.offload_optimizer`` / ``offload_param``: moving model states to CPU memory.

zeroengine offloads to CPU memory only. DeepSpeed's NVMe tier (ZeRO-Infinity)
is not implemented, so ``device: "nvme"`` is an error rather than a silent
fallback to CPU; the NVMe-only tuning keys are listed in ``unsupported.py``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ..base import ConfigModel, Fraction, NonNegativeInt

OffloadDevice = Literal["cpu", "none"]


def _check_device(value: object) -> object:
    if value == "nvme":
        raise ValueError("NVMe offload (DeepSpeed's ZeRO-Infinity) is not implemented by zeroengine; "
                         "use 'cpu', or 'none' for no offload")
    return value


class OffloadOptimizerConfig(ConfigModel):
    """Keep fp32 master weights and optimizer states in CPU memory and step the optimizer there."""

    device: OffloadDevice = Field(
        description="'cpu' to offload; 'none' disables offload (the same as leaving the block out). "
                    "Required: a block without a device would otherwise do nothing.")
    pin_memory: bool = Field(False, description="Use page-locked CPU buffers, for faster and asynchronous "
                                                "GPU<->CPU copies (needs CUDA).")
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
                           "GatheredParameters apply it first, destroy() does not.")
    delayed_update_warmup_steps: NonNegativeInt = Field(
        40, description="Optimizer steps taken without delay before delayed_update starts (as ZeRO-Offload "
                        "does: the first steps, when weights move most, use fresh gradients).")

    _device_is_supported = field_validator("device", mode="before")(_check_device)


class OffloadParamConfig(ConfigModel):
    """Keep 16-bit parameter shards in CPU memory between uses (ZeRO stage 3 only)."""

    device: OffloadDevice = Field(
        description="'cpu' to offload; 'none' disables offload (the same as leaving the block out). "
                    "Required: a block without a device would otherwise do nothing.")
    pin_memory: bool = Field(False, description="Use page-locked CPU buffers, for faster and asynchronous "
                                                "GPU<->CPU copies (needs CUDA).")

    _device_is_supported = field_validator("device", mode="before")(_check_device)
