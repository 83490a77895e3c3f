"""Weights that several pipeline stages use (``TiedLayerSpec``: a GPT's embedding, reused as its LM head).

Everything that is special about them lives here. The first stage using a key owns its weights: its
optimizer steps them with the sum of every use's gradient. The other stages hold copies, which

* hand their gradient on to the owner at the accumulation boundary (:meth:`TiedWeights.reduce_grads`) and are
  marked :func:`~zeroengine.zero.optimizer.reduced_elsewhere`, the one mark the rest of the engine reads
  (no optimizer steps them, no data-parallel reduction or checkpoint shard holds them);
* take the owner's values after every applied step and at start (:meth:`TiedWeights.sync`);
* drop a failed step's gradient with the owner's (:meth:`TiedWeights.drop_copy_grads`).
"""
from __future__ import annotations

import torch

from zeroengine import comm
from zeroengine.comm.groups import new_group
from zeroengine.parallel.mesh import ProcessMesh

from .spec import TiedLayerSpec


class TiedWeights:
    def __init__(self, layer_specs: list, stage_of_layer, mesh: ProcessMesh, modules: torch.nn.ModuleDict):
        """``stage_of_layer(i)``: the stage running layer i; ``modules``: key -> this stage's module of that key.
        Collective: every rank makes every tie group, in the same order."""
        self.mesh, self.modules = mesh, modules
        self.specs: dict[str, TiedLayerSpec] = {}
        self.stages: dict[str, list[int]] = {}  # key -> the stages using it, ascending (the first owns it)
        for i, layer in enumerate(layer_specs):
            if isinstance(layer, TiedLayerSpec):
                self.specs.setdefault(layer.key, layer)
                s = stage_of_layer(i)
                if s not in self.stages.setdefault(layer.key, []):
                    self.stages[layer.key].append(s)
        self.groups = self._make_groups()

    def _make_groups(self) -> dict[str, tuple[object, list[int]]]:
        """key -> (group, its global ranks, owner first) for the keys this rank holds, over the stages using the
        key at this rank's data and tensor index."""
        groups, mesh = {}, self.mesh
        for key in sorted(self.stages):
            stages = self.stages[key]
            if len(stages) < 2:
                continue
            for data in range(mesh.dp):
                for tensor in range(mesh.tp):
                    ranks = [mesh.rank_at(s, data, tensor) for s in stages]
                    group = new_group(ranks) if comm.get_world_size() > 1 else None
                    if mesh.rank in ranks:
                        groups[key] = (group, ranks)
        return groups

    def owns(self, key: str) -> bool:
        return self.mesh.pp_rank == self.stages[key][0]

    def params(self, key: str) -> list[torch.nn.Parameter]:
        module, params = self.modules[key], []
        for attr in self.specs[key].tied_weight_attr:
            value = module
            for part in attr.split("."):
                value = getattr(value, part)
            params.append(value)
        return params

    def mark_copies(self) -> None:
        for key in self.modules:
            if not self.owns(key):
                for p in self.params(key):
                    p._ze_reduced_elsewhere = True  # its gradient goes to the owner stage, which steps it

    @torch.no_grad()
    def sync(self) -> None:
        """Every stage's copy of each tied weight takes its owner's values (collective over each tie group)."""
        for key, (group, ranks) in self.groups.items():
            for p in self.params(key):
                comm.broadcast(p.data, src=ranks[0], group=group)

    def reduce_grads(self) -> None:
        """The owner's gradient of each tied weight becomes the sum of every stage's; the copies drop theirs."""
        for key, (group, _) in self.groups.items():
            for p in self.params(key):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                comm.all_reduce(p.grad, group=group)
                if not self.owns(key):
                    p.grad = None

    def drop_copy_grads(self) -> None:
        """A failed step's gradients: the optimizer forgets the owners'; the copies' are dropped here."""
        for key in self.modules:
            if not self.owns(key):
                for p in self.params(key):
                    p.grad = None
