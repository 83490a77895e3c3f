"""``PipelineModule``: a model given as a list of layers, of which each pipeline stage builds and runs its part.

Layers are named by their index in the whole list (``"7.weight"``), and tied layers by their key
(``"tied_modules.embed.weight"``), as DeepSpeed names them: a parameter has the same name whatever the
number of stages, so a checkpoint saved at one pipeline layout loads at another.

A stage's forward is ``x = layer(x)`` over its layers in order; an input that is a tuple is passed whole to
each layer (DeepSpeed's convention), so layers that carry several tensors (hidden states and a mask) take
and return tuples. With ``activation_checkpoint_interval`` k, every k consecutive layers run under
:func:`zeroengine.checkpointing.checkpoint` (recomputed in backward).
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
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers=None):
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
        self.parts = balanced_parts(layer_weights(partition_method, self.layer_specs, self._count_params),
                                    self.num_stages)
        self.tied_modules = torch.nn.ModuleDict()
        self.tied_stages = self._tied_stages()
        self.forward_funcs: list[Callable] = []
        self._build_stage()
        self.tie_groups = self._make_tie_groups()
        self._mark_tied_copies()

    # -- construction -----------------------------------------------------------------------------------
    def _count_params(self, index: int) -> int:
        layer = self.layer_specs[index]
        if isinstance(layer, LayerSpec):
            with torch.device("meta"):  # counted without allocating
                layer = layer.build()
        if isinstance(layer, torch.nn.Module):
            return sum(p.numel() for p in layer.parameters() if p.requires_grad)
        return 0

    @property
    def stage_layers(self) -> range:
        """Indices (in the whole layer list) of the layers this stage runs."""
        return range(self.parts[self.stage_id], self.parts[self.stage_id + 1])

    def stage_of_layer(self, index: int) -> int:
        return next(s for s in range(self.num_stages) if self.parts[s] <= index < self.parts[s + 1])

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
        for index in self.stage_layers:
            layer = self.layer_specs[index]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = self._seeded(index, layer.build)
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(functools.partial(layer.forward_fn, module) if layer.forward_fn else module)
            elif isinstance(layer, LayerSpec):
                module = self._seeded(index, layer.build)
                self.add_module(str(index), module)
                self.forward_funcs.append(module)
            elif isinstance(layer, torch.nn.Module):
                self.add_module(str(index), layer)
                self.forward_funcs.append(layer)
            else:
                self.forward_funcs.append(layer)

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

    def forward(self, inputs):
        funcs = self.forward_funcs
        interval = self.activation_checkpoint_interval
        if interval == 0 or not self.training or not torch.is_grad_enabled():
            return _run(funcs, inputs)
        checkpoint = self.activation_checkpoint_func or _default_checkpoint()
        x = inputs
        for start in range(0, len(funcs), interval):
            chunk = funcs[start:start + interval]
            if self._checkpointable(start, len(chunk)):
                x = checkpoint(functools.partial(_run_unpacked, chunk), *(x if isinstance(x, tuple) else (x,)))
            else:
                x = _run(chunk, x)
        return x

    def _checkpointable(self, start: int, count: int) -> bool:
        if self.checkpointable_layers is None:
            return True
        first = self.stage_layers.start + start
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
