"""``PipelineModule``: a model given as a list of layers, of which each pipeline stage builds and runs its part.

Layers are named by their index in the whole list (``"7.weight"``), and tied layers by their key
(``"tied_modules.embed.weight"``), as DeepSpeed names them: a parameter has the same name whatever the
number of stages, so a checkpoint saved at one pipeline layout loads at another.

A stage's forward is ``x = layer(x)`` over its layers in order; an input that is a tuple is passed whole to
each layer (DeepSpeed's convention), so layers that carry several tensors (hidden states and a mask) take
and return tuples. With ``activation_checkpoint_interval`` k, every k consecutive layers run under
:func:`zeroengine.checkpointing.checkpoint` (recomputed in backward).

``virtual_stages`` v > 1 (Megatron's virtual pipeline) cuts the layers into p·v parts; rank s holds parts
s, s + p, ..., s + (v-1)p as its v model chunks, and the engine runs the interleaved 1F1B schedule over them.
The layers keep their names, so a checkpoint moves between interleaved and plain layouts.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from zeroengine import comm
from zeroengine.comm.groups import new_group
from zeroengine.parallel.mesh import ProcessMesh, build_mesh

from .partition import balanced_parts, layer_weights
from .spec import LayerSpec, TiedLayerSpec


class PipelineModule(torch.nn.Module):
    def __init__(self, layers, num_stages: int | None = None, topology: ProcessMesh | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers=None,
                 virtual_stages: int = 1):
        super().__init__()
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule: give num_stages (or a topology: a zeroengine.parallel.ProcessMesh)")
        if (num_stages or 1) > 1:
            comm.init_distributed()  # the stage is this rank's place in the world
        mesh = topology if topology is not None else build_mesh(pp=num_stages, what="PipelineModule")
        if num_stages is not None and mesh.pp != num_stages:
            raise ValueError(f"PipelineModule: num_stages={num_stages} but the topology has {mesh.pp} stages")
        self.layer_specs = list(layers)
        if not self.layer_specs:
            raise ValueError("PipelineModule: layers is empty")
        for i, layer in enumerate(self.layer_specs):
            if not (isinstance(layer, (LayerSpec, torch.nn.Module)) or callable(layer)):
                raise TypeError(f"PipelineModule: layer {i} is a {type(layer).__name__}; each layer must be a "
                                "LayerSpec, a TiedLayerSpec, an nn.Module or a callable")
        self.mesh = mesh
        self.num_stages = mesh.pp
        self.stage_id = mesh.pp_rank
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
            raise ValueError(f"PipelineModule: activation_checkpoint_interval must be an integer >= 0, got "
                             f"{activation_checkpoint_interval!r}")
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"PipelineModule: virtual_stages must be an integer >= 1, got {virtual_stages!r}")
        if virtual_stages > 1 and self.num_stages == 1:
            raise ValueError("PipelineModule: virtual_stages > 1 interleaves model chunks across pipeline stages; "
                             "with one stage there is nothing to interleave (use num_stages > 1)")
        self.virtual_stages = virtual_stages
        # boundaries of the p·v virtual stages; virtual stage k runs on rank k % p as its chunk k // p
        self.parts = balanced_parts(layer_weights(partition_method, self.layer_specs, self._count_params),
                                    self.num_stages * virtual_stages)
        self.tied_modules = torch.nn.ModuleDict()
        self.tied_stages = self._tied_stages()
        self.chunk_funcs: list[list[Callable]] = []
        self._build_stage()
        self.tie_groups = self._make_tie_groups()
        self._mark_tied_copies()
        # Interleaved, the pair of neighbouring ranks carries activations one way and gradients the other, and
        # with two stages both ways at once: gradients get a channel (group) of their own, so a receive never
        # meets the other kind's message first (NCCL matches point-to-point messages in order).
        self.grad_channel = self._make_pipe_groups() if virtual_stages > 1 else None

    # -- construction -----------------------------------------------------------------------------------
    def _count_params(self, index: int) -> int:
        layer = self.layer_specs[index]
        if isinstance(layer, LayerSpec):
            with torch.device("meta"):  # counted without allocating
                layer = layer.build()
        if isinstance(layer, torch.nn.Module):
            return sum(p.numel() for p in layer.parameters() if p.requires_grad)
        return 0

    def chunk_layers(self, chunk: int) -> range:
        """Indices (in the whole layer list) of the layers of this stage's model chunk ``chunk``."""
        virtual = chunk * self.num_stages + self.stage_id
        return range(self.parts[virtual], self.parts[virtual + 1])

    @property
    def stage_layers(self) -> list[int]:
        """Indices (in the whole layer list) of the layers this stage runs, chunk by chunk."""
        return [i for c in range(self.virtual_stages) for i in self.chunk_layers(c)]

    @property
    def forward_funcs(self) -> list[Callable]:
        """This stage's layer callables in order (DeepSpeed's attribute of that name; chunk by chunk)."""
        return [f for funcs in self.chunk_funcs for f in funcs]

    def stage_of_layer(self, index: int) -> int:
        virtual = next(k for k in range(len(self.parts) - 1) if self.parts[k] <= index < self.parts[k + 1])
        return virtual % self.num_stages

    def _tied_stages(self) -> dict[str, list[int]]:
        """key -> the stages that use it, ascending (the first owns the weights)."""
        stages: dict[str, list[int]] = {}
        for i, layer in enumerate(self.layer_specs):
            if isinstance(layer, TiedLayerSpec):
                s = self.stage_of_layer(i)
                if s not in stages.setdefault(layer.key, []):
                    stages[layer.key].append(s)
        return stages

    def _build_stage(self) -> None:
        for chunk in range(self.virtual_stages):
            funcs = []
            for index in self.chunk_layers(chunk):
                layer = self.layer_specs[index]
                if isinstance(layer, TiedLayerSpec):
                    if layer.key not in self.tied_modules:
                        self.tied_modules[layer.key] = self._seeded(index, layer.build)
                    module = self.tied_modules[layer.key]
                    funcs.append(functools.partial(layer.forward_fn, module) if layer.forward_fn else module)
                elif isinstance(layer, LayerSpec):
                    module = self._seeded(index, layer.build)
                    self.add_module(str(index), module)
                    funcs.append(module)
                elif isinstance(layer, torch.nn.Module):
                    self.add_module(str(index), layer)
                    funcs.append(layer)
                else:
                    funcs.append(layer)
            self.chunk_funcs.append(funcs)

    def _seeded(self, index: int, build: Callable) -> torch.nn.Module:
        if not self.seed_layers:
            return build()
        with torch.random.fork_rng(devices=[]):  # the caller's random stream goes on undisturbed
            (self.seed_fn or torch.manual_seed)(self.base_seed + index)
            return build()

    def _make_tie_groups(self) -> dict[str, tuple[object, list[int]]]:
        """key -> (group, its global ranks, owner first) for the tied keys this rank holds, over the stages
        using the key at this rank's data and tensor index. Collective: every rank makes every group."""
        groups = {}
        mesh = self.mesh
        for key in sorted(self.tied_stages):
            stages = self.tied_stages[key]
            if len(stages) < 2:
                continue
            for data in range(mesh.dp):
                for tensor in range(mesh.tp):
                    ranks = [mesh.rank_at(s, data, tensor) for s in stages]
                    group = new_group(ranks) if comm.get_world_size() > 1 else None
                    if mesh.rank in ranks:
                        groups[key] = (group, ranks)
        return groups

    def _make_pipe_groups(self):
        """One more group per pipeline line (every rank makes every one: collective); this rank's."""
        mine = None
        for ranks in self.mesh.axis_members("pipe"):
            group = new_group(ranks) if comm.get_world_size() > 1 else None
            if self.mesh.rank in ranks:
                mine = group
        return mine

    def _mark_tied_copies(self) -> None:
        for key, module in self.tied_modules.items():
            for p in self.tied_params(key):
                p._ze_tied_key = key
                if self.stage_id != self.tied_stages[key][0]:
                    p._ze_reduced_elsewhere = True  # its gradient goes to the owner stage, which steps it

    def tied_params(self, key: str) -> list[torch.nn.Parameter]:
        spec = next(s for s in self.layer_specs if isinstance(s, TiedLayerSpec) and s.key == key)
        module = self.tied_modules[key]
        params = []
        for attr in spec.tied_weight_attr:
            value = module
            for part in attr.split("."):
                value = getattr(value, part)
            params.append(value)
        return params

    # -- what the pipeline engine calls -----------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def is_first_chunk(self, chunk: int) -> bool:
        """Does ``chunk`` of this stage take the model's inputs (the first virtual stage)?"""
        return self.is_first_stage() and chunk == 0

    def is_last_chunk(self, chunk: int) -> bool:
        """Does ``chunk`` of this stage produce the model's output (the last virtual stage)?"""
        return self.is_last_stage() and chunk == self.virtual_stages - 1

    def owns_tied(self, key: str) -> bool:
        return self.stage_id == self.tied_stages[key][0]

    @torch.no_grad()
    def sync_tied_weights(self) -> None:
        """Every stage's copy of each tied weight takes its owner's values (collective over each tie group)."""
        for key, (group, ranks) in self.tie_groups.items():
            for p in self.tied_params(key):
                comm.broadcast(p.data, src=ranks[0], group=group)

    def reduce_tied_grads(self) -> None:
        """The owner's gradient of each tied weight becomes the sum of every stage's; the copies drop theirs."""
        for key, (group, _) in self.tie_groups.items():
            for p in self.tied_params(key):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                comm.all_reduce(p.grad, group=group)
                if not self.owns_tied(key):
                    p.grad = None

    def forward(self, inputs, chunk: int = 0):
        """This stage's layers of model chunk ``chunk`` (the only one without virtual stages) on ``inputs``."""
        funcs = self.chunk_funcs[chunk]
        interval = self.activation_checkpoint_interval
        if interval == 0 or not self.training or not torch.is_grad_enabled():
            return _run(funcs, inputs)
        checkpoint = self.activation_checkpoint_func or _default_checkpoint()
        x = inputs
        for start in range(0, len(funcs), interval):
            segment = funcs[start:start + interval]
            if self._checkpointable(self.chunk_layers(chunk).start + start, len(segment)):
                x = checkpoint(functools.partial(_run_unpacked, segment), *(x if isinstance(x, tuple) else (x,)))
            else:
                x = _run(segment, x)
        return x

    def _checkpointable(self, first: int, count: int) -> bool:
        if self.checkpointable_layers is None:
            return True
        names = {_name_of(self.layer_specs[i]) for i in range(first, first + count)}
        return any(n in self.checkpointable_layers for n in names)


def _run(funcs, x):
    for f in funcs:
        x = f(x)
    return x


def _run_unpacked(funcs, *x):
    return _run(funcs, x[0] if len(x) == 1 else x)


def _name_of(layer) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__


def _default_checkpoint():
    from zeroengine.activation_checkpointing.checkpoint import checkpoint

    return checkpoint
