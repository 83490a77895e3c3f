"""Run a function on every rank of a real gloo world of N CPU processes.

Every multi-process test in the project goes through :func:`run_distributed`.
Workers are forked from a forkserver that has already imported torch, so a
4-rank world starts in well under a second, and the server itself never ran
an OpenMP region (forking a process that has can deadlock its children). The
server also imports what every rank would otherwise import again: ``torch._dynamo``
(every ``torch.optim.Optimizer`` imports it on first construction, ~3.7 s of CPU
per process on a 2-core machine) and the engine's own modules (~0.6 s). Neither
starts a thread.

A failure on any rank fails the call with that rank's traceback; a rank that
dies without reporting (a segfault, os._exit) is named with its exit code;
the remaining ranks are killed, never left hanging.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from datetime import timedelta

_CTX = None
RANK_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "NODE_RANK", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK")


class DistributedTestError(AssertionError):
    pass


# Imported once, in the fork server, and inherited by every worker it forks: importing torch (and transformers'
# model code, ~3 s of CPU a process) in each of a suite's hundreds of workers would cost minutes. The fork server
# skips a module that is not installed.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zeroengine.initialization"]
_PRELOAD_IF_INSTALLED = ["transformers"] + [f"transformers.models.{name}.modeling_{name}" for name in (
    "llama", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe")]


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload([*_PRELOAD, *_PRELOAD_IF_INSTALLED])
    return _CTX


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, kwargs, results, timeout_s, threads, env, store_linger_s):
    import torch
    import torch.distributed as dist

    for key in RANK_ENV_VARS:
        os.environ.pop(key, None)
    os.environ.update(env)
    # The launcher's variables, so code under test that reads them sees a normal world.
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args, **kwargs)
        # Serialized by value: tensors put on a queue as-is travel as shared-memory
        # handles that die with this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
        _leave_store_host_last(rank, world_size, store_linger_s)
    except BaseException:  # report everything, including assertion failures and SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _leave_store_host_last(rank: int, world_size: int, deadline_s: float = 30.0) -> None:
    """Rank 0 hosts the rendezvous store: had it left before a peer read what it last posted there (a
    checkpoint's commit outcome), that peer would fail with "rank 0 has died". So the others note that they
    are leaving, and rank 0 waits for those notes (bounded) before it goes. The others do not wait: a test may
    have a rank leave early on purpose, for its peer to see it gone."""
    import torch.distributed as dist

    if not dist.is_initialized() or world_size == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    try:
        if rank != 0:
            store.set(f"zeroengine_harness_left/{rank}", b"")
        else:
            store.wait([f"zeroengine_harness_left/{r}" for r in range(1, world_size)], timedelta(seconds=deadline_s))
    except Exception:  # a peer that failed or is stuck is the parent's to report
        pass


def run_distributed(fn, world_size: int, *args, timeout_s: float = 240.0, env: dict | None = None,
                    store_linger_s: float = 30.0, **kwargs):
    """Call ``fn(rank, world_size, *args, **kwargs)`` on each rank; return the per-rank results as a list.

    ``store_linger_s``: how long rank 0 (the rendezvous store's host) waits, after its ``fn`` returns, for the
    others to leave (see ``_leave_store_host_last``); a test whose other ranks stay stuck until rank 0 has gone
    sets it short.

    ``fn`` must be importable (defined at module level). Each worker gets
    ``max(1, cpus // world_size)`` torch threads so 4 ranks on 2 cores do not
    oversubscribe.
    """
    ctx = _context()
    port = free_port()
    results = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, results, timeout_s, threads,
                                          dict(env or {}), store_linger_s), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, object]] = {}
    try:
        _collect(procs, results, outcome, world_size, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    errors = {r: v for r, (status, v) in outcome.items() if status != "ok"}
    if errors:
        first = min(errors)
        details = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise DistributedTestError(f"rank {first} failed (world of {world_size}):\n{details}")
    import torch

    return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]


def _collect(procs, results, outcome, world_size, timeout_s):
    import time

    deadline = time.monotonic() + timeout_s
    while len(outcome) < world_size:
        try:
            rank, status, value = results.get(timeout=0.2)
            outcome[rank] = (status, value)
            if status != "ok":
                # Give the others a moment to report their own errors, then stop.
                _drain(results, outcome, world_size, grace_s=3.0)
                break
            continue
        except queue.Empty:
            pass
        for rank, p in enumerate(procs):
            if rank not in outcome and not p.is_alive():
                _drain(results, outcome, world_size, grace_s=0.5)
                if rank not in outcome:
                    outcome[rank] = ("error", f"process died with exit code {p.exitcode} without reporting")
        if any(status != "ok" for status, _ in outcome.values()):
            break
        if time.monotonic() > deadline:
            for rank in range(world_size):
                outcome.setdefault(rank, ("error", f"timed out after {timeout_s:.0f}s"))
            break


def _drain(results, outcome, world_size, grace_s):
    import time

    end = time.monotonic() + grace_s
    while len(outcome) < world_size and time.monotonic() < end:
        try:
            rank, status, value = results.get(timeout=0.1)
            outcome[rank] = (status, value)
        except queue.Empty:
            continue
