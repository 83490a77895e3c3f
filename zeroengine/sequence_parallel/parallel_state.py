"""The sequence-parallel groups, under DeepSpeed's ``parallel_state_sp`` names (this module is the "mpu" that
``UlyssesSPAttentionHF.register_with_transformers`` returns and ``initialize(mpu=...)`` takes).

The groups are the process mesh's (:func:`zeroengine.parallel.build_mesh` with ``sp``): sequence groups of
consecutive ranks, as DeepSpeed lays them out (ranks 0..sp-1 share each sequence, then sp..2sp-1, ...), and the
sequence-data-parallel group of every rank holding the same model slice (data × sequence), over which ZeRO
partitions and reduces. The ``get_model_parallel_*`` aliases are DeepSpeed's (they answer with the sequence
group); the engine reads this module for what it is, through :func:`is_sequence_mpu`.
"""
from __future__ import annotations

import sys

import torch.distributed as dist

from zeroengine.comm.groups import WorldScoped
from zeroengine.parallel.mesh import ProcessMesh, build_mesh

_STATE = WorldScoped()  # "mesh": this world's sequence-parallel mesh, once initialised


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make the groups for ``sequence_parallel_size``-way sequence parallelism (collective on first call). Calling
    it again with the same size changes nothing; another size is an error (one layout per world)."""
    if not isinstance(sequence_parallel_size, int) or sequence_parallel_size < 1:
        raise ValueError(f"initialize_sequence_parallel: sequence_parallel_size must be a positive integer, got "
                         f"{sequence_parallel_size!r}")
    state = _STATE.current()
    if "mesh" in state:
        if state["mesh"].sp != sequence_parallel_size:
            raise ValueError(f"initialize_sequence_parallel({sequence_parallel_size}): this world is already split "
                             f"{state['mesh'].sp} ways by sequence")
        return
    state["mesh"] = build_mesh(sp=sequence_parallel_size, what="sequence_parallel_size")


def adopt_mesh(mesh: ProcessMesh) -> None:
    """Record ``mesh`` (made by initialize from the config's ``sequence_parallel_size``) as this world's."""
    if mesh.sp > 1:
        _STATE.current()["mesh"] = mesh


def sequence_parallel_is_initialized() -> bool:
    return "mesh" in _STATE.current()


def mesh() -> ProcessMesh:
    state = _STATE.current()
    if "mesh" not in state:
        raise RuntimeError("sequence parallelism is not initialised: call initialize_sequence_parallel(size) "
                           "(UlyssesSPAttentionHF.register_with_transformers does), or set sequence_parallel_size "
                           "in the config")
    return state["mesh"]


def get_sequence_parallel_group():
    return mesh().sp_group


def get_sequence_parallel_world_size() -> int:
    return mesh().sp


def get_sequence_parallel_rank() -> int:
    return mesh().sp_rank


def get_sequence_data_parallel_group():
    return mesh().zero_group


def get_sequence_data_parallel_world_size() -> int:
    return mesh().zero_size


def get_sequence_data_parallel_rank() -> int:
    return mesh().zero_rank


# DeepSpeed's parallel_state_sp answers the model-parallel questions with the sequence group.
get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank


def is_sequence_mpu(mpu) -> bool:
    """Whether ``mpu`` describes sequence parallelism (DeepSpeed's test: it can initialise it)."""
    return mpu is sys.modules[__name__] or callable(getattr(mpu, "initialize_sequence_parallel", None))


def mesh_of_mpu(mpu) -> ProcessMesh:
    """The mesh a sequence-parallel mpu describes: this module's, or another one's whose sequence groups are laid
    out as DeepSpeed's parallel_state_sp lays them (consecutive ranks), which is what the engine builds."""
    if mpu is sys.modules[__name__]:
        return mesh()
    for name in ("get_sequence_parallel_world_size", "get_sequence_parallel_group"):
        if not callable(getattr(mpu, name, None)):
            raise ValueError(f"initialize(mpu=...): the sequence-parallel mpu lacks {name}")
    built = build_mesh(sp=int(mpu.get_sequence_parallel_world_size()), what="initialize(mpu=...)")
    group = mpu.get_sequence_parallel_group()
    theirs = tuple(dist.get_process_group_ranks(group)) if dist.is_initialized() and group is not None else \
        tuple(range(built.world_size))
    if theirs != built.ranks["sequence"]:
        raise ValueError(f"initialize(mpu=...): the mpu's sequence group is ranks {list(theirs)}, but zeroengine "
                         f"lays sequence groups out as consecutive ranks ({list(built.ranks['sequence'])} here, as "
                         "DeepSpeed's parallel_state_sp does)")
    adopt_mesh(built)
    return built
