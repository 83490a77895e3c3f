"""Moving a stage's activations forward and their gradients back, between neighbouring pipeline stages.

Every message is a small header and then its tensors. The header says what follows (how many tensors; each
one's dtype, shape and whether it needs a gradient), so stages may pass tuples whose shapes change between
micro-batches (the last, shorter batch of an epoch), and it says whether the sender is still in its step:

* ``DATA``: tensors follow;
* ``ABORT``: the sender's step failed (its own error, or a neighbour's abort it passes on); a stage waiting
  for this message stops its schedule instead of waiting for ever;
* ``END``: the sender finished a step that failed elsewhere; nothing more comes this step.

After a failed step every rank sends one terminal frame (ABORT or END) on each of its outgoing channels and
reads each incoming channel up to its terminal frame (:meth:`StageLink.drain`), so no message of the failed
step is left for the next step to misread, and every send completes. Gradients carry a header too (one more
small message per backward): a stage waiting for a gradient must be able to read an abort in its place.

Sends are asynchronous (see :mod:`zeroengine.comm.collectives`' point-to-point note); their handles are
waited on at the end of the step. Each kind of message travels in its own channel (:mod:`.channels`).
"""
from __future__ import annotations

import time

import torch

from zeroengine import comm

from .channels import Channel, PipeChannels

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
HEADER_SLOTS = 64
DATA, END, ABORT = 0, 1, 2


def as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def needs_grad(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.requires_grad


class PeerAborted(RuntimeError):
    """A neighbouring stage's step failed (it, or a stage beyond it): this stage's schedule cannot go on."""

    def __init__(self, peer: int, kind: str):
        super().__init__(f"the pipeline neighbour at rank {peer} stopped its step (its {kind} message was an abort)")
        self.peer = peer


class StageLink:
    def __init__(self, channels: PipeChannels, device: torch.device):
        self.channels, self.device = channels, device
        self.sends: list = []  # handles of sends in flight, and the tensors they read
        self._keep: list = []
        self.wait_s = 0.0  # time spent blocked in receives (the stage idle: the pipeline's bubble, and transfers)
        self._terminated_out: set[str] = set()  # kinds whose outgoing terminal frame was sent this step
        self._terminated_in: set[str] = set()  # kinds whose incoming terminal frame was read this step

    # -- the messages of a schedule ---------------------------------------------------------------------
    def send_activations(self, outputs) -> None:
        tensors = as_tuple(outputs)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"pipeline stage output {i} is a {type(t).__name__}: a stage (other than the last) "
                                "must return a tensor or a tuple of tensors, which are sent to the next stage")
        self._send_message(self.channels.activations_out, [t.detach() for t in tensors],
                           [needs_grad(t) for t in tensors])

    def recv_activations(self):
        received = self._recv_message(self.channels.activations_in)
        return received[0] if len(received) == 1 else tuple(received)

    def send_grads(self, inputs) -> None:
        """The gradients of the received ``inputs`` that needed one, back to the previous stage (one message,
        empty when none needed one)."""
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in as_tuple(inputs) if needs_grad(t)]
        self._send_message(self.channels.gradients_out, grads, [False] * len(grads))

    def recv_grads(self, outputs) -> list[torch.Tensor]:
        """The next stage's gradients for this stage's ``outputs`` that needed one, in order."""
        expected = [t for t in as_tuple(outputs) if needs_grad(t)]
        grads = self._recv_message(self.channels.gradients_in)
        shapes = [tuple(g.shape) for g in grads]
        if shapes != [tuple(t.shape) for t in expected]:
            raise RuntimeError(f"pipeline: the next stage sent gradients of shapes {shapes} for outputs of shapes "
                               f"{[tuple(t.shape) for t in expected]}")
        return grads

    # -- the end of a step ------------------------------------------------------------------------------
    def terminate(self, status: int) -> None:
        """Send ``status`` (ABORT or END) on every outgoing channel that has not had its terminal frame."""
        for channel in (self.channels.activations_out, self.channels.gradients_out):
            if channel is not None and channel.kind not in self._terminated_out:
                self._terminated_out.add(channel.kind)
                self._send(_header([], [], status).to(self.device), channel)

    def drain(self) -> None:
        """Read every incoming channel up to its terminal frame, dropping what the failed step left in it."""
        for channel in (self.channels.activations_in, self.channels.gradients_in):
            while channel is not None and channel.kind not in self._terminated_in:
                try:
                    self._recv_message(channel)
                except PeerAborted:
                    pass

    def finish(self) -> None:
        """Wait for every send in flight (the end of a step), and open the channels for the next step."""
        comm.wait_all(self.sends)
        self._keep.clear()
        self._terminated_out.clear()
        self._terminated_in.clear()

    # -- framing ----------------------------------------------------------------------------------------
    def _send_message(self, channel: Channel, tensors: list[torch.Tensor], grad_flags: list[bool]) -> None:
        self._send(_header(tensors, grad_flags, DATA).to(self.device), channel)
        for t in tensors:
            self._send(t.contiguous(), channel)

    def _recv_message(self, channel: Channel) -> list[torch.Tensor]:
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        self._recv(header, channel)
        values = header.tolist()
        status, count, at, received = values[0], values[1], 2, []
        if status != DATA:
            self._terminated_in.add(channel.kind)
            raise PeerAborted(channel.peer, channel.kind)
        for _ in range(count):
            dtype, grad, ndim = _DTYPES[values[at]], bool(values[at + 1]), values[at + 2]
            shape = values[at + 3:at + 3 + ndim]
            at += 3 + ndim
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._recv(t, channel)
            received.append(t.requires_grad_() if grad else t)
        return received

    def _recv(self, tensor: torch.Tensor, channel: Channel) -> None:
        start = time.perf_counter()
        comm.recv(tensor, channel.peer, group=channel.group)
        self.wait_s += time.perf_counter() - start

    def _send(self, tensor: torch.Tensor, channel: Channel) -> None:
        self.sends.append(comm.isend(tensor, channel.peer, group=channel.group))
        self._keep.append(tensor)  # alive until its send completes


def _header(tensors: list[torch.Tensor], grad_flags: list[bool], status: int) -> torch.Tensor:
    values = [status, len(tensors)]
    for t, grad in zip(tensors, grad_flags):
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline stage output of dtype {t.dtype} cannot be sent (supported: {_DTYPES})")
        values += [_DTYPES.index(t.dtype), int(grad), t.dim(), *t.shape]
    if len(values) > HEADER_SLOTS:
        raise ValueError(f"pipeline stage outputs ({len(tensors)} tensors) describe in more than "
                         f"{HEADER_SLOTS} numbers: pass fewer or lower-dimensional tensors")
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    header[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return header
