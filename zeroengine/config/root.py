"""ZeroEngineConfig: the whole config, as the engine reads it.

Attributes are DeepSpeed's key names (``cfg.train_batch_size``,
``cfg.zero_optimization.stage``). Build it with ``load_config``: that applies
the deprecated spellings, "auto" and the batch-size triangle, which this model
alone does not (it only checks the keys and their types).
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from .base import ConfigModel, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, rule_error
from .errors import ConfigError
from .sections.activation_checkpointing import ActivationCheckpointingConfig
from .sections.aio import AioConfig
from .sections.checkpoint import CheckpointConfig
from .sections.compile import CompileConfig
from .sections.expert_parallel import ExpertParallelConfig
from .sections.monitor import MonitorConfig
from .sections.optimizer import OptimizerConfig
from .sections.pipeline import PipelineConfig
from .sections.precision import BF16Config, FP16Config
from .sections.scheduler import SchedulerConfig
from .sections.tensor_parallel import TensorParallelConfig
from .sections.zero import ZeroConfig
from .translate import problems_from

_BATCH = " Any two of train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps " \
         "determine the third (see 'Batch size')."


class ZeroEngineConfig(ConfigModel):
    """A complete, validated zeroengine (DeepSpeed-compatible) config."""

    train_batch_size: Optional[PositiveInt] = Field(
        None, description="Samples per optimizer step, over all data-parallel ranks." + _BATCH)
    train_micro_batch_size_per_gpu: Optional[PositiveInt] = Field(
        None, description="Samples per forward/backward on one rank." + _BATCH)
    gradient_accumulation_steps: Optional[PositiveInt] = Field(
        None, description="Micro-batches accumulated per optimizer step." + _BATCH)
    gradient_clipping: NonNegativeFloat = Field(
        1.0, description="Clip the global gradient norm to this value; 0 disables clipping. The default, 1.0, is "
                         "DeepSpeed's since 0.19.3 (0 before).")
    steps_per_print: Optional[NonNegativeInt] = Field(
        10, description="Log progress every this many optimizer steps; null, 0 or infinity: never (DeepSpeed's "
                   "default).")
    wall_clock_breakdown: bool = Field(False, description="Time forward, backward and step (synchronising CUDA "
                                                          "around each), and log their mean per optimizer step "
                                                          "every steps_per_print steps.")
    dataloader_drop_last: bool = Field(False, description="Drop the last incomplete batch of the dataloader "
                                                          "that initialize() builds from training_data.")
    optimizer: Optional[OptimizerConfig] = Field(None, description="Optimizer to build (see 'optimizer').")
    scheduler: Optional[SchedulerConfig] = Field(None, description="Learning-rate schedule to build "
                                                                   "(see 'scheduler').")
    fp16: FP16Config = Field(default_factory=FP16Config, description="float16 mixed precision (see 'fp16').")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bfloat16 mixed precision (see 'bf16'); "
                                                                     "DeepSpeed's old name 'bfloat16' works too.")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig,
                                          description="ZeRO stage and its options (see 'zero_optimization').")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig,
        description="Activation recompute options (see 'activation_checkpointing').")
    aio: AioConfig = Field(default_factory=AioConfig,
                           description="Asynchronous I/O of NVMe offload (see 'aio'); no effect without it.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="Checkpoint save/load options (see 'checkpoint').")
    monitor: MonitorConfig = Field(default_factory=MonitorConfig,
                                   description="Metrics writers (see 'monitor').")
    compile: CompileConfig = Field(default_factory=CompileConfig,
                                   description="torch.compile block by block at initialize (see 'compile').")
    expert_parallel: ExpertParallelConfig = Field(
        default_factory=ExpertParallelConfig,
        description="AutoEP: expert parallelism for Hugging Face MoE models (see 'expert_parallel').")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig,
                                     description="Pipeline parallelism for a PipelineModule (see 'pipeline').")
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig,
        description="Tensor parallelism (AutoTP) across autotp_size ranks (see 'tensor_parallel').")
    sequence_parallel_size: PositiveInt = Field(
        1, description="Ulysses sequence parallelism: each sequence is split across this many ranks, which switch "
                       "to splitting attention heads around attention (two all-to-alls); ZeRO partitions over data "
                       "× sequence ranks. Batch sizes count data-parallel ranks only (see docs/long-context.md).")
    seq_parallel_communication_data_type: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="With sequence parallelism, the dtype gradients are reduced in over data × sequence "
                            "ranks (DeepSpeed's rule: it overrides communication_data_type; any capitalisation).")
    zero_allow_untested_optimizer: bool = Field(
        False, description="Allow a client optimizer other than Adam/AdamW/SGD/CPUAdam with ZeRO stages 1-3.")
    gradient_predivide_factor: PositiveFloat = Field(
        1.0, description="Accepted, no effect: zeroengine sums gradients and divides by the world size after "
                         "the reduction (DeepSpeed's factor moves part of that division before it, which "
                         "changes only rounding, and overflow of fp16 reductions over large worlds).")
    prescale_gradients: bool = Field(False, description="Accepted at either value, no effect (as "
                                                        "gradient_predivide_factor).")
    communication_data_type: Optional[Literal["fp32", "fp16", "bf16"]] = Field(
        None, description="Dtype of gradient reductions (any capitalisation; null: the training dtype).")
    log_level: Optional[Literal["debug", "info", "warning", "error", "critical"]] = Field(
        None, description="Level of the 'zeroengine' logger (any capitalisation); null leaves it as it is "
                          "(INFO unless the application set it).")
    comm_debug: bool = Field(False, description="zeroengine's own key: record the sequence of collectives on "
                                                "every rank and fail with a report when ranks diverge, instead "
                                                "of hanging.")

    # The input this config was built from and the hidden size used for "auto",
    # so that load_config(cfg, world_size=...) can re-resolve it for another world.
    _source_data: Optional[dict] = PrivateAttr(default=None)
    _hidden_size: Optional[int] = PrivateAttr(default=None)
    # Every value as built, to notice a config object changed by assignment before it is re-resolved.
    _built: Optional[dict] = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        # Direct construction reports problems like load_config does, never as a pydantic error.
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise ConfigError.from_problems(problems_from(error, type(self))) from None

    @field_validator("aio", mode="before")
    @classmethod
    def _aio_null_is_default(cls, value: Any) -> Any:
        return {} if value is None else value  # DeepSpeed's dumped configs write "aio": null

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinity_is_never(cls, value: Any) -> Any:
        # accelerate writes float("inf") (DeepSpeed's "never print"); JSON's Infinity reads the same.
        return None if isinstance(value, float) and value == float("inf") else value

    @field_validator("log_level", "communication_data_type", "seq_parallel_communication_data_type", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        # DeepSpeed lower-cases these names before looking them up ("FP16" is fp16).
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_half_precision(self) -> "ZeroEngineConfig":
        if self.fp16.enabled and self.bf16.enabled:
            raise rule_error("both fp16.enabled and bf16.enabled are true; enable at most one of them",
                             ("fp16", "enabled"))
        return self

    @model_validator(mode="after")
    def _bf16_masters_where_built(self) -> "ZeroEngineConfig":
        if not self.bf16.bf16_master_weights_and_grads:
            return self
        why = None
        if not self.bf16.enabled:
            why = "needs bf16.enabled (the parameters it keeps as masters are bf16)"
        elif int(self.zero_optimization.stage) == 0:
            why = "needs ZeRO stage 1, 2 or 3 (as in DeepSpeed)"
        elif self.zero_optimization.offload_optimizer is not None and \
                self.zero_optimization.offload_optimizer.device == "nvme":
            why = ("is not built with offload_optimizer.device \"nvme\" (the swap files hold fp32 masters and "
                   "moments): use device \"cpu\"")
        elif self.optimizer is not None and self.optimizer.type not in ("Adam", "AdamW"):
            why = f"is built for Adam and AdamW, not {self.optimizer.type}"
        if why:
            raise rule_error(f"bf16_master_weights_and_grads {why}", ("bf16", "bf16_master_weights_and_grads"))
        return self

    @model_validator(mode="after")
    def _offload_reads_aio(self) -> "ZeroEngineConfig":
        # The NVMe swap is built from the offload block alone; it carries the run's aio settings with it.
        for block in (self.zero_optimization.offload_optimizer, self.zero_optimization.offload_param):
            if block is not None:
                block._aio = self.aio
        return self

    @property
    def zero_stage(self) -> int:
        """``zero_optimization.stage`` as an int."""
        return int(self.zero_optimization.stage)

    @property
    def precision_dtype(self):
        """The training dtype: torch.bfloat16, torch.float16 or torch.float32."""
        import torch  # deferred: the config package itself does not need torch
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    def to_dict(self) -> dict:
        """The resolved config as plain JSON data; loads back into an equal config."""
        return self.model_dump(mode="json")

    # Read as a dict too, as DeepSpeed's ``engine.config`` is: transformers asks
    # ``engine.config.get("zero_optimization", {}).get("stage")``. The values are the resolved ones
    # (``to_dict()``: "auto" filled in, every key present with its default), never the raw input.
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in type(self).model_fields

    def keys(self):
        return self.to_dict().keys()

    def items(self):
        return self.to_dict().items()
