"""``compile``: torch.compile the model block by block at ``initialize`` (see zeroengine/compilation.py).

The keys are DeepSpeed's ``CompileConfig`` (``enabled``, ``backend``, ``kwargs``, as
``engine.compile(backend, compile_kwargs)`` takes them). DeepSpeed's DeepCompile is not
implemented: ``deepcompile`` must be false, and the keys that configure only DeepCompile's
passes are accepted and ignored then, so configs that list them switched off still load.
"""
from __future__ import annotations

from typing import Any, Dict

from pydantic import Field, model_validator

from ..base import ConfigModel, rule_error

DEEPCOMPILE_KEYS = ("autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
                    "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory",
                    "debug_log", "offload_parameters", "sync_before_reduce", "sync_after_reduce",
                    "sync_before_allgather", "sync_after_allgather", "keep_int_input_tensors",
                    "keep_all_input_tensors", "passes")


class CompileConfig(ConfigModel):
    """torch.compile per block, at any ZeRO stage (``engine.compile()`` at initialize)."""

    enabled: bool = Field(False, description="Compile the model at initialize (what engine.compile() does: each "
                                             "block's forward under torch.compile, ZeRO's hooks outside the "
                                             "compiled regions; at stage 3 each block's parameters are gathered "
                                             "at once, as FSDP2 does).")
    backend: str = Field("inductor", description="torch.compile's backend.")
    kwargs: Dict[str, Any] = Field(default_factory=dict, description="Further torch.compile arguments (mode, "
                                                                     "fullgraph, dynamic, options).")
    deepcompile: bool = Field(False, description="DeepSpeed's DeepCompile: not supported, must be false (its "
                                                 "other keys are then accepted and ignored).")

    @model_validator(mode="before")
    @classmethod
    def _drop_deepcompile_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("deepcompile") is True:
            raise rule_error("deepcompile is DeepSpeed's DeepCompile, which zeroengine does not implement; set "
                             "deepcompile=false (enabled=true compiles each block with torch.compile)",
                             ("deepcompile",))
        return {k: v for k, v in data.items() if k not in DEEPCOMPILE_KEYS}
