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
from zeroengine.parallel.mesh import ProcessMesh, build_mesh, use_mesh

from .channels import PipeChannels
from .partition import balanced_parts, layer_weights
from .spec import LayerSpec, TiedLayerSpec
from .tied import TiedWeights


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
        self.chunk_funcs: list[list[Callable]] = []
        with use_mesh(mesh):  # tensor-parallel layers built without a group take this mesh's
            self._build_stage()
        self.tied = TiedWeights(self.layer_specs, self.stage_of_layer, mesh, self.tied_modules)
        self.tied.mark_copies()
        # the groups activations and gradients travel in between stages (a ring when interleaved)
        self.channels = PipeChannels(self.mesh, ring=virtual_stages > 1)

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
            if self._checkpointable(self.chunk_layers(chunk).start + start, segment):
                x = checkpoint(functools.partial(_run_unpacked, segment), *(x if isinstance(x, tuple) else (x,)))
            else:
                x = _run(segment, x)
        return x

    def _checkpointable(self, first: int, segment: list[Callable]) -> bool:
        """DeepSpeed's rule: with ``checkpointable_layers``, a segment is recomputed when all its layers' types
        are listed; without, when it holds parameters (a parameter-free segment, say a reshaping function,
        saves nothing worth recomputing)."""
        if self.checkpointable_layers is not None:
            names = [_name_of(self.layer_specs[i]) for i in range(first, first + len(segment))]
            return all(n in self.checkpointable_layers for n in names)
        modules = [f.args[0] if isinstance(f, functools.partial) else f for f in segment]  # (a tied use's module)
        return any(isinstance(m, torch.nn.Module) and next(m.parameters(), None) is not None for m in modules)


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
