"""The one place the ZeRO stage number is switched on.

Each builder receives the model in fp32 (on its device) and the torch
optimizer over its fp32 parameters, and leaves the model's trainable
parameters in the policy's dtype, with the optimizer pointed at whatever
the stage steps (fp32 masters, shard pieces, or the parameters themselves).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from zeroengine import comm
from zeroengine.config import ConfigError
from zeroengine.offload.nvme import InCpuBudget
from zeroengine.optim.partitioned import PartitionAware
from zeroengine.parallel.mesh import ProcessMesh, data_parallel_mesh
from zeroengine.precision.master_weights import MasterWeights
from zeroengine.tensor_parallel.layers import split_of

from . import gather_order, host_memory
from .blocks import find_blocks
from .fetcher import FetchPolicy, Unit
from .flat_params import FlatParamBuffer
from .gather_order import GatherOrderCheck
from .grad_stores import BucketReducer, FullGradStore, PartitionedGradStore
from .init import InitReshard, is_init_partitioned
from .layout import build_layout
from .moe_split import ExpertDataParallelOptimizer, ExpertShardedOptimizer, ParamDomain, split_domains
from .optimizer import ZeroOptimizer, trained_group_of
from .param_guard import full_shape
from .partition_info import attach_partition
from .partitioned_params import FetchStats, PartitionedParamBuffer
from .records import record_buffer
from .sharded import ShardedOptimizer
from .stage0 import DataParallelOptimizer
from .stage3 import Stage3Optimizer, Stage3Params, persistent_buckets, split_params
from .stage3_hooks import Stage3Hooks

IMPLEMENTED_STAGES = (0, 1, 2, 3)


def build_zero_optimizer(stage: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer, policy, loss_scaler,
                         zero_config, gradient_clipping: float, comm_dtype: torch.dtype | None,
                         allow_untested_optimizer: bool = False, mesh: ProcessMesh | None = None) -> ZeroOptimizer:
    """The ZeRO strategy of ``stage`` over the data × sequence group of ``mesh`` (the whole world by default); under
    model parallelism the gradient norm also adds up over the mesh's model group."""
    mesh = mesh or data_parallel_mesh()
    zero = _build(stage, module, optimizer, policy, loss_scaler, zero_config, gradient_clipping, comm_dtype,
                  allow_untested_optimizer, mesh)
    # tensor parallelism: what every tensor rank holds alike counts in the norm once, on the first tensor rank
    replicated = {id(p) for p in module.parameters() if split_of(p) is None} if mesh.tp_rank > 0 else set()
    for part in [zero] + list(getattr(zero, "parts", [])):
        part.model_parallel, part.model_group = mesh.model_parallel, mesh.model_group
        if replicated:
            part.set_norm_skip(replicated)
    return zero


def _build(stage, module, optimizer, policy, loss_scaler, zero_config, gradient_clipping, comm_dtype,
           allow_untested_optimizer, mesh):
    if stage > 0:
        check_shardable(optimizer, allow_untested_optimizer)
    if stage != 3 and any(is_init_partitioned(p) for p in module.parameters()):
        raise ConfigError("zero_optimization.stage", f"the model was built under zeroengine.zero.Init, which "
                          f"partitions its parameters for ZeRO stage 3, but the config asks for stage {stage}; "
                          "use stage 3, or build the model without Init")
    stepped = set(trained_group_of(optimizer))
    if stage == 3 and _has_moe(module):
        _check_stage3_experts(module, stepped)
    # MoE: expert parameters are reduced and partitioned within their expert-data-parallel group.
    domains = split_domains([p for p in reversed(list(module.parameters())) if id(p) in stepped])
    if domains and mesh.sp > 1:
        raise ConfigError("sequence_parallel_size", f"MoE layers with sequence parallelism ({mesh.describe()}) are "
                          "not supported yet: expert groups are cut from the whole world")
    if isinstance(optimizer, PartitionAware) and (domains or mesh.tp > 1):
        what = "MoE expert parameters" if domains else f"tensor parallelism ({mesh.describe()})"
        raise ConfigError("optimizer.type", f"{type(optimizer).__name__} reduces row and column statistics over "
                          f"whole matrices, which is not built for {what}: use Adam/AdamW/SGD there")
    if domains and mesh.model_parallel:
        raise ConfigError("expert_parallel", f"MoE layers with tensor or pipeline parallelism ({mesh.describe()}) are "
                          "not supported yet: expert groups are cut from the whole world")
    if domains:
        if stage == 0:
            return _build_stage0(module, optimizer, policy, loss_scaler, zero_config, gradient_clipping, comm_dtype,
                                 domains)
        if stage == 3:
            return _build_stage3(module, optimizer, policy, loss_scaler, zero_config, gradient_clipping, comm_dtype,
                                 domains)
        parts = _sharded_parts(stage, module, optimizer, policy, loss_scaler, zero_config, gradient_clipping,
                               comm_dtype, domains)
        return ExpertShardedOptimizer(parts, optimizer, policy, loss_scaler, gradient_clipping)
    # ZeRO partitions and averages over the ranks holding this model slice: data × sequence (see
    # zeroengine/sequence_parallel/loss.py for why the average over sequence ranks is the exact gradient)
    data = ParamDomain([], mesh.zero_group, mesh.zero_rank, mesh.zero_size, mesh.zero_size)
    if stage == 0:
        return _build_stage0(module, optimizer, policy, loss_scaler, zero_config, gradient_clipping, comm_dtype,
                             dp_group=data.group)
    if stage in (1, 2):
        return _build_sharded(stage, module, optimizer, policy, loss_scaler, zero_config, gradient_clipping,
                              comm_dtype, data)
    if stage == 3:
        return _build_stage3(module, optimizer, policy, loss_scaler, zero_config, gradient_clipping, comm_dtype,
                             data=data)
    raise ConfigError(
        "zero_optimization.stage",
        f"stage {stage} is not available in this build yet (implemented: {IMPLEMENTED_STAGES})",
    )


# Optimizers whose update of an element depends only on that element's own
# gradient and state: stepping a flat shard gives exactly the unsharded result.
_ELEMENTWISE = ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Rprop", "CPUAdam", "LeanAdam",
                "FusedAdam")


def check_shardable(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """Stages 1-3 step flat slices; an optimizer that looks at whole tensors (LAMB's trust ratio,
    Adafactor's factored moments, L-BFGS) would silently compute something else."""
    name = type(optimizer).__name__
    if name in _ELEMENTWISE or allow_untested or isinstance(optimizer, PartitionAware):
        return
    raise ConfigError("zero_allow_untested_optimizer",
                      f"{name} is not known to be elementwise, and ZeRO stages 1-3 step flat shards of each "
                      f"parameter; use one of {', '.join(_ELEMENTWISE)}, stage 0, or set "
                      "zero_allow_untested_optimizer: true if its update is elementwise")


def _check_stage3_experts(module: torch.nn.Module, stepped: set[int]) -> None:
    """Stage 3 partitions expert parameters within their expert-data-parallel group; what it cannot do yet is
    refused before anything is partitioned."""
    from zeroengine.moe.params import is_expert_param

    experts = [p for p in module.parameters() if is_expert_param(p)]
    if any(id(p) not in stepped for p in experts):
        # Frozen parameters are partitioned over the whole world, which is wrong for experts: ranks hold
        # different ones (and at ep_size 1 the world's slices would mix experts of different ranks' layers).
        raise ConfigError("zero_optimization.stage", "stage 3 does not support frozen MoE expert parameters "
                          "(requires_grad=False, or not given to the optimizer); train them, or use stage 0-2")
    if any(is_init_partitioned(p) for p in module.parameters()):
        raise ConfigError("zero_optimization.stage", "a model with MoE layers built under zeroengine.zero.Init is "
                          "not supported at stage 3 (Init partitions every parameter over the whole world); build "
                          "it without Init")


def _has_moe(module: torch.nn.Module) -> bool:
    from zeroengine.moe.layer import MoE
    from zeroengine.moe.params import is_expert_param

    return any(isinstance(m, MoE) for m in module.modules()) or any(is_expert_param(p) for p in module.parameters())


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _build_stage0(module, optimizer, policy, loss_scaler, zero_config, clip, comm_dtype, domains=None, dp_group=None):
    master_weights = None
    if policy.mixed:
        params = _optimizer_params(optimizer)
        # Masters are cloned from the fp32 values before the cast (see MasterWeights).
        master_weights = MasterWeights(params, [p.detach() for p in params])
        for group in optimizer.param_groups:
            group["params"] = [master_weights.master_of[id(p)] for p in group["params"]]
    module.to(policy.param_dtype)
    if domains:
        return ExpertDataParallelOptimizer(module, optimizer, policy, loss_scaler, clip, master_weights,
                                           reduce_bucket_size=zero_config.reduce_bucket_size, comm_dtype=comm_dtype,
                                           domains=domains)
    return DataParallelOptimizer(module, optimizer, policy, loss_scaler, clip, master_weights,
                                 reduce_bucket_size=zero_config.reduce_bucket_size, comm_dtype=comm_dtype, group=dp_group)


def _build_sharded(stage, module, optimizer, policy, loss_scaler, zero_config, clip, comm_dtype, data: ParamDomain):
    # Layout in reverse registration order: roughly the order backward produces
    # gradients, so stage 2's buckets fill (and launch) front to back.
    group_of = trained_group_of(optimizer)
    params = [p for p in reversed(list(module.parameters())) if id(p) in group_of]
    everything = dataclasses.replace(data, params=params)
    return _sharded_parts(stage, module, optimizer, policy, loss_scaler, zero_config, clip, comm_dtype,
                          [everything])[0]


def _sharded_parts(stage, module, optimizer, policy, loss_scaler, zero_config, clip, comm_dtype,
                   domains: list[ParamDomain]) -> list[ShardedOptimizer]:
    """Stages 1-2, per domain (the whole model; or with MoE, the dense parameters and each expert-data-
    parallel group's): a flat buffer over the domain's group, the stage's gradient store, and a
    ShardedOptimizer stepping this rank's pieces. The one torch optimizer's groups hold every part's pieces."""
    group_of = trained_group_of(optimizer)
    if comm.device_for_backend().type == "cpu":  # opt-in: freed memory back to the OS (see host_memory)
        host_memory.map_large_allocations()
    # Detached fp32 values of every domain before any cast: they keep the old storage alive until the masters
    # are cut from them (the masters start from exact weights).
    fp32_values = [[p.detach() for p in d.params] if policy.separate_masters else None for d in domains]
    flats = [FlatParamBuffer(d.params, build_layout([p.numel() for p in d.params], d.world,
                                                    int(zero_config.reduce_bucket_size)),
                             policy.param_dtype, d.rank, group=d.group) for d in domains]
    module.to(policy.param_dtype)  # whatever is not trainable (buffers, frozen params) follows

    def assembled():
        for d, flat, values in zip(domains, flats, fp32_values):
            reducer = BucketReducer(d.rank, d.world, d.group, comm_dtype, overlap=bool(zero_config.overlap_comm),
                                    divisor=d.divisor)
            grad_store = FullGradStore(flat, reducer) if stage == 1 else PartitionedGradStore(flat, reducer)
            yield _assemble(module, optimizer, policy, loss_scaler, clip, zero_config, flat, d.params, values,
                            grad_store, group_of)

    return _one_optimizer_for(optimizer, assembled())


def _build_stage3(module, optimizer, policy, loss_scaler, zero_config, clip, comm_dtype, domains=None,
                  data: ParamDomain | None = None):
    """Stage 3: each domain's trainable parameters (the whole model; or with MoE, the dense ones over the world
    and each expert-data-parallel group's) partitioned in a buffer over its group, frozen ones in a buffer
    over the world, one set of hooks fetching units of all of them."""
    group_of = trained_group_of(optimizer)
    trainable, frozen = split_params(module, set(group_of), int(zero_config.stage3_param_persistence_threshold))
    if data is None:  # (MoE: expert domains, which refuse model parallelism, so data parallel is the world)
        data = ParamDomain([], None, comm.get_rank(), comm.get_world_size(), comm.get_world_size())
    rank, world = data.rank, data.world
    if domains is None:
        domains = [dataclasses.replace(data, params=trainable.params)]
    parts = _stage3_parts(trainable, domains)
    bucket_numel = int(zero_config.reduce_bucket_size)
    if comm.device_for_backend().type == "cpu":  # opt-in: freed memory back to the OS (see host_memory)
        host_memory.map_large_allocations()
    # Parameters built under zero.Init arrive as per-parameter slices: re-cut into the bucket layout (one
    # domain then: an MoE model built under Init is refused by build_zero_optimizer).
    reshard = InitReshard(trainable.params + frozen.params, rank, keep_fp32=policy.separate_masters)
    stats = FetchStats()  # shared by all the buffers
    offload = zero_config.offload_param  # device "nvme": max_in_cpu is shared by the buffers, in build order
    in_cpu = InCpuBudget(int(offload.max_in_cpu)) if offload is not None and offload.device == "nvme" else None

    def buffer_of(part: Stage3Params, offset: int, d: ParamDomain, source):
        layout = build_layout([full_shape(p).numel() for p in part.params], d.world, bucket_numel,
                              segments=part.segments)
        return PartitionedParamBuffer(
            part.params, layout, policy.param_dtype, d.rank, group=d.group, names=part.names,
            persistent=persistent_buckets(layout, part.persistent_from), stats=stats,
            chunk_source=lambda bucket: source.chunk(_shifted(bucket, offset), policy.param_dtype),
            offload=offload, in_cpu_budget=in_cpu)

    everyone = data  # frozen parameters: partitioned over the data-parallel group
    if len(parts) == 1:
        sources = [reshard]
    else:  # each domain's chunks cut at its own rank in its group
        sources = [InitReshard(part.params, d.rank, keep_fp32=policy.separate_masters) for d, part in parts]
    buffers = [buffer_of(part, 0, d, source) for (d, part), source in zip(parts, sources)]
    fp32_values = [source.fp32_values()[:len(part.params)] if policy.separate_masters else None
                   for (_, part), source in zip(parts, sources)]
    frozen_buffer = buffer_of(frozen, len(trainable.params), everyone, reshard) if frozen.params else None
    if world > 1 and gather_order.enabled():
        labels = ["" if not d.is_expert else f"expert (ep group of {world // d.world})" for d, _ in parts]
        _check_gather_order(list(zip(labels, buffers)) + [("frozen", frozen_buffer)],
                            per_event=gather_order.mode() == "event")
    for source in {id(s): s for s in sources + [reshard]}.values():
        source.release_init_shards()
    _cast_floating_buffers(module, policy.param_dtype)
    units, unit_of = [], {}
    for buffer, trains in [(b, True) for b in buffers] + [(frozen_buffer, False)] * (frozen_buffer is not None):
        for b in buffer.layout.buckets:
            units.append(Unit(buffer, b, trains))
            unit_of.update({id(buffer.params[s.index]): len(units) - 1 for s in b.slots})
    hooks = Stage3Hooks(module, units, unit_of, FetchPolicy.from_config(zero_config),
                        always_whole=_modules_reading_weights_directly(module))
    if zero_config.stage3_fetch_unit == "block":
        hooks.fetch_whole(find_blocks(module))

    def assembled():
        for i, ((d, part), buffer, values) in enumerate(zip(parts, buffers, fp32_values)):
            last = i == len(parts) - 1  # the pass ends (and is compared) once, after every domain's gradients
            reducer = BucketReducer(d.rank, d.world, d.group, comm_dtype, overlap=bool(zero_config.overlap_comm),
                                    divisor=d.divisor)
            grad_store = PartitionedGradStore(buffer, reducer,
                                              on_bucket_ready=functools.partial(hooks.on_bucket_grads_ready,
                                                                                buffer=buffer),
                                              on_stray_pass_over=hooks.release_all)
            yield _assemble(module, optimizer, policy, loss_scaler, clip, zero_config, buffer, part.params, values,
                            grad_store, group_of, after_backward=hooks.after_backward if last else None,
                            cls=Stage3Optimizer, hooks=hooks if i == 0 else None,
                            frozen_params=frozen_buffer if i == 0 else None)

    optimizers = _one_optimizer_for(optimizer, assembled())
    if frozen_buffer is not None:
        record_buffer(frozen_buffer, None)
    if len(optimizers) == 1:
        return optimizers[0]
    return ExpertShardedOptimizer(optimizers, optimizer, policy, loss_scaler, clip)


def _one_optimizer_for(optimizer: torch.optim.Optimizer, assembled) -> list[ShardedOptimizer]:
    """The parts ``assembled`` yields, built one at a time, and the one torch optimizer stepping all their
    pieces: each part's ``adopt_param_groups`` (in :func:`_assemble`) sets the groups to that part's pieces,
    collected after it is built and merged at the end."""
    merged = [[] for _ in optimizer.param_groups]
    parts = []
    for part in assembled:
        parts.append(part)
        for pieces, group in zip(merged, optimizer.param_groups):
            pieces.extend(group["params"])
    for group, pieces in zip(optimizer.param_groups, merged):
        group["params"] = pieces
    return parts


def _stage3_parts(trainable: Stage3Params, domains: list[ParamDomain]) -> list[tuple[ParamDomain, Stage3Params]]:
    """``trainable`` split by domain, each part in stage-3 order (its persistent parameters last)."""
    if len(domains) == 1:
        return [(domains[0], trainable)]
    parts = []
    for d in domains:
        ids = {id(p) for p in d.params}
        picked = [i for i, p in enumerate(trainable.params) if id(p) in ids]
        parts.append((d, Stage3Params([trainable.params[i] for i in picked], [trainable.names[i] for i in picked],
                                      [trainable.segments[i] for i in picked],
                                      sum(i < trainable.persistent_from for i in picked))))
    return [(d, part) for d, part in parts if part.params]


def _modules_reading_weights_directly(module: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """Modules whose forward reads their children's weights without calling them (zeroengine.moe.MoE: the fused
    routing reads the gate's weight, grouped experts read the experts'): fetched whole at stage 3."""
    from zeroengine.moe.layer import MoE

    return tuple(m for m in module.modules() if isinstance(m, MoE))


def _check_gather_order(labelled_buffers, per_event: bool) -> None:
    """One GatherOrderCheck for the model's buffers ((label, buffer or None) pairs), each tagged by its
    position."""
    tagged = [(tag, label, buf) for tag, (label, buf) in enumerate(labelled_buffers) if buf is not None]
    check = GatherOrderCheck({tag: [[buf.names[s.index] for s in bucket.slots] for bucket in buf.layout.buckets]
                              for tag, _, buf in tagged}, per_event=per_event,
                             buffer_labels={tag: label for tag, label, _ in tagged})
    for tag, _, buf in tagged:
        buf.order_check, buf.order_tag = check, tag


def _shifted(bucket, offset: int):
    """The frozen buffer's slots index its own list; the reshard reads trainable + frozen."""
    if offset == 0:
        return bucket
    return dataclasses.replace(bucket, slots=tuple(dataclasses.replace(s, index=s.index + offset)
                                                   for s in bucket.slots))


def _cast_floating_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """What ``module.to(dtype)`` does for the module's buffers (its parameters already live in the
    partitioned buffers, in that dtype)."""
    for m in module.modules():
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                m._buffers[name] = buf.to(dtype)


def _assemble(module, optimizer, policy, loss_scaler, clip, zero_config, buffer, params, fp32_values, grad_store,
              group_of, after_backward=None, cls=ShardedOptimizer, **stage_parts) -> ShardedOptimizer:
    """What stages 1-3 share once parameters and gradients have their homes: the sharded optimizer,
    its param groups, and the parameters' records (zero/records.py). ``stage_parts``: what ``cls`` alone
    takes (stage 3's hooks and frozen-parameter buffer)."""
    sharded = cls(module, optimizer, policy, loss_scaler, clip, buffer, fp32_values, grad_store,
                  buffer.rank, group=buffer.group, after_backward=after_backward,
                  offload=zero_config.offload_optimizer, **stage_parts)
    group_of_slot = [group_of[id(p)] for p in params]
    sharded.adopt_param_groups(group_of_slot)
    attach_partition(sharded, params, group_of_slot)
    record_buffer(buffer, sharded)
    return sharded
