"""Where am I in the world? Read this process's rank from its environment.

A training script must run unchanged under ``zeroengine``, ``torchrun``,
``srun`` or ``mpirun``. Each of them tells the process its place through
different environment variables; ``detect_rank_env`` reads them in a fixed
order and returns one ``RankEnv`` (or ``None`` for a plain single process):

1. ``RANK``/``WORLD_SIZE`` (+ ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``GROUP_RANK``/``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): set by the
   zeroengine launcher, torchrun, or by hand. These win when present, so a
   launcher started inside a SLURM or MPI job still decides the ranks.
2. SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
   ``SLURM_NODEID``, tasks per node, and the first host of the node list as
   master unless ``MASTER_ADDR`` is set.
3. OpenMPI (``mpirun``): ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE,NODE_RANK}``.

Half-set or contradictory variables raise ``ValueError`` naming them: guessing
would start a world that never forms (every rank waits for peers that are not
coming), which is much harder to debug than an error at startup.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the world, whoever launched it.

    ``source`` says which variables it came from: ``"env"`` (RANK/WORLD_SIZE:
    zeroengine, torchrun or by hand), ``"slurm"`` or ``"openmpi"``.
    """
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str = "env"

    def torch_env(self) -> Dict[str, str]:
        """The variables ``init_process_group(init_method="env://")`` and
        torchrun-style scripts read, to be merged into ``os.environ``."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def detect_rank_env(environ: Optional[Mapping[str, str]] = None) -> Optional[RankEnv]:
    """Read the rank layout from ``environ`` (default ``os.environ``).

    Returns ``None`` when no launcher variables are set (a single process).
    Raises ``ValueError`` naming the variables when they are incomplete or
    inconsistent.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torch_vars(env)
    if "SLURM_PROCID" in env:
        return _from_slurm(env)
    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return _from_openmpi(env)
    if "LOCAL_RANK" in env:
        raise ValueError("LOCAL_RANK is set but RANK and WORLD_SIZE are not; set all "
                         "three (or launch with zeroengine/torchrun, which does)")
    return None


# --- the three sources -------------------------------------------------------

def _from_torch_vars(env: Mapping[str, str]) -> RankEnv:
    _require_together(env, "RANK", "WORLD_SIZE")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank, local_world = _opt_int(env, "LOCAL_RANK"), _opt_int(env, "LOCAL_WORLD_SIZE")
    if local_rank is None and local_world is not None:
        raise ValueError("LOCAL_WORLD_SIZE is set but LOCAL_RANK is not")
    if local_rank is None:
        # Hand-set RANK/WORLD_SIZE only: one node holding the whole world.
        local_rank, local_world = rank, world
    elif local_world is None:
        local_world = world
    node_rank = _node_rank(env, ("GROUP_RANK", "NODE_RANK"), rank, local_rank, local_world)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    _check(rank, world, local_rank, local_world, node_rank, names)
    addr = _master_addr(env, None, world, local_world, "WORLD_SIZE")
    return RankEnv(rank, world, local_rank, local_world, node_rank, addr,
                   _master_port(env), "env")


def _from_slurm(env: Mapping[str, str]) -> RankEnv:
    world_var = "SLURM_NPROCS" if "SLURM_NTASKS" not in env and "SLURM_NPROCS" in env \
        else "SLURM_NTASKS"
    for name in (world_var, "SLURM_LOCALID", "SLURM_NODEID"):
        if name not in env:
            raise ValueError(f"SLURM_PROCID is set but {name} is not; run the script "
                             "with srun so that SLURM sets the task variables")
    rank, world = _int(env, "SLURM_PROCID"), _int(env, world_var)
    local_rank, node_rank = _int(env, "SLURM_LOCALID"), _int(env, "SLURM_NODEID")
    local_world, lw_name = _slurm_tasks_on_node(env, node_rank)
    _check(rank, world, local_rank, local_world, node_rank,
           ("SLURM_PROCID", world_var, "SLURM_LOCALID", lw_name))
    hosts = None
    for name in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        if env.get(name):
            hosts = expand_nodelist(env[name], name)
            break
    addr = _master_addr(env, hosts[0] if hosts else None, world, local_world, world_var)
    return RankEnv(rank, world, local_rank, local_world, node_rank, addr,
                   _master_port(env), "slurm")


def _from_openmpi(env: Mapping[str, str]) -> RankEnv:
    _require_together(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                      "OMPI_COMM_WORLD_LOCAL_RANK")
    rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    local_world = _opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or world
    node_rank = _node_rank(env, ("OMPI_COMM_WORLD_NODE_RANK",), rank, local_rank, local_world)
    _check(rank, world, local_rank, local_world, node_rank,
           ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"))
    addr = _master_addr(env, None, world, local_world, "OMPI_COMM_WORLD_SIZE")
    return RankEnv(rank, world, local_rank, local_world, node_rank, addr,
                   _master_port(env), "openmpi")


# --- helpers -------------------------------------------------------------------

def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _opt_int(env: Mapping[str, str], name: str) -> Optional[int]:
    return _int(env, name) if env.get(name, "").strip() else None


def _require_together(env: Mapping[str, str], *names: str) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        present = [n for n in names if n in env]
        raise ValueError(f"{', '.join(present)} set but {', '.join(missing)} not; "
                         f"these variables must be set together")


def _node_rank(env: Mapping[str, str], names, rank: int, local_rank: int,
               local_world: int) -> int:
    values = {n: _int(env, n) for n in names if env.get(n, "").strip()}
    if len(set(values.values())) > 1:
        raise ValueError("node rank variables disagree: "
                         + ", ".join(f"{n}={v}" for n, v in values.items()))
    if values:
        return next(iter(values.values()))
    # Ranks are packed node by node, so this holds for equal-sized nodes.
    return (rank - local_rank) // max(local_world, 1)


def _check(rank: int, world: int, local_rank: int, local_world: int, node_rank: int,
           names) -> None:
    n_rank, n_world, n_local, n_local_world = names
    if world < 1:
        raise ValueError(f"{n_world}={world} must be >= 1")
    if not 0 <= rank < world:
        raise ValueError(f"{n_rank}={rank} must be in [0, {n_world}={world})")
    if not 1 <= local_world <= world:
        raise ValueError(f"{n_local_world}={local_world} must be in [1, {n_world}={world}]")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"{n_local}={local_rank} must be in "
                         f"[0, {n_local_world}={local_world})")
    if local_rank > rank:
        raise ValueError(f"{n_local}={local_rank} cannot exceed {n_rank}={rank}")
    if node_rank < 0:
        raise ValueError(f"node rank must be >= 0, got {node_rank}")


def _master_addr(env: Mapping[str, str], fallback: Optional[str], world: int,
                 local_world: int, world_name: str) -> str:
    if env.get("MASTER_ADDR", "").strip():
        return env["MASTER_ADDR"].strip()
    if fallback:
        return fallback
    if local_world < world:
        raise ValueError(f"MASTER_ADDR must be set: the world ({world_name}={world}) "
                         "spans more than one node")
    return DEFAULT_MASTER_ADDR


def _master_port(env: Mapping[str, str]) -> int:
    if not env.get("MASTER_PORT", "").strip():
        return DEFAULT_MASTER_PORT
    port = _int(env, "MASTER_PORT")
    if not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT={port} is not a valid TCP port")
    return port


def _slurm_tasks_on_node(env: Mapping[str, str], node_rank: int):
    """Tasks on this node, and the variable it came from."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name, "").strip():
            counts = expand_tasks_per_node(env[name], name)
            if node_rank >= len(counts):
                raise ValueError(f"SLURM_NODEID={node_rank} but {name}={env[name]!r} "
                                 f"describes only {len(counts)} node(s)")
            return counts[node_rank], name
    if env.get("SLURM_NTASKS_PER_NODE", "").strip():
        return _int(env, "SLURM_NTASKS_PER_NODE"), "SLURM_NTASKS_PER_NODE"
    raise ValueError("SLURM_PROCID is set but neither SLURM_TASKS_PER_NODE nor "
                     "SLURM_NTASKS_PER_NODE is")


_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> List[int]:
    """``"2(x3),1"`` → ``[2, 2, 2, 1]`` (SLURM's compressed per-node counts)."""
    counts: List[int] = []
    for part in text.strip().split(","):
        m = _TASKS_RE.match(part.strip())
        if not m:
            raise ValueError(f"{name}={text!r}: cannot parse {part!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside ``[...]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_host(pattern: str, name: str) -> List[str]:
    open_at = pattern.find("[")
    if open_at < 0:
        if "]" in pattern:
            raise ValueError(f"{name}: unbalanced ']' in {pattern!r}")
        return [pattern]
    close_at = pattern.find("]", open_at)
    if close_at < 0:
        raise ValueError(f"{name}: unbalanced '[' in {pattern!r}")
    prefix, body, rest = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    values: List[str] = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{name}: bad range {item!r} in {pattern!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"{name}: empty range {item!r} in {pattern!r}")
        values += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    tails = _expand_host(rest, name)
    return [prefix + v + t for v in values for t in tails]


def expand_nodelist(text: str, name: str = "SLURM_JOB_NODELIST") -> List[str]:
    """Expand SLURM's compressed host list: ``"a[01-02,7],b"`` → ``[a01, a02, a7, b]``."""
    hosts: List[str] = []
    for part in _split_top_level(text.strip()):
        hosts += _expand_host(part, name)
    if not hosts:
        raise ValueError(f"{name}={text!r} names no hosts")
    return hosts
