"""Process-group setup: the one place that decides backend, rank and timeout.

``init_distributed`` reads the rank environment the launcher, torchrun, SLURM
or OpenMPI set (see :mod:`zeroengine.launcher.rank_env`); without one it forms
a world of one, so a plain ``python train.py`` works unchanged.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from .groups import forget_world
from .handshake import comm_timeout_s, default_timeout_s
from .sequence_check import CollectiveSequenceChecker
from .watchdog import FAILED, FINISHED, Watchdog, watchdog_requested


class _State:
    checker: CollectiveSequenceChecker | None = None
    checker_generation: int = 0
    timeout_s: float | None = None  # the process group's, when zeroengine made it
    shutdowns: int = 0  # shutdown() calls so far (each numbers its departure keys)
    watchdog: Watchdog | None = None  # this rank's heartbeat and hang reports (zeroengine.comm.watchdog)
    watchdog_world = None  # the default group the watchdog serves
    watchdogs: int = 0  # started so far in this process (each numbers its store keys)


state = _State()


class _ExitTeardown:
    """Tears down, at interpreter exit, the process group zeroengine used and the script left standing.

    Scripts that never destroy their group (Hugging Face's Trainer, accelerate's loops, most DeepSpeed
    scripts) hit gloo's teardown race at exit: a rank leaving while a peer still finishes its last collective
    aborts the peer ("terminate called without an active exception"). :func:`shutdown`'s meeting avoids it.
    A rank leaving on an uncaught exception skips the meeting (its peers may be blocked in a collective it
    will never join, and the launcher is about to stop them): it must not wait out a deadline first."""

    def __init__(self):
        self.registered = False
        self.failing = False

    def register(self) -> None:
        if self.registered:
            return
        self.registered = True
        previous = sys.excepthook

        def note_failure(*exc_info):
            self.failing = True
            if state.watchdog is not None:  # peers' hang reports say this rank failed, and why
                first_line = (str(exc_info[1]).strip().splitlines() or [""])[0][:300]
                state.watchdog.stop(FAILED, f"{exc_info[0].__name__}: {first_line}")
            previous(*exc_info)

        sys.excepthook = note_failure
        atexit.register(self.run)

    def run(self) -> None:
        if self.failing or not dist.is_initialized():
            # (the script destroyed its group itself, or is failing: the watchdog still polls the store, and
            # must not be inside a store call when the interpreter finalizes; see Watchdog.stop)
            stop_watchdog()
            return
        try:
            shutdown()
        except Exception:  # at exit, nothing is left to report to
            pass


exit_teardown = _ExitTeardown()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str | None = None, timeout_s: float | None = None, *,
                     dist_backend: str | None = None, timeout: timedelta | float | None = None,
                     distributed_port: int | None = None, auto_mpi_discovery: bool = True,
                     init_method: str | None = None, rank: int = -1, world_size: int = -1, verbose: bool = True,
                     dist_init_required: bool | None = None, config=None) -> None:
    """Initialise torch.distributed once, from the launcher's environment or as a world of 1.

    DeepSpeed's keywords: ``dist_backend`` is ``backend``; ``timeout`` (a timedelta or seconds) is
    ``timeout_s``; ``distributed_port`` is the rendezvous port where the environment names none;
    ``auto_mpi_discovery`` is always on (SLURM and Open MPI variables are read). ``verbose``,
    ``dist_init_required`` and ``config`` are accepted and change nothing. ``init_method``, ``rank`` and
    ``world_size`` are refused: the world is read from the environment, so that every rank agrees on it."""
    if init_method is not None or rank not in (-1, None) or world_size not in (-1, None):
        raise ValueError("init_distributed(init_method=/rank=/world_size=) is not supported: zeroengine reads the "
                         "world from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    if dist_init_required is False:
        return
    if timeout is not None:
        timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if dist.is_initialized():  # made by the script or its framework (Lightning, accelerate): zeroengine uses it,
        exit_teardown.register()  # so it leaves it standing no less safely than one it made
        start_watchdog()
        return
    if distributed_port is not None and "RANK" in os.environ:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    from zeroengine.launcher.rank_env import detect_rank_env

    env = detect_rank_env()
    if env is None:
        rank, world, addr, port = 0, 1, "127.0.0.1", _free_port()
    else:
        rank, world, addr, port = env.rank, env.world_size, env.master_addr, env.master_port
        # Under SLURM or MPI, publish the torchrun-style variables too, so code
        # that reads RANK / LOCAL_RANK sees the same world as zeroengine.
        for key, value in env.torch_env().items():
            os.environ.setdefault(key, value)
        if torch.cuda.is_available():
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    backend = backend or dist_backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        # DeepSpeed-style scripts name NCCL outright (the sequence-parallel tutorial does); on a machine without
        # CUDA it cannot start, and gloo computes the same collectives.
        from zeroengine.progress import get_logger

        get_logger().warning("init_distributed: the \"nccl\" backend needs CUDA, which this machine lacks; "
                             "using gloo")
        backend = "gloo"
    # Collectives give up after ZEROENGINE_COMM_TIMEOUT (600 s) instead of hanging when a peer died; torch's
    # own default (30 min for gloo) is far too patient for a job whose launcher is already tearing it down.
    state.timeout_s = timeout_s or comm_timeout_s()
    timeout = timedelta(seconds=state.timeout_s)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    exit_teardown.register()
    start_watchdog()


def start_watchdog() -> None:
    """Start this rank's watchdog for the current world (once per world; not in a world of one, nor with
    ``ZEROENGINE_WATCHDOG=0``). Every rank starts one per world, so their store keys agree."""
    if state.watchdog is not None and state.watchdog_world is dist.group.WORLD:
        return
    stop_watchdog()
    if dist.get_world_size() == 1 or not watchdog_requested():
        return
    from torch.distributed.distributed_c10d import _get_default_store

    state.watchdogs += 1
    timeout_s = state.timeout_s or comm_timeout_s()
    state.watchdog = Watchdog(_get_default_store(), dist.get_rank(), timeout_s, generation=state.watchdogs,
                              silent_backend=dist.get_backend() != "gloo").start()
    state.watchdog_world = dist.group.WORLD


def stop_watchdog(final_state: str | None = None) -> None:
    if state.watchdog is not None:
        try:
            state.watchdog.stop(final_state)
        except Exception:  # the store is gone already: there is nobody left to tell
            pass
    state.watchdog, state.watchdog_world = None, None


def shutdown() -> None:
    """Tear the process group down (call at the end of a script; NCCL warns otherwise).

    Ranks first meet (through the store, with a deadline, so a rank that never comes cannot hang the
    others): a rank that tears down while a peer is still finishing its last collective closes the
    connections under it, and the peer's gloo threads abort the process ("terminate called without an
    active exception", seen in the example run under load)."""
    if not dist.is_initialized():
        return
    forget_world()  # the groups cached for this world (meshes, host twins, expert groups) die with it
    stop_watchdog(FINISHED)  # first: a peer still waiting in a collective names this rank as having left
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        dist.destroy_process_group()
        return
    from torch.distributed.distributed_c10d import _get_default_store

    from .handshake import HandshakeTimeout, handshakes

    deadline = min(60.0, default_timeout_s())
    store = _get_default_store()  # kept past the group's teardown: rank 0's process hosts it
    met = True
    try:
        handshakes.exchange("shutdown", b"", timeout_s=deadline)
    except HandshakeTimeout as err:  # a peer is gone already (or failed): nothing left to wait for
        met = False
        from zeroengine.progress import get_logger

        get_logger().warning(f"rank {rank}: shutdown did not meet rank(s) {err.missing} (gone or "
                             "failed before the end of the script); tearing down without them")
    state.shutdowns += 1
    dist.destroy_process_group()
    if not met:
        return
    # Rank 0 hosts the store and leaves last: a rank still tearing its gloo connections down when rank 0's
    # process exits has them closed under it, and aborts ("terminate called without an active exception").
    left = f"ze_left/{state.shutdowns}"
    try:
        if rank != 0:
            store.set(f"{left}/{rank}", b"")
        else:
            store.wait([f"{left}/{r}" for r in range(1, world)], timedelta(seconds=deadline))
    except Exception:  # a peer gone meanwhile: its departure is all that was waited for
        pass


def enable_sequence_check(timeout_s: float | None = None) -> None:
    """Turn on the collective-sequence checker (debug mode) for this process. A rank waits up to
    ``timeout_s`` (default: the handshake deadline, ``ZEROENGINE_HANDSHAKE_TIMEOUT``, else the comm
    timeout) for its peers to post the same collective."""
    if timeout_s is None:
        timeout_s = default_timeout_s()
    from torch.distributed.distributed_c10d import _get_default_store

    # Every rank enables the check the same number of times, so the generation agrees across ranks.
    state.checker_generation += 1
    state.checker = CollectiveSequenceChecker(_get_default_store(), dist.get_rank(), timeout_s,
                                              generation=state.checker_generation)


def disable_sequence_check() -> None:
    state.checker = None


def sequence_check_requested() -> bool:
    return os.environ.get("ZEROENGINE_COMM_DEBUG", "0") not in ("", "0", "false", "False")


def sequence_check_active() -> bool:
    """Whether every collective is being checked right now (comm_debug)."""
    return state.checker is not None


def get_rank(group=None) -> int:
    """This process's rank in the world, or within ``group`` (DeepSpeed's ``get_rank(group=...)``)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_rank_in(group=None) -> int:
    """This process's rank within ``group`` (the world when None)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The world rank of the member ``group_rank`` of ``group`` (the world when None: ``group_rank`` itself)."""
    if group is None or group is dist.group.WORLD or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def device_for_backend() -> torch.device:
    """Where collective buffers must live: the current CUDA device for NCCL, CPU for gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
