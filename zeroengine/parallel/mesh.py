"""The process mesh: which ranks share data, tensor and pipeline work, made in one place.

A world of W ranks is laid out as pipeline × data × tensor (W = pp · dp · tp), tensor fastest, as
Megatron-LM and DeepSpeed's ``PipeModelDataParallelTopology`` number them:

    rank = pipe_index · (dp · tp) + data_index · tp + tensor_index

so the tensor-parallel ranks of a layer (the most talkative: two all-reduces per block) are neighbours,
which the launcher places on one node, and a pipeline stage's data-parallel replicas follow one another.

Groups (each a :func:`zeroengine.comm.groups.new_group`, made on every rank in the same order):

* ``data``: the ranks holding the same model slice (same pipe and tensor index). ZeRO partitions and
  reduces over this group only.
* ``tensor``: the ranks splitting one stage's layers (same pipe and data index).
* ``pipe``: the ranks holding one replica's stages in order (same data and tensor index); activations
  travel between neighbours in it.
* ``model``: tensor × pipe for one data index: together they hold the whole model once, so the global
  gradient norm of replicated (stage 0) gradients is a sum over it.

An axis spanning the whole world is the world group (``None``), so a pure data-parallel mesh changes
nothing for the code that ran before meshes existed; an axis of size 1 other than ``data`` has no group
(``None`` too: nothing is ever sent over it).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch.distributed as dist

from zeroengine import comm
from zeroengine.comm.groups import WorldScoped, new_group

AXES = ("pipe", "data", "sequence", "tensor")


@dataclass(frozen=True)
class ProcessMesh:
    pp: int
    dp: int
    tp: int
    rank: int  # this process's global rank
    groups: dict = field(default_factory=dict, compare=False, repr=False)  # axis -> group (None: the world)
    ranks: dict = field(default_factory=dict, compare=False, repr=False)  # axis -> this rank's group, in order
    sp: int = 1  # sequence-parallel ranks: each holds 1/sp of every sequence (zeroengine.sequence_parallel)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp * self.tp

    def place(self, rank: int | None = None) -> tuple[int, int, int, int]:
        """(pipe, data, sequence, tensor) index of ``rank`` (this rank by default)."""
        rank = self.rank if rank is None else rank
        tensor, rest = rank % self.tp, rank // self.tp
        seq, rest = rest % self.sp, rest // self.sp
        return rest // self.dp, rest % self.dp, seq, tensor

    def coords(self, rank: int | None = None) -> tuple[int, int, int]:
        """(pipe, data, tensor) index of ``rank`` (this rank by default)."""
        pipe, data, _, tensor = self.place(rank)
        return pipe, data, tensor

    def rank_at(self, pipe: int, data: int, tensor: int, seq: int = 0) -> int:
        return ((pipe * self.dp + data) * self.sp + seq) * self.tp + tensor

    def axis_members(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` ("data", "sequence", "zero", "tensor", "pipe", "model") as global ranks, in the
        order the mesh made its own groups (the same on every rank, as making more such groups needs)."""
        return _axis_members(self.pp, self.dp, self.tp, self.sp)[axis]

    @property
    def pp_rank(self) -> int:
        return self.coords()[0]

    @property
    def dp_rank(self) -> int:
        return self.coords()[1]

    @property
    def tp_rank(self) -> int:
        return self.coords()[2]

    @property
    def sp_rank(self) -> int:
        return self.place()[2]

    @property
    def dp_group(self):
        return self.groups.get("data")

    @property
    def sp_group(self):
        return self.groups.get("sequence")

    @property
    def zero_group(self):
        """data × sequence: the ranks holding the same model slice, over which ZeRO partitions and reduces (the
        data group without sequence parallelism)."""
        return self.groups.get("zero", self.dp_group)

    @property
    def zero_ranks(self) -> tuple:
        """The global ranks of this rank's :attr:`zero_group`, in order."""
        return self.ranks.get("zero", self.ranks["data"])

    @property
    def zero_size(self) -> int:
        return self.dp * self.sp

    @property
    def zero_rank(self) -> int:
        _, data, seq, _ = self.place()
        return data * self.sp + seq

    @property
    def tp_group(self):
        return self.groups.get("tensor")

    @property
    def pp_group(self):
        return self.groups.get("pipe")

    @property
    def model_group(self):
        """tensor × pipe at this data index; None when the model is not split (nothing to sum over)."""
        return self.groups.get("model")

    @property
    def tensor_group(self):
        """The tensor group as the tensor-parallel layers take it (zeroengine.tensor_parallel.ops.TensorGroup)."""
        from zeroengine.tensor_parallel.ops import TensorGroup

        return TensorGroup(self.tp_group, self.tp, self.tp_rank)

    @property
    def model_parallel(self) -> bool:
        return self.pp * self.tp > 1

    def stage_rank(self, stage: int) -> int:
        """The global rank holding pipeline stage ``stage`` of this rank's replica and tensor slice."""
        _, data, seq, tensor = self.place()
        return self.rank_at(stage, data, tensor, seq)

    def describe(self) -> str:
        seq = f" × sp={self.sp}" if self.sp > 1 else ""
        at = f", sequence {self.sp_rank}" if self.sp > 1 else ""
        return f"pp={self.pp} × dp={self.dp}{seq} × tp={self.tp} (rank {self.rank}: pipe {self.pp_rank}, " \
               f"data {self.dp_rank}{at}, tensor {self.tp_rank})"


def _axis_members(pp: int, dp: int, tp: int, sp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of each axis, as lists of global ranks (the same on every rank)."""
    def rank(p, d, s, t):
        return ((p * dp + d) * sp + s) * tp + t
    return {
        "data": [[rank(p, d, s, t) for d in range(dp)] for p in range(pp) for s in range(sp) for t in range(tp)],
        "sequence": [[rank(p, d, s, t) for s in range(sp)] for p in range(pp) for d in range(dp) for t in range(tp)],
        "zero": [[rank(p, d, s, t) for d in range(dp) for s in range(sp)] for p in range(pp) for t in range(tp)],
        "tensor": [[rank(p, d, s, t) for t in range(tp)] for p in range(pp) for d in range(dp) for s in range(sp)],
        "pipe": [[rank(p, d, s, t) for p in range(pp)] for d in range(dp) for s in range(sp) for t in range(tp)],
        "model": [[rank(p, d, s, t) for p in range(pp) for t in range(tp)] for d in range(dp) for s in range(sp)],
    }


_MESHES = WorldScoped()  # (pp, dp, tp) -> the mesh of this world (its groups are made once)


def build_mesh(pp: int = 1, tp: int = 1, what: str = "the mesh", sp: int = 1) -> ProcessMesh:
    """The mesh of this world for ``pp`` pipeline stages, ``tp``-way tensor and ``sp``-way sequence parallelism
    (data parallel gets the rest). Collective on first use of a shape (its groups are created then); cached for
    this world."""
    world, rank = comm.get_world_size(), comm.get_rank()
    for name, size in (("pipeline stages", pp), ("tensor-parallel size", tp), ("sequence-parallel size", sp)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{what}: the {name} must be a positive integer, got {size!r}")
    split = pp * tp * sp
    if world % split:
        raise ValueError(f"{what}: the world of {world} ranks cannot be split into {pp} pipeline stage(s) × "
                         f"{tp}-way tensor × {sp}-way sequence parallelism (pp · tp · sp = {split} must divide the "
                         f"world size); launch a multiple of {split} ranks")
    dp = world // split
    meshes = _MESHES.current()
    if (pp, dp, tp, sp) in meshes:
        return meshes[pp, dp, tp, sp]
    groups, ranks = {}, {}
    for axis, members in _axis_members(pp, dp, tp, sp).items():
        mine = next(m for m in members if rank in m)
        ranks[axis] = tuple(mine)
        if axis == "zero" and sp == 1:
            groups[axis] = groups["data"]  # the same ranks: one group
            continue
        if len(mine) == world:
            groups[axis] = None  # the world itself
            continue
        if axis not in ("data", "zero") and len(mine) == 1:
            groups[axis] = None  # an axis of size 1 carries no communication (ZeRO's groups always do)
            continue
        for m in members:  # every rank creates every group, in the same order (torch.distributed's rule)
            group = new_group(m) if dist.is_initialized() else None
            if m is mine:
                groups[axis] = group
    mesh = meshes[pp, dp, tp, sp] = ProcessMesh(pp, dp, tp, rank, groups, ranks, sp)
    return mesh


# Note: which tensor group a tensor-parallel layer built without one takes.
# Inside ``with use_mesh(mesh):`` (a PipelineModule builds its layers so, on its own mesh), that mesh's.
# Elsewhere, the tensor-parallel mesh of this world: the meshes built so far split tensors one way (one
# tensor size), or the choice is ambiguous and refused; with none, tensors are not split (size 1).
_ACTIVE: contextvars.ContextVar[ProcessMesh | None] = contextvars.ContextVar("zeroengine_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: ProcessMesh):
    """Tensor-parallel layers built inside take ``mesh``'s tensor group (and the RNG tracker its tensor rank)."""
    token = _ACTIVE.set(mesh)
    try:
        yield mesh
    finally:
        _ACTIVE.reset(token)


def current_mesh() -> ProcessMesh:
    """The mesh tensor-parallel layers built without a group use (see the note above)."""
    active = _ACTIVE.get()
    if active is not None:
        return active
    split = {mesh.tp: mesh for mesh in _MESHES.current().values() if mesh.tp > 1}
    if len(split) > 1:
        raise ValueError(f"this world has meshes of {len(split)} tensor-parallel sizes ({sorted(split)}): a "
                         "tensor-parallel layer built without group= cannot tell which to use; pass group=, or build "
                         "it inside `with zeroengine.parallel.use_mesh(mesh):`")
    return next(iter(split.values())) if split else data_parallel_mesh()


_MPU_DATA = ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank")


def mesh_from_mpu(mpu, pp: int = 1) -> ProcessMesh:
    """A mesh whose groups are a Megatron-style ``mpu``'s (``get_data_parallel_group()`` and friends, as
    Megatron-DeepSpeed passes to ``initialize(mpu=...)``): the user's groups are used as given. A method the
    engine needs and the mpu lacks is an error naming it: ZeRO would otherwise reduce over the wrong ranks."""
    def has(name):
        return callable(getattr(mpu, name, None))

    def first(*names, default=None):
        return next((getattr(mpu, n)() for n in names if has(n)), default)

    def require(what, *names):
        if not any(has(n) for n in names):
            raise ValueError(f"initialize(mpu=...): the mpu lacks {' or '.join(names)}, which {what}")

    for name in _MPU_DATA:
        require("ZeRO needs to partition and reduce over the data-parallel ranks (a Megatron-style model-parallel "
                "unit provides get_data_parallel_group/_rank/_world_size)", name)
    tp = int(first("get_tensor_model_parallel_world_size", "get_model_parallel_world_size", default=1))
    pp = int(first("get_pipeline_model_parallel_world_size", default=1)) if pp == 1 else pp
    dp = int(mpu.get_data_parallel_world_size())
    world = comm.get_world_size()
    if dp * tp * pp != world:
        raise ValueError(f"initialize(mpu=...): data ({dp}) × tensor ({tp}) × pipeline ({pp}) parallel sizes give "
                         f"{dp * tp * pp} ranks, but the world has {world}")
    dp_group = mpu.get_data_parallel_group()
    groups = {"data": None if dp == world else dp_group}
    if tp > 1:
        tensor_getters = ("get_tensor_model_parallel_group",) + (("get_model_parallel_group",) if pp == 1 else ())
        require(f"the tensor-parallel layers need ({tp}-way tensor parallelism)", *tensor_getters)
        groups["tensor"] = first(*tensor_getters)
    if pp > 1:
        require(f"pipeline parallelism needs ({pp} stages)", "get_pipeline_model_parallel_group")
        groups["pipe"] = mpu.get_pipeline_model_parallel_group()
    if tp * pp > 1:
        # The gradient norm adds up over the ranks holding the model's slices: the mpu's model group, or with
        # tensor parallelism alone its tensor group. Never the world: that would count every replica again.
        if has("get_model_parallel_group"):
            groups["model"] = mpu.get_model_parallel_group()
        elif pp == 1:
            groups["model"] = groups["tensor"]
        else:
            require(f"the gradient norm adds up over the model's tensor × pipeline slices ({tp} × {pp})",
                    "get_model_parallel_group")
    ranks = {"data": tuple(dist.get_process_group_ranks(dp_group)) if dist.is_initialized() and dp < world
             else tuple(range(world))}
    return _MpuMesh(pp, dp, tp, comm.get_rank(), groups, ranks, mpu_dp_rank=int(mpu.get_data_parallel_rank()),
                    mpu_tp_rank=int(first("get_tensor_model_parallel_rank", "get_model_parallel_rank", default=0)),
                    mpu_pp_rank=int(first("get_pipeline_model_parallel_rank", default=0)))


@dataclass(frozen=True)
class _MpuMesh(ProcessMesh):
    """The user's groups, whose rank numbering need not follow :data:`AXES`: each index is the mpu's."""

    mpu_dp_rank: int = 0
    mpu_tp_rank: int = 0
    mpu_pp_rank: int = 0

    def place(self, rank: int | None = None) -> tuple[int, int, int, int]:
        if rank is not None and rank != self.rank:
            raise ValueError("a mesh from an mpu knows only this rank's place")
        return self.mpu_pp_rank, self.mpu_dp_rank, 0, self.mpu_tp_rank


def describe_layout(world: int, pp: int = 1, tp: int = 1, sp: int = 1) -> str:
    """The mesh a world of ``world`` ranks gets for ``pp`` stages, ``tp``-way tensor and ``sp``-way sequence
    parallelism, as a table (what ``ze_report --world W --tp T --pp P --sp S`` and the launcher print);
    computed, no group is made."""
    if pp < 1 or tp < 1 or sp < 1 or world % (pp * tp * sp):
        raise ValueError(f"{world} ranks cannot be split into {pp} pipeline stage(s) × {tp}-way tensor × {sp}-way "
                         f"sequence parallelism (pp · tp · sp = {pp * tp * sp} must divide the world size)")
    dp = world // (pp * tp * sp)
    members = _axis_members(pp, dp, tp, sp)
    seq = f" × sequence {sp}" if sp > 1 else ""
    formula = (f"pipe·{dp * sp * tp} + data·{sp * tp} + sequence·{tp} + tensor" if sp > 1 else
               f"pipe·{dp * tp} + data·{tp} + tensor")
    lines = [f"mesh: {world} ranks = pipeline {pp} × data {dp}{seq} × tensor {tp} (rank = {formula})"]
    for axis in ("data",) + (("sequence",) if sp > 1 else ()) + ("tensor", "pipe"):
        groups = members[axis]
        shown = ", ".join(str(g) for g in groups[:6]) + (", ..." if len(groups) > 6 else "")
        lines.append(f"  {axis:<{9 if sp > 1 else 7}}groups of {len(groups[0])}: {shown}")
    return "\n".join(lines)


def data_parallel_mesh() -> ProcessMesh:
    """The plain mesh: every rank is a data-parallel replica of the whole model."""
    return build_mesh(1, 1)
