"""``tensor_parallel``: AutoTP training (DeepSpeed's ``TPTrainingConfig`` keys; zeroengine/tensor_parallel).

``autotp_size`` N > 1 splits the model's attention and MLP projections (and the vocabulary of its embedding
and LM head) across N ranks; data parallelism (and ZeRO) gets the world divided by N (and by the pipeline
stages). DeepSpeed's keys that tune its kernels or its injection policies are accepted when left at their
defaults; the ones that would change what is split are errors rather than silently ignored.
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, model_validator

from ..base import ConfigModel, NonNegativeInt, rule_error

# DeepSpeed keys with no effect here at their default values (kernel choices, injection policies, dtype).
_INERT_AT_DEFAULT = {"injection_policy_tuple": None, "partition_config": None,
                     "preset_model": None, "keep_module_on_host": False, "replace_with_kernel_inject": False,
                     "kernel_inject": False, "vocab_parallel_lm_head": None, "vocab_parallel_ce_backend": "torch"}


class TensorParallelConfig(ConfigModel):
    """Tensor parallelism: Megatron-style splits of the model's layers (AutoTP for Hugging Face models)."""

    autotp_size: NonNegativeInt = Field(0, description="Tensor-parallel ranks per layer (0 or 1: none). The model's "
                                                       "recognised layers (GPT-2 and Llama-style attention and MLP, "
                                                       "the embedding and LM head) are split at initialize.")
    dtype: Optional[str] = Field(None, description="Accepted, no effect: the training dtype comes from fp16/bf16.")

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if not isinstance(data.pop("tp_overlap_comm", False), bool):
            raise rule_error("tp_overlap_comm must be true or false (a performance knob: no effect here)",
                             ("tp_overlap_comm",))
        inner = data.pop("tp", None) or data.pop("tensor_parallel", None) or {}
        if isinstance(inner, dict) and "tp_size" in inner:
            if data.get("autotp_size", inner["tp_size"]) != inner["tp_size"]:
                raise rule_error(f"tp.tp_size ({inner['tp_size']}) differs from autotp_size "
                                 f"({data['autotp_size']}); give one of them", ("tp", "tp_size"))
            data.setdefault("autotp_size", inner["tp_size"])
        for key, default in _INERT_AT_DEFAULT.items():
            if key in data:
                value = data.pop(key)
                if value not in (default, None, False):
                    raise rule_error(f"{value!r}: DeepSpeed's {key} is not implemented (zeroengine splits the "
                                     "layers it recognises, its own way); leave it at its default", (key,))
        return data

    @property
    def size(self) -> int:
        return max(1, self.autotp_size)
