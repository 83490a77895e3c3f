"""Offloading the hidden states that activation checkpointing keeps, to host memory (the last piece of Arctic
Long Sequence Training; DeepSpeed's ``get_checkpoint_hidden_states_offloading_ctx_manager``).

With every layer checkpointed, what a long sequence still holds on the accelerator between forward and backward
is each layer's input hidden states: ``layers × batch × seq × hidden`` values, which grows with the sequence and
is what limits it once the rest is tiled. Inside this context, each Hugging Face ``GradientCheckpointingLayer``'s
input (``args[0]``, when the layer checkpoints) is marked, and when the checkpoint saves it for backward the
saved-tensor hook copies it to a pinned host buffer on a side stream, freeing the device copy; backward brings it
back. The last ``keep_last_count`` inputs stay on the device: backward needs them first, and sending them away
only to bring them back at once would cost two copies for nothing. Everything else that autograd saves passes
through untouched.

On a machine whose tensors already live in host memory (no accelerator), there is nothing to move: the context
says so once and changes nothing.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("zeroengine")


@dataclass
class CheckpointActivationOffloadStats:
    offloaded: int = 0  # hidden states copied to host memory
    offloaded_bytes: int = 0
    kept: int = 0  # the last ones, left on the device
    on_host_already: int = 0  # marked, but in host memory already (no accelerator)
    restored: int = 0  # brought back in backward


class _Saved:
    """One marked hidden state between forward and backward: on the device, or in a host buffer."""

    __slots__ = ("device_tensor", "host", "event", "device", "pool")

    def __init__(self, tensor: torch.Tensor):
        self.device_tensor, self.host, self.event, self.device, self.pool = tensor, None, None, tensor.device, None


class CheckpointHiddenStatesOffload(torch.autograd.graph.saved_tensors_hooks):
    """Use as ``with ctx: loss = model(**batch).loss; loss.backward()`` (one instance across steps: its host
    buffers are reused). Arguments are DeepSpeed's: pinned buffers, a side stream for the copies, tensors below
    ``min_offload_bytes`` left alone, at most ``max_fwd_stash_count`` copies in flight, at most
    ``max_cpu_buffer_pool_count`` idle host buffers kept, the last ``keep_last_count`` inputs kept on the device.
    ``offload_host_tensors`` (zeroengine's, for tests without an accelerator): treat host tensors as if they were
    on a device, copying them to separate host buffers."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1,
                 offload_host_tensors: bool = False):
        super().__init__(self._pack, self._unpack)
        for name, value in (("min_offload_bytes", min_offload_bytes), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("keep_last_count", keep_last_count)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"offload_activations: {name} must be an integer >= 0, got {value!r}")
        self.use_pin_memory = use_pin_memory and torch.cuda.is_available()
        self.use_streams = use_streams and torch.cuda.is_available()
        self.min_offload_bytes, self.max_in_flight = min_offload_bytes, max(1, max_fwd_stash_count)
        self.max_pool, self.keep_last = max_cpu_buffer_pool_count, keep_last_count
        self.offload_host_tensors = offload_host_tensors
        self.stats = CheckpointActivationOffloadStats()
        self._marked: set[tuple] = set()
        self._pending: collections.deque[_Saved] = collections.deque()  # on the device, newest last
        self._in_flight: collections.deque[_Saved] = collections.deque()
        # idle host buffers by (shape, dtype), each with the event after which the copy back has read it (None: no
        # copy in flight)
        self._pool: dict[tuple, list[tuple[torch.Tensor, object]]] = {}
        self._stream = None
        self._patched = None
        self._said_on_host = False

    # -- the context ---------------------------------------------------------------------------------------
    def __enter__(self):
        if self._patched is not None:
            raise RuntimeError("offload_activations: this context is already active (it is not re-entrant)")
        from transformers.modeling_layers import GradientCheckpointingLayer

        had_own = "__call__" in GradientCheckpointingLayer.__dict__
        original = GradientCheckpointingLayer.__call__
        context = self

        def marking_call(layer, *args, **kwargs):
            if args and isinstance(args[0], torch.Tensor) and layer.gradient_checkpointing and layer.training \
                    and torch.is_grad_enabled():
                context._marked.add(_key(args[0]))
            return original(layer, *args, **kwargs)

        GradientCheckpointingLayer.__call__ = marking_call
        self._patched = (GradientCheckpointingLayer, original if had_own else None)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        cls, original = self._patched
        if original is None:
            del cls.__call__
        else:
            cls.__call__ = original
        self._patched = None
        self._keep_pending_on_device()
        self._marked.clear()

    # -- the hooks ------------------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        key = _key(tensor)
        if key not in self._marked or isinstance(tensor, torch.nn.Parameter) or 0 in tensor.stride() or \
                tensor.numel() * tensor.element_size() < self.min_offload_bytes:
            return tensor
        self._marked.discard(key)
        if tensor.device.type == "cpu" and not self.offload_host_tensors:
            self.stats.on_host_already += 1
            if not self._said_on_host:
                self._said_on_host = True
                logger.info("offload_activations: the checkpointed hidden states are in host memory already (no "
                            "accelerator): nothing to offload")
            return tensor
        saved = _Saved(tensor)
        self._pending.append(saved)
        while len(self._pending) > self.keep_last:  # all but the newest keep_last go to the host
            self._offload(self._pending.popleft())
        return saved

    def _unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        if packed.device_tensor is not None:
            if packed in self._pending:
                self._pending.remove(packed)
                self.stats.kept += 1
            return packed.device_tensor
        if packed.event is not None:
            packed.event.synchronize()
        # kept on the saved entry (autograd frees it with the graph), so a second backward over a retained graph
        # finds it too; the host buffer goes back to the pool
        packed.device_tensor = packed.host.to(packed.device, non_blocking=self.use_pin_memory)
        self._give_back(packed)
        self.stats.restored += 1
        return packed.device_tensor

    # -- moving ---------------------------------------------------------------------------------------------
    def _offload(self, saved: _Saved) -> None:
        tensor = saved.device_tensor
        saved.host = self._take(tensor)
        if self.use_streams and tensor.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=tensor.device)
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                saved.host.copy_(tensor, non_blocking=True)
                saved.event = torch.cuda.Event()
                saved.event.record(self._stream)
            tensor.record_stream(self._stream)  # its memory is not reused before the copy has read it
            self._in_flight.append(saved)
            while len(self._in_flight) > self.max_in_flight:
                done = self._in_flight.popleft()
                if done.event is not None:
                    done.event.synchronize()
        else:
            saved.host.copy_(tensor)
        saved.device_tensor = None
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += tensor.numel() * tensor.element_size()

    def _keep_pending_on_device(self) -> None:
        """Forward is over: what is still pending stays on the device until backward."""
        self._pending.clear()

    def _take(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype)
        idle = self._pool.get(key)
        if idle:
            host, copied_back = idle.pop()
            if copied_back is not None:  # (the copy back read it asynchronously: done before it is written again)
                copied_back.synchronize()
            return host
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.use_pin_memory)

    def _give_back(self, saved: _Saved) -> None:
        host, saved.host = saved.host, None
        copied_back = None
        if self.use_pin_memory and saved.device.type == "cuda":
            # the copy back is in flight on the current stream: mark its end rather than wait for it here, in
            # backward, where every restored hidden state would stall the stream
            copied_back = torch.cuda.Event()
            copied_back.record(torch.cuda.current_stream(saved.device))
        idle = self._pool.setdefault((tuple(host.shape), host.dtype), [])
        if sum(len(v) for v in self._pool.values()) < self.max_pool:
            idle.append((host, copied_back))


def _key(t: torch.Tensor) -> tuple:
    """The identity of a tensor's values (a view of the same memory with the same shape counts as itself)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)


def get_checkpoint_hidden_states_offloading_ctx_manager(use_pin_memory: bool = True, use_streams: bool = True,
                                                       min_offload_bytes: int = 1024, max_fwd_stash_count: int = 2,
                                                       max_cpu_buffer_pool_count: int = 64,
                                                       keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """DeepSpeed's constructor of the context (its name and arguments). Without an accelerator the context says,
    at the first hidden state it sees, that there is nothing to offload."""
    return CheckpointHiddenStatesOffload(use_pin_memory, use_streams, min_offload_bytes, max_fwd_stash_count,
                                         max_cpu_buffer_pool_count, keep_last_count)
