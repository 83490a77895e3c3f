"""Moving a stage's activations forward and their gradients back, between neighbouring pipeline stages.

Each message of activations is a small header (how many tensors; each one's dtype, shape and whether it
needs a gradient) and then the tensors, so stages may pass tuples whose shapes change between micro-batches
(the last, shorter batch of an epoch). Gradients travel back without a header: the stage receiving them
knows the shapes, they are its own outputs. Sends are asynchronous (see :mod:`zeroengine.comm.collectives`'
point-to-point note); their handles are waited on at the end of the step.
"""
from __future__ import annotations

import time

import torch

from zeroengine import comm

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
HEADER_SLOTS = 64


def as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def needs_grad(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.requires_grad


class StageLink:
    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device, grad_group=None):
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self.grad_group = grad_group  # gradients travel in a group of their own (the default group when None)
        self.sends: list = []  # handles of sends in flight, and the tensors they read
        self._keep: list = []
        self.wait_s = 0.0  # time spent blocked in receives (the stage idle: the pipeline's bubble, and transfers)

    def send_activations(self, outputs) -> None:
        tensors = as_tuple(outputs)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"pipeline stage output {i} is a {type(t).__name__}: a stage (other than the last) "
                                "must return a tensor or a tuple of tensors, which are sent to the next stage")
        header = [len(tensors)]
        for t in tensors:
            if t.dtype not in _DTYPES:
                raise TypeError(f"pipeline stage output of dtype {t.dtype} cannot be sent (supported: {_DTYPES})")
            header += [_DTYPES.index(t.dtype), int(needs_grad(t)), t.dim(), *t.shape]
        if len(header) > HEADER_SLOTS:
            raise ValueError(f"pipeline stage outputs ({len(tensors)} tensors) describe in more than "
                             f"{HEADER_SLOTS} numbers: pass fewer or lower-dimensional tensors")
        header_tensor = torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        header_tensor[:len(header)] = torch.tensor(header, dtype=torch.int64)
        self._send(header_tensor, self.next_rank)
        for t in tensors:
            self._send(t.detach().contiguous(), self.next_rank)

    def recv_activations(self):
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        self._recv(header, self.prev_rank)
        values = header.tolist()
        count, at, received = values[0], 1, []
        for _ in range(count):
            dtype, grad, ndim = _DTYPES[values[at]], bool(values[at + 1]), values[at + 2]
            shape = values[at + 3:at + 3 + ndim]
            at += 3 + ndim
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._recv(t, self.prev_rank)
            received.append(t.requires_grad_() if grad else t)
        return received[0] if count == 1 else tuple(received)

    def send_grads(self, inputs) -> None:
        """The gradients of the received ``inputs`` that needed one, back to the previous stage."""
        for t in as_tuple(inputs):
            if needs_grad(t):
                self._send(t.grad if t.grad is not None else torch.zeros_like(t), self.prev_rank, self.grad_group)

    def recv_grads(self, outputs) -> list[torch.Tensor]:
        """The next stage's gradients for this stage's ``outputs`` that needed one, in order."""
        grads = []
        for t in as_tuple(outputs):
            if needs_grad(t):
                g = torch.empty_like(t, memory_format=torch.contiguous_format)
                self._recv(g, self.next_rank, self.grad_group)
                grads.append(g)
        return grads

    def _recv(self, tensor: torch.Tensor, src: int, group=None) -> None:
        start = time.perf_counter()
        comm.recv(tensor, src, group=group)
        self.wait_s += time.perf_counter() - start

    def _send(self, tensor: torch.Tensor, dst: int, group=None) -> None:
        self.sends.append(comm.isend(tensor, dst, group=group))
        self._keep.append(tensor)  # alive until its send completes

    def finish(self) -> None:
        """Wait for every send in flight (the end of a step)."""
        comm.wait_all(self.sends)
        self._keep.clear()
