"""Start this node's ranks.

A node runs ``len(slots)`` processes with global ranks
``first_rank .. first_rank + len(slots) - 1``. Each rank gets the variables
torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
NODE_RANK, MASTER_ADDR, MASTER_PORT), which ``rank_env.detect_rank_env`` and
``torch.distributed.init_process_group(init_method="env://")`` read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .commands import JobSpec, LaunchCommand, user_argv
from .hostfile import node_offsets


@dataclass(frozen=True)
class NodePlan:
    """The ranks one node runs and where the world meets."""
    node_rank: int
    num_nodes: int
    first_rank: int
    world_size: int
    slots: Tuple[int, ...]  # device index of each local rank
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"node rank {self.node_rank} must be in [0, {self.num_nodes})")
        if not self.slots:
            raise ValueError("a node needs at least one process")
        if self.first_rank + len(self.slots) > self.world_size:
            raise ValueError(f"ranks {self.first_rank}..{self.first_rank + len(self.slots) - 1}"
                             f" do not fit in a world of {self.world_size}")

    @property
    def num_procs(self) -> int:
        return len(self.slots)


def plan_uniform(num_nodes: int, node_rank: int, num_procs: int, master_addr: str,
                 master_port: int, slots: Optional[Sequence[int]] = None) -> NodePlan:
    """Every node runs ``num_procs`` ranks (the hand-launched ``--node_rank`` case)."""
    slots = tuple(slots) if slots is not None else tuple(range(num_procs))
    if len(slots) != num_procs:
        raise ValueError(f"{num_procs} processes but {len(slots)} slots {list(slots)}")
    return NodePlan(node_rank, num_nodes, node_rank * num_procs, num_nodes * num_procs,
                    slots, master_addr, master_port)


def plan_from_layout(layout: Mapping[str, List[int]], node_rank: int, master_addr: str,
                     master_port: int) -> NodePlan:
    """Node ``node_rank`` of a world layout (nodes may differ in size)."""
    hosts = list(layout)
    if not 0 <= node_rank < len(hosts):
        raise ValueError(f"--node_rank {node_rank} is out of range for "
                         f"{len(hosts)} node(s)")
    return NodePlan(node_rank, len(hosts), node_offsets(layout)[node_rank],
                    sum(len(s) for s in layout.values()), tuple(layout[hosts[node_rank]]),
                    master_addr, master_port)


def visible_devices(slots: Sequence[int], environ: Mapping[str, str]) -> Optional[str]:
    """CUDA_VISIBLE_DEVICES for this node, or ``None`` to leave it alone.

    Only a slot selection other than the first N devices needs it (e.g.
    ``--include localhost:1,3``). Slots index the devices visible to us, so an
    existing CUDA_VISIBLE_DEVICES is narrowed rather than replaced.
    """
    if list(slots) == list(range(len(slots))):
        return None
    current = environ.get("CUDA_VISIBLE_DEVICES")
    if current is None or not current.strip():
        return ",".join(map(str, slots))
    visible = [d.strip() for d in current.split(",") if d.strip()]
    missing = [s for s in slots if s >= len(visible)]
    if missing:
        raise ValueError(f"slot {missing[0]} selected but CUDA_VISIBLE_DEVICES={current!r} "
                         f"shows only {len(visible)} device(s)")
    return ",".join(visible[s] for s in slots)


def rank_env_vars(plan: NodePlan, local_rank: int,
                  environ: Mapping[str, str]) -> Dict[str, str]:
    """The variables added to ``environ`` for one local rank."""
    env = {
        "RANK": str(plan.first_rank + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_WORLD_SIZE": str(plan.num_procs),
        "GROUP_RANK": str(plan.node_rank),
        "NODE_RANK": str(plan.node_rank),
        "MASTER_ADDR": plan.master_addr,
        "MASTER_PORT": str(plan.master_port),
    }
    devices = visible_devices(plan.slots, environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    # As torchrun: N processes each using every core would oversubscribe the CPU.
    if plan.num_procs > 1 and "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = "1"
    return env


def rank_commands(plan: NodePlan, job: JobSpec,
                  environ: Mapping[str, str]) -> List[LaunchCommand]:
    """One command per local rank, in local-rank order."""
    return [LaunchCommand(name=f"rank {plan.first_rank + i}",
                          argv=tuple(user_argv(job, local_rank=i)),
                          env=rank_env_vars(plan, i, environ))
            for i in range(plan.num_procs)]

