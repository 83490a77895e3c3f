"""Typed collectives: the only code in zeroengine that calls torch.distributed ops.

Each function records its call and bytes in :data:`zeroengine.comm.counters.counters`,
runs the collective-sequence check when debug mode is on, and hides the
torch-version differences (2.13 renamed ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` to ``*_single``; 2.11 only has the old names).
All take ``group=None`` for the world and ``async_op`` where overlap matters.
"""
from __future__ import annotations

import contextvars
import os
import re
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .backend import state
from .counters import counters, ring_wire_bytes
from .scratch import scratch
from .sequence_check import Fingerprint, caller_site

ReduceOp = dist.ReduceOp

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_LABEL = contextvars.ContextVar("zeroengine_collective_label", default="")


@contextmanager
def collective_context(label: str):
    """Name what the collectives issued inside are for (e.g. "module blocks.0.attn (forward)").

    The label joins the collective's fingerprint in debug mode, so ranks that
    diverge are told apart by what they were doing, not only by op and size.
    """
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


def _group_ranks(group) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


class _Issued:
    """A collective as issued here: what its error names, and the watchdog's ticket for it (None when off)."""
    __slots__ = ("op", "payload_bytes", "group", "label", "ticket")

    def __init__(self, op, payload_bytes, group, label, ticket):
        self.op, self.payload_bytes, self.group, self.label, self.ticket = op, payload_bytes, group, label, ticket


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _before(op: str, tensor: torch.Tensor, group, payload_bytes: int, sizes_must_match: bool = True) -> _Issued:
    world = dist.get_world_size(group)
    counters.record(op, payload_bytes, ring_wire_bytes(op, payload_bytes, world))
    label = _LABEL.get()
    if state.checker is not None:
        ranks = _group_ranks(group)
        fp = Fingerprint(op, _dtype_name(tensor), tensor.numel(), caller_site(), sizes_must_match, label)
        state.checker.check("-".join(map(str, ranks)) if len(ranks) < 64 else f"g{id(group)}", ranks, fp)
    watchdog = state.watchdog
    ticket = None
    if watchdog is not None:
        ticket = watchdog.issue(watchdog.group_name(group), op, _dtype_name(tensor),
                                tensor.numel() if sizes_must_match else 0, label)
    return _Issued(op, payload_bytes, group, label, ticket)


def _point_to_point(op: str, tensor: torch.Tensor, src: int, dst: int, group) -> _Issued:
    """A send or receive as the watchdog counts it: the k-th message from ``src`` to ``dst`` is one "group"'s
    k-th collective on both sides, so a receive waiting for a send never made names its sender."""
    watchdog, ticket, label = state.watchdog, None, _LABEL.get()
    if watchdog is not None:
        ticket = watchdog.issue(watchdog.pair_name(src, dst), op, _dtype_name(tensor), tensor.numel(), label)
    return _Issued(op, _nbytes(tensor), group, label, ticket)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CollectiveError(RuntimeError):
    """A collective failed or timed out: what it was, and the backend's own message."""


def _failed(issued: _Issued, exc: Exception) -> CollectiveError:
    world = dist.get_world_size(issued.group)
    what = f" for {issued.label}" if issued.label else ""
    message = (f"rank {dist.get_rank()}: {issued.op} of {issued.payload_bytes} bytes over {world} ranks{what} "
               f"failed: {exc}")
    if _REMOTE.search(str(exc)):  # a peer's fault or a timeout, not a local misuse of the call
        if state.watchdog is not None and issued.ticket is not None:
            # Stacks are worth waiting for only when the peers may be alive: a timeout, not a closed connection.
            report = state.watchdog.report(issued.ticket, members=None,
                                           timed_out=bool(_TIMEOUT.search(str(exc))))
            return CollectiveError(f"{message}\n{report}")
        waits = (f"ZEROENGINE_COMM_TIMEOUT ({state.timeout_s:.0f} s)" if state.timeout_s is not None
                 else "the process group's timeout")
        message += (f". Another rank died, is stuck, or issued a different collective (a code path taken on some "
                    f"ranks only); a collective waits {waits}. Look for the first failing rank's own error; set "
                    "\"comm_debug\": true to compare every rank's collectives.")
    return CollectiveError(message)


# What gloo and NCCL say when the other side is gone or late.
_REMOTE = re.compile(r"timed? ?out|timeout|connection|closed by peer|broken pipe|reset by peer|peer|abort|"
                     r"watchdog|ncclRemoteError|ncclSystemError", re.IGNORECASE)
_TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)


def _call(issued: _Issued, run, async_op: bool, finish=None):
    """Run ``run()`` (the torch.distributed call), naming the collective if it fails now or when waited on;
    ``finish`` runs once it has completed. Returns a handle when ``async_op``, else None."""
    watchdog = state.watchdog if issued.ticket is not None else None
    if watchdog is not None and not async_op:
        watchdog.block(issued.ticket)
    try:
        work = run()
    except RuntimeError as exc:
        raise _failed(issued, exc) from exc
    finally:
        if watchdog is not None and not async_op:
            watchdog.unblock()
    handle = _AfterWait(work, finish, issued)
    if async_op:
        return handle
    handle.wait()
    return None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    issued = _before("all_reduce", tensor, group, _nbytes(tensor))
    return _call(issued, lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op)


def _use_all_to_all(group) -> bool:
    """Note: gloo's reduce-scatter and all-gather.

    torch's gloo backend implements reduce_scatter_tensor and
    all_gather_into_tensor slowly: measured on 2 CPU ranks, 50 MB each takes
    2-3x one all-reduce of the same buffer, so ZeRO's reduce-scatter +
    all-gather would cost ~5x plain data parallel's all-reduce. Its
    all_to_all_single is fast, and both collectives are all-to-alls with the
    same bytes on the wire ((N-1)/N of the buffer): reduce-scatter sends chunk
    j to rank j and sums what arrives; all-gather sends this rank's chunk to
    every rank. So on gloo they are built from all_to_all_single
    (ZEROENGINE_GLOO_NATIVE_COLLECTIVES=1 restores gloo's own); NCCL keeps its
    native kernels.
    """
    # A world of one has nothing to exchange: the native call is a copy, without a full-size temporary.
    return (dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1
            and os.environ.get("ZEROENGINE_GLOO_NATIVE_COLLECTIVES", "0") == "0")


class _AfterWait:
    """A Work handle that runs ``finish`` once the underlying collective has completed, and names the
    collective if waiting for it fails."""

    def __init__(self, work, finish, issued: _Issued):
        self._work, self._finish, self._issued, self._done = work, finish, issued, False

    def wait(self, timeout=None):
        if not self._done:
            if self._work is not None:
                watchdog = state.watchdog if self._issued.ticket is not None else None
                if watchdog is not None:
                    watchdog.block(self._issued.ticket)
                try:
                    self._work.wait()
                except RuntimeError as exc:
                    raise _failed(self._issued, exc) from exc
                finally:
                    if watchdog is not None:
                        watchdog.unblock()
            if self._finish is not None:
                self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """Whether the result is ready (a pending ``finish`` must run in ``wait`` first)."""
        return self._done or (self._finish is None and self._work is not None and self._work.is_completed())


def _flat(name: str, **tensors) -> None:
    """DeepSpeed's (and torch.distributed's) list forms take a list of tensors: say what these take."""
    for arg, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"zeroengine.comm.{name}: {arg} must be one flat tensor (the form of torch's "
                            f"{name}_into_tensor / reduce_scatter_tensor), got {type(value).__name__}; for a "
                            "list of tensors, torch.cat them or use torch.distributed directly")


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Flat reduce-scatter: ``input`` holds world_size equal chunks, ``output`` one chunk."""
    _flat("reduce_scatter", output=output, input=input)
    issued = _before("reduce_scatter", input, group, _nbytes(input))
    if op != ReduceOp.SUM or not _use_all_to_all(group):
        return _call(issued, lambda: _reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op), async_op)
    world = dist.get_world_size(group)
    received = scratch.take(input.numel(), input.dtype, input.device).view(input.shape)

    def finish():
        torch.sum(received.view(world, -1), dim=0, out=output)
        scratch.give(received)

    return _call(issued, lambda: dist.all_to_all_single(received, input, group=group, async_op=async_op), async_op, finish)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Flat all-gather: ``output`` receives world_size copies of ``input``'s size, in rank order."""
    _flat("all_gather", output=output, input=input)
    issued = _before("all_gather", input, group, _nbytes(output))
    if not _use_all_to_all(group):
        return _call(issued, lambda: _all_gather_flat(output, input, group=group, async_op=async_op), async_op)
    world = dist.get_world_size(group)
    copies = scratch.take(world * input.numel(), input.dtype, input.device)
    copies.view(world, -1).copy_(input.reshape(1, -1).expand(world, -1))
    return _call(issued, lambda: dist.all_to_all_single(output, copies, group=group, async_op=async_op), async_op,
                 lambda: scratch.give(copies))


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    issued = _before("broadcast", tensor, group, _nbytes(tensor))
    return _call(issued, lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    uneven = input_split_sizes is not None or output_split_sizes is not None
    issued = _before("all_to_all", input, group, _nbytes(input), sizes_must_match=not uneven)
    return _call(issued, lambda: dist.all_to_all_single(
        output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
        group=group, async_op=async_op), async_op)


def barrier(group=None) -> None:
    marker = torch.zeros(1)
    issued = _before("barrier", marker, group, 0)
    _call(issued, lambda: dist.barrier(group=group), async_op=False)


def all_reduce_scalar(value: float, op=ReduceOp.SUM, group=None) -> float:
    """Reduce one Python number across ranks (loss logging, overflow flags, norms)."""
    from .backend import device_for_backend

    t = torch.tensor([float(value)], dtype=torch.float64 if device_for_backend().type == "cpu" else torch.float32,
                     device=device_for_backend())
    all_reduce(t, op=op, group=group)
    return t.item()


def all_reduce_value(value: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """Reduce a one-element tensor across ranks where it lives (a gradient norm's partial sum, a loss): no host
    read, unlike :func:`all_reduce_scalar`. Returns a new 0-dim tensor; ``value`` is left as it was."""
    reduced = value.reshape(1).clone()
    all_reduce(reduced, op=op, group=group)
    return reduced[0]


def control_all_gather(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """A tiny synchronous all-gather of bookkeeping (e.g. which stage-3 bucket each rank is about to
    gather), counted as ``control`` so the data volumes the ZeRO formulas speak of stay exact."""
    issued = _before("control", input, group, _nbytes(output))
    if dist.get_backend(group) == "gloo":  # gloo's all_to_all_single is its quickest small exchange (~30%)
        world = dist.get_world_size(group)
        copies = input.reshape(1, -1).expand(world, -1).contiguous()
        _call(issued, lambda: dist.all_to_all_single(output, copies, group=group), async_op=False)
    else:
        _call(issued, lambda: _all_gather_flat(output, input, group=group), async_op=False)


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order (bookkeeping: counted as ``control``, its size unknown
    before pickling)."""
    marker = torch.zeros(1)
    issued = _before("control", marker, group, 0, sizes_must_match=False)
    gathered = [None] * dist.get_world_size(group)
    _call(issued, lambda: dist.all_gather_object(gathered, obj, group=group), async_op=False)
    return gathered


# -- point to point (pipeline parallelism's activations and their gradients) -----------------------------------
# Counted like the collectives (wire bytes: what this rank sends) but outside the sequence check: a send has one
# partner, and the pipeline schedule, not the call order on every rank, decides what matches it. Sends are
# asynchronous: a schedule that blocked in a send while its partner blocked in its own send the other way
# (1F1B's steady state) would deadlock; so a send returns a handle to wait on later, and a receive blocks.

def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    """Start sending ``tensor`` to global rank ``dst``; leave ``tensor`` unchanged until the handle's ``wait``.
    ``tag`` tells apart messages between the same two ranks (not with NCCL)."""
    size = _nbytes(tensor)
    counters.record("send", size, float(size))
    issued = _point_to_point("send", tensor, dist.get_rank(), dst, group)
    return _call(issued, lambda: dist.isend(tensor, dst=dst, group=group, tag=tag), async_op=True)


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> None:
    """Receive into ``tensor`` from global rank ``src`` (blocks until it has arrived)."""
    size = _nbytes(tensor)
    counters.record("recv", size, 0.0)
    issued = _point_to_point("recv", tensor, src, dist.get_rank(), group)
    _call(issued, lambda: dist.irecv(tensor, src=src, group=group, tag=tag), async_op=False)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until it has gone (a blocking :func:`isend`)."""
    isend(tensor, dst, group=group, tag=tag).wait()


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0):
    """Start receiving into ``tensor`` from global rank ``src``; its values are there after the handle's ``wait``."""
    size = _nbytes(tensor)
    counters.record("recv", size, 0.0)
    issued = _point_to_point("recv", tensor, src, dist.get_rank(), group)
    return _call(issued, lambda: dist.irecv(tensor, src=src, group=group, tag=tag), async_op=True)


def recv_from_any(tensor: torch.Tensor, group=None, tag: int = 0) -> int:
    """Receive into ``tensor`` from whichever rank sends first (blocks); returns that rank (global)."""
    size = _nbytes(tensor)
    counters.record("recv", size, 0.0)
    try:
        return dist.recv(tensor, src=None, group=group, tag=tag)
    except RuntimeError as exc:
        raise _failed(_Issued("recv", size, group, _LABEL.get(), None), exc) from exc


def broadcast_object_list(object_list: list, src: int, group=None, device=None) -> None:
    """Replace ``object_list``'s items on every rank by those of global rank ``src`` (picklable objects;
    bookkeeping, counted as ``control`` like :func:`all_gather_object`). ``device``: where the pickles travel
    (torch's default: the current CUDA device under NCCL)."""
    marker = torch.zeros(1)
    issued = _before("control", marker, group, 0, sizes_must_match=False)
    _call(issued, lambda: dist.broadcast_object_list(object_list, src=src, group=group, device=device), async_op=False)


def wait_all(handles: list) -> None:
    """Wait for every handle in ``handles`` (sends in flight), then empty the list."""
    for handle in handles:
        handle.wait()
    handles.clear()
