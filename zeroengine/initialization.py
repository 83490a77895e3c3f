"""``zeroengine.initialize``: from a model and a config to a ready engine."""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from zeroengine import comm
from zeroengine.activation_checkpointing.config import configure_from_initialize as configure_checkpointing
from zeroengine.config import ConfigError, load_config, read_config_file
from zeroengine.data import build_dataloader
from zeroengine.engine import Engine
from zeroengine.monitor import build_recorder
from zeroengine.optim.factory import build_optimizer
from zeroengine.optim.muon import tag_muon_parameters
from zeroengine.optim.schedulers import ScheduleParamError, build_scheduler
from zeroengine.parallel.mesh import ProcessMesh, build_mesh, mesh_from_mpu
from zeroengine.pipe.engine import PipelineEngine
from zeroengine.pipe.module import PipelineModule
from zeroengine.precision.loss_scaler import build_loss_scaler
from zeroengine.precision.policy import PrecisionPolicy
from zeroengine.progress import set_log_level
from zeroengine.sequence_parallel import parallel_state
from zeroengine.tensor_parallel.layers import split_of
from zeroengine.tensor_parallel.rng import share_generators
from zeroengine.zero.factory import build_zero_optimizer
from zeroengine.zero.initial_state import broadcast_initial_state
from zeroengine.zero.optimizer import reduced_elsewhere

_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class _StoreBoth(argparse.Action):
    """Store one flag's value under both spellings' names, so a DeepSpeed script that reads
    ``args.deepspeed_config`` / ``args.deepspeed`` sees the same value as ``args.zeroengine_config``."""

    def __init__(self, option_strings, dest, also, const=None, nargs=None, **kwargs):
        self.also = also
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        setattr(namespace, self.dest, value)
        setattr(namespace, self.also, value)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--zeroengine_config`` and DeepSpeed's spellings (``--deepspeed``, ``--deepspeed_config``,
    the deprecated ``--deepscale*``); each value is readable under both names."""
    group = parser.add_argument_group("zeroengine", "zeroengine configuration")
    group.add_argument("--zeroengine", "--deepspeed", "--deepscale", dest="zeroengine", also="deepspeed",
                       action=_StoreBoth, nargs=0, const=True, default=False,
                       help="enable zeroengine (accepted for DeepSpeed script compatibility)")
    group.add_argument("--zeroengine_config", "--deepspeed_config", "--deepscale_config", dest="zeroengine_config",
                       also="deepspeed_config", action=_StoreBoth, default=None,
                       help="path to the JSON/HJSON config file")
    parser.set_defaults(deepspeed=False, deepspeed_config=None)
    # DeepSpeed scripts usually declare --local_rank themselves (DeepSpeed's helper does not add it), often
    # with default -1, and rely on DeepSpeed's launcher passing --local_rank=N. zeroengine's launcher sets
    # LOCAL_RANK instead (--pass_local_rank adds the argument), so it becomes the default: a script that
    # reads args.local_rank gets its rank, not -1 (torch.cuda.set_device(-1) silently keeps GPU 0).
    if "--local_rank" not in parser._option_string_actions:
        group.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                           help="set by launchers that pass it as an argument")
    elif "LOCAL_RANK" in os.environ:
        parser.set_defaults(local_rank=int(os.environ["LOCAL_RANK"]))
    return parser


def _config_from_args(args) -> str | None:
    for name in ("zeroengine_config", "deepspeed_config"):
        path = getattr(args, name, None)
        if path:
            return path
    return None


def _hidden_size_of(model) -> int | None:
    cfg = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    return None


def _trainable_params(model, model_parameters):
    if model_parameters is None:
        return _stepped_here(p for p in model.parameters() if p.requires_grad)
    return _stepped_here(model_parameters)


def _stepped_here(params) -> list:
    """``params`` but a pipeline stage's copies of tied weights: the stage owning them steps them
    (zeroengine/pipe/tied.py)."""
    return [p for p in params if not reduced_elsewhere(p)]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               config=None, collate_fn=None, dist_init_required=None, config_params=None, mpu=None):
    """Wrap ``model`` for distributed, memory-sharded training.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` as
    DeepSpeed does; the dataloader is None unless ``training_data`` is given.
    ``mpu`` (Megatron-style model-parallel unit) gives activation checkpointing
    its model-parallel group for ``partition_activations``.
    """
    if model is None:
        raise ValueError("zeroengine.initialize: model is required")
    from_args = _config_from_args(args)
    if from_args is not None and (config is not None or config_params is not None):
        raise ConfigError("<config>", f"two configs given: args names {from_args!r} (--zeroengine_config / "
                          "--deepspeed_config) and initialize() got config=; pass only one")
    if config is None:
        config = config_params if config_params is not None else from_args
    if config is None:
        raise ConfigError("<config>", "no config given: pass config=<path or dict>, or --zeroengine_config on args")
    if dist_init_required is not False:
        comm.init_distributed()
    mesh = _mesh_for(model, mpu, config)
    cfg = load_config(config, world_size=mesh.dp, hidden_size=_hidden_size_of(model))
    _check_pipeline_config(cfg, model)
    _check_tensor_parallel_config(cfg, mesh)
    set_log_level(cfg.log_level)
    compiled = "torch._dynamo" in sys.modules and (  # (no compiled model without it)
        isinstance(model, torch._dynamo.eval_frame.OptimizedModule)  # torch.compile(model)
        or getattr(model, "_compiled_call_impl", None) is not None)  # model.compile()
    if cfg.zero_optimization.stage == 3 and compiled:
        raise ValueError("torch.compile(model) is not supported at ZeRO stage 3 before initialize: the partitioned "
                         "parameters hold values only while their module runs, which tracing the whole model "
                         "cannot follow; pass the model uncompiled and call engine.compile() (or set "
                         "\"compile\": {\"enabled\": true}), which compiles each block with the gathering "
                         "outside the compiled regions")
    configure_checkpointing(cfg, mpu)
    if cfg.comm_debug or comm.sequence_check_requested():
        comm.enable_sequence_check()

    policy = PrecisionPolicy(cfg.precision_dtype, auto_cast=cfg.fp16.enabled and cfg.fp16.auto_cast,
                             master_dtype=torch.bfloat16 if cfg.bf16.bf16_master_weights_and_grads else torch.float32)
    device = comm.device_for_backend()
    model.to(device)
    tensor_parallel = _split_tensors(cfg, model, mesh)
    # every data-parallel replica starts from the first replica's weights, as under DeepSpeed and DDP
    broadcast_initial_state(model, mesh)
    if isinstance(model, PipelineModule):
        model.tied.sync()  # each stage's copy of a tied weight starts from its owner's
    autoep = _convert_moe_blocks(cfg, model)  # after the broadcast: each rank keeps its experts of rank 0's values

    torch_optimizer = _resolve_optimizer(cfg, model, optimizer, model_parameters)
    if torch_optimizer.state:
        raise ValueError("zeroengine needs a fresh optimizer: the one passed in has already stepped")

    loss_scaler = build_loss_scaler(
        fp16_enabled=cfg.fp16.enabled, loss_scale=cfg.fp16.loss_scale, initial_scale_power=cfg.fp16.initial_scale_power,
        loss_scale_window=cfg.fp16.loss_scale_window, hysteresis=cfg.fp16.hysteresis,
        consecutive_hysteresis=cfg.fp16.consecutive_hysteresis, min_loss_scale=cfg.fp16.min_loss_scale,
    )
    zero_optimizer = build_zero_optimizer(
        cfg.zero_optimization.stage, model, torch_optimizer, policy, loss_scaler,
        cfg.zero_optimization, cfg.gradient_clipping,
        comm_dtype=_reduction_dtype(cfg, mesh),
        allow_untested_optimizer=cfg.zero_allow_untested_optimizer, mesh=mesh,
    )
    zero_optimizer.skip_nonfinite_steps = bool(cfg.bf16.enabled and cfg.bf16.check_grad_overflow)
    scheduler = _resolve_scheduler(cfg, torch_optimizer, lr_scheduler)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if isinstance(model, PipelineModule):
        engine = PipelineEngine(model, zero_optimizer, cfg, policy, lr_scheduler=scheduler, local_rank=local_rank,
                                mesh=mesh, schedule=cfg.pipeline.schedule)
    else:
        engine = Engine(model, zero_optimizer, cfg, policy, lr_scheduler=scheduler, local_rank=local_rank, mesh=mesh)
    engine.monitor = build_recorder(cfg.monitor, comm.get_rank())
    engine.autoep = autoep
    engine.autotp = tensor_parallel
    if mesh.model_parallel and comm.get_rank() == 0:
        logging.getLogger("zeroengine").info(f"process mesh: {mesh.describe()}")
    if cfg.compile.enabled:
        engine.compile(backend=cfg.compile.backend, compile_kwargs=cfg.compile.kwargs)
    loader = None
    if training_data is not None:
        # every rank of a sequence group reads its own samples (UlyssesSPDataLoaderAdapter shares them out)
        loader = build_dataloader(training_data, cfg.train_micro_batch_size_per_gpu, collate_fn=collate_fn,
                                  rank=mesh.zero_rank, world_size=mesh.zero_size, drop_last=cfg.dataloader_drop_last)
        engine.training_dataloader = loader  # (its position goes into every checkpoint; a pipeline reads it too)
    return engine, zero_optimizer, loader, scheduler


def _reduction_dtype(cfg, mesh: ProcessMesh) -> torch.dtype | None:
    """``communication_data_type``; with sequence parallelism ``seq_parallel_communication_data_type`` (fp32 by
    default), which overrides it, as in DeepSpeed."""
    if mesh.sp > 1:
        return _COMM_DTYPES[cfg.seq_parallel_communication_data_type]
    return _COMM_DTYPES.get(cfg.communication_data_type) if cfg.communication_data_type else None


def _mesh_for(model, mpu, config) -> ProcessMesh:
    """The process mesh: a PipelineModule's (made when it was built), an mpu's groups (Megatron's, or the
    sequence-parallel one register_with_transformers returns), the config's tensor- or sequence-parallel size, or
    every rank a data-parallel replica."""
    tp, sp = _requested_size(config, "tensor_parallel"), _requested_size(config, "sequence_parallel_size")
    if isinstance(model, PipelineModule):
        if mpu is not None:
            raise ValueError("initialize(mpu=...) with a PipelineModule: the module made its own pipeline × data "
                             "mesh; pass one or the other")
        if sp > 1:
            raise ConfigError("sequence_parallel_size", f"{sp} with a PipelineModule: sequence and pipeline "
                              "parallelism do not compose yet")
        return model.mesh
    if mpu is not None and parallel_state.is_sequence_mpu(mpu):
        mesh = parallel_state.mesh_of_mpu(mpu)
        if sp not in (1, mesh.sp):
            raise ConfigError("sequence_parallel_size", f"{sp}, but the mpu splits sequences {mesh.sp} ways")
        return mesh
    if mpu is not None:
        if sp > 1:
            raise ConfigError("sequence_parallel_size", f"{sp} with a Megatron-style mpu: pass the mpu "
                              "UlyssesSPAttentionHF.register_with_transformers returns instead")
        return mesh_from_mpu(mpu)
    if sp > 1 and tp > 1:
        raise ConfigError("sequence_parallel_size", f"{sp} with tensor_parallel.autotp_size {tp}: sequence and "
                          "tensor parallelism do not compose yet")
    key = "sequence_parallel_size" if sp > 1 else "tensor_parallel.autotp_size"
    try:
        mesh = build_mesh(pp=1, tp=tp, sp=sp, what=key)
    except ValueError as error:
        raise ConfigError(key, str(error).removeprefix(f"{key}: ")) from None
    parallel_state.adopt_mesh(mesh)
    return mesh


def _requested_size(config, key: str) -> int:
    """``tensor_parallel.autotp_size`` (or ``tp.tp_size``), or ``sequence_parallel_size``, as given, read before the
    config is resolved: the data-parallel size the batch sizes are resolved for depends on it. Checked properly
    by load_config."""
    if hasattr(config, key):
        section = getattr(config, key)
        return section.size if key == "tensor_parallel" else section
    data = read_config_file(config) if isinstance(config, (str, os.PathLike)) else config
    value = data.get(key) if isinstance(data, dict) else None
    if key == "tensor_parallel":
        if not isinstance(value, dict):
            return 1
        value = value.get("autotp_size", (value.get("tp") or {}).get("tp_size", 1))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def _check_tensor_parallel_config(cfg, mesh: ProcessMesh) -> None:
    tp = cfg.tensor_parallel.size
    if tp != mesh.tp and not (tp == 1 and mesh.tp > 1):
        raise ConfigError("tensor_parallel.autotp_size", f"{tp}, but the model's mesh splits tensors {mesh.tp} ways "
                          f"({mesh.describe()}); make them agree")


def _check_tensor_splits(model, mesh: ProcessMesh) -> None:
    """Tensor-parallel layers of one's own must be cut as many ways as the mesh cuts tensors (a layer built
    before the mesh, or on another one, would otherwise train as a different model on every rank)."""
    wrong = [(name, split_of(p).parts) for name, p in model.named_parameters()
             if split_of(p) is not None and split_of(p).parts != mesh.tp]
    if wrong:
        name, parts = wrong[0]
        raise ValueError(f"the model's tensor-parallel parameter {name!r}" + (f" (and {len(wrong) - 1} more)" if
                         len(wrong) > 1 else "") + f" is split {parts} ways, but the mesh splits tensors {mesh.tp} "
                         f"ways ({mesh.describe()}): build the layers with the mesh's tensor group "
                         "(group=mesh.tensor_group, or inside zeroengine.parallel.use_mesh(mesh))")


def _split_tensors(cfg, model, mesh: ProcessMesh):
    """Tensor parallelism: the model's layers split across the tensor group (AutoTP), unless the model is built
    from tensor-parallel layers already (a PipelineModule of them, or a user's own)."""
    _check_tensor_splits(model, mesh)
    if mesh.tp == 1:
        return None
    if any(split_of(p) is not None for p in model.parameters()):
        share_generators(mesh.tensor_group)  # (AutoTP's convert does this itself; tensor_parallel/rng.py says why)
        return None
    if cfg.tensor_parallel.size == 1:
        # The mesh splits tensors (an mpu's, a PipelineModule's topology) but AutoTP was not asked for: the model's
        # layers are split by the user's own code (Megatron's), which zeroengine takes as they are.
        return None
    from zeroengine.tensor_parallel.autotp import convert
    from zeroengine.zero.init import is_init_partitioned

    if any(is_init_partitioned(p) for p in model.parameters()):
        raise ConfigError("tensor_parallel.autotp_size", f"{mesh.tp}, but the model was built under "
                          "zeroengine.zero.Init, which already partitioned its weights over every rank; AutoTP "
                          "cuts whole weights: build the model without Init (ZeRO 3 then partitions each tensor "
                          "slice over the data-parallel group)")
    broadcast_initial_state(model)  # the whole model, the same on every rank, before each keeps its slices
    try:
        result = convert(model, mesh.tensor_group)
    except ValueError as error:
        raise ConfigError("tensor_parallel.autotp_size", str(error)) from None
    if result.layers == 0:
        raise ConfigError("tensor_parallel.autotp_size", f"{mesh.tp}, but the model has no layer AutoTP recognises "
                          "(GPT-2 or Llama-style attention and MLP blocks, stacked MoE experts); build it from "
                          "zeroengine.tensor_parallel's ColumnParallelLinear / RowParallelLinear instead")
    if comm.get_rank() == 0:
        logging.getLogger("zeroengine").info(
            f"tensor_parallel: {len(result.attention)} attention, {len(result.mlp)} MLP and {len(result.experts)} "
            f"stacked-expert blocks split {mesh.tp} ways; embeddings {result.embeddings}")
    return result


def _check_pipeline_config(cfg, model) -> None:
    stages = cfg.pipeline.stages
    if isinstance(model, PipelineModule):
        if stages != "auto" and stages != model.num_stages:
            raise ConfigError("pipeline.stages", f"{stages}, but the PipelineModule has num_stages={model.num_stages}; "
                              "set it to \"auto\" or to the module's value")
        _check_interleaving(cfg, model)
        if cfg.zero_optimization.stage > 1 and model.num_stages > 1:
            raise ConfigError("zero_optimization.stage", f"stage {cfg.zero_optimization.stage} with a PipelineModule: "
                              "pipeline parallelism composes with ZeRO stages 0 and 1 (as in DeepSpeed): stage 2 "
                              "would reduce each micro-batch's gradients as backward produces them, and stage 3 "
                              "gather parameters per micro-batch, once per micro-batch in flight; use stage 1")
    elif stages != "auto" and stages > 1:
        raise ConfigError("pipeline.stages", f"{stages} stages, but the model is not a zeroengine.pipe.PipelineModule; "
                          "build it as one (its layers as a list) to train it as a pipeline")


def _check_interleaving(cfg, model) -> None:
    schedule, chunks, stages = cfg.pipeline.schedule, model.virtual_stages, model.num_stages
    if schedule == "interleaved" and chunks == 1:
        raise ConfigError("pipeline.schedule", "\"interleaved\" needs model chunks to interleave: build the "
                          "PipelineModule with virtual_stages > 1 (or use \"1f1b\")")
    if chunks > 1 and schedule == "gpipe":
        raise ConfigError("pipeline.schedule", f"\"gpipe\", but the PipelineModule has virtual_stages={chunks}, "
                          "which run the interleaved 1F1B schedule: set \"interleaved\" (or \"1f1b\")")
    steps = cfg.gradient_accumulation_steps
    if chunks > 1 and steps % stages:
        raise ConfigError("gradient_accumulation_steps", f"{steps} micro-batches per step, but the interleaved "
                          f"schedule of {stages} stages needs a multiple of {stages}")


def _convert_moe_blocks(cfg, model):
    """AutoEP (the ``expert_parallel`` section): the model's MoE blocks get expert-parallel experts."""
    if not cfg.expert_parallel.enabled:
        return None
    from zeroengine.moe.autoep import convert_moe_blocks

    try:
        conversion = convert_moe_blocks(model, cfg.expert_parallel)
    except ValueError as error:
        raise ConfigError("expert_parallel", str(error).removeprefix("expert_parallel: ")) from None
    if comm.get_rank() == 0:
        logging.getLogger("zeroengine").info(
            f"expert_parallel: {len(conversion.blocks)} MoE blocks of {conversion.num_experts} experts spread over "
            f"expert-parallel groups of {conversion.ep_size} (preset {conversion.preset or 'custom'})")
    return conversion


def _resolve_optimizer(cfg, model, optimizer, model_parameters):
    """Build the torch optimizer from the config, or adopt the one passed in (an instance or a callable)."""
    params = _trainable_params(model, model_parameters)
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("optimizer", "an optimizer was passed to initialize() and the config has an "
                          "'optimizer' section too; keep one of them")
    if optimizer is None and cfg.optimizer is None:
        raise ConfigError("optimizer", "no optimizer: add an 'optimizer' section to the config "
                          "or pass optimizer= to initialize()")
    if optimizer is None:
        if cfg.optimizer.type == "Muon":  # which parameters Muon steps: a property of each (DeepSpeed's tagging)
            per_head = bool(cfg.optimizer.params.get("per_head_muon", False))
            if not tag_muon_parameters(model, per_head) and per_head:
                raise ConfigError("optimizer.params.per_head_muon", "no attention projection could be tagged (q/k/v "
                                  "projections named as in Hugging Face models, whose rows match the model config's "
                                  "heads x head_dim): per-head Newton-Schulz would be inactive; unset it")
        lean = None  # bf16 masters: Adam's moments in bf16 (bf16_optimizer_states) or fp32
        if cfg.bf16.bf16_master_weights_and_grads:
            lean = torch.bfloat16 if cfg.bf16.bf16_optimizer_states else torch.float32
        torch_optimizer = build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), params,
                                          offload_optimizer=cfg.zero_optimization.offload_optimizer is not None,
                                          bf16_masters_state_dtype=lean)
    elif cfg.bf16.bf16_master_weights_and_grads:
        raise ConfigError("bf16.bf16_master_weights_and_grads", "bf16 masters need the optimizer built from the "
                          "config's 'optimizer' section (Adam or AdamW): a torch optimizer passed in would keep "
                          "its moments in bf16 and compute in bf16")
    elif callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        torch_optimizer = optimizer(params)
    else:
        torch_optimizer = optimizer
    if not isinstance(torch_optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(torch_optimizer).__name__}")
    for group in torch_optimizer.param_groups:  # (an optimizer built by the caller over all the parameters)
        group["params"] = _stepped_here(group["params"])
    model_param_ids = {id(p) for p in model.parameters()}
    stepped = [p for g in torch_optimizer.param_groups for p in g["params"]]
    foreign = [p for p in stepped if id(p) not in model_param_ids]
    if foreign:
        raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model")
    return torch_optimizer


def _resolve_scheduler(cfg, torch_optimizer, lr_scheduler):
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("scheduler", "an lr_scheduler was passed to initialize() and the config has a "
                          "'scheduler' section too; keep one of them")
    if cfg.scheduler is not None:
        try:
            return build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), torch_optimizer)
        except ScheduleParamError as error:  # checks that need the optimizer (one value per param group)
            raise ConfigError(f"scheduler.params.{error.param}", str(error)) from None
    if lr_scheduler is not None and callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(torch_optimizer)
    return lr_scheduler
