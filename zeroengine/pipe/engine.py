"""The pipeline engine: ``train_batch`` runs one optimizer step's micro-batches through the stages.

One call is one step of ``gradient_accumulation_steps`` micro-batches (DeepSpeed's rule: the micro-batches
of a step are what fills the pipeline). The first and the last stage each read every micro-batch from the
data iterator, ``(inputs, labels)``: the first feeds ``inputs`` to its layers, the last gives its output and
``labels`` to ``loss_fn``. In between, stages exchange activations forward and their gradients backward
(:mod:`.link`) in the configured schedule's order (:mod:`.schedule`). Gradients accumulate over the
micro-batches. Until the last backward a stage only exchanges point-to-point messages; then every rank
agrees the schedule succeeded everywhere (a stage that failed stops the others, named, instead of leaving
them waiting: :meth:`PipelineEngine._agreed_schedule`), and only then do the collectives run: the tied
weights' gradients meet at their owner, the ZeRO stage reduces over the data-parallel group, and the step
runs as ``engine.step()`` would, its gradient norm summed over every stage.

With virtual stages (``PipelineModule(virtual_stages=v)``) each stage runs v model chunks; a micro-batch goes
round the ranks v times (the last stage's chunk c feeds the first stage's chunk c + 1), in the interleaved
schedule's order. The first stage's chunk 0 reads the inputs and the last stage's last chunk the labels.
"""
from __future__ import annotations

import time

import torch

from zeroengine import comm
from zeroengine.comm.outcome import FAILED, OK, STOPPED
from zeroengine.data import RepeatingLoader
from zeroengine.engine import Engine
from zeroengine.zero.grad_stores import engine_backward

from .link import ABORT, END, PeerAborted, StageLink, as_tuple, needs_grad
from .schedule import schedule_for

_ONLY_BATCHES = ("engine.{}() is not available for a PipelineModule: its layers are spread over the pipeline "
                 "stages, so a step is one engine.train_batch(data_iter) (forward, backward and step of every "
                 "micro-batch), and evaluation engine.eval_batch(data_iter) (DeepSpeed's PipelineEngine rule)")


class PipelineError(RuntimeError):
    """A pipeline step stopped on this rank because another rank's part of it failed (named in the message)."""


class PipelineEngine(Engine):
    def __init__(self, *args, schedule: str = "1f1b", **kwargs):
        super().__init__(*args, **kwargs)
        mesh = self.mesh
        self.schedule = schedule
        self.stage_id, self.num_stages = mesh.pp_rank, mesh.pp
        self.chunks = self.module.virtual_stages
        self.link = StageLink(self.module.channels, self.device)
        self.data_iterator = None
        self.training_dataloader = None
        # What the last train_batch held and took: the most micro-batches with activations alive at once; (when
        # measure_activations is set) the most activation bytes autograd saved for backward at once; the
        # seconds its forward and backward passes took in all (schedule_s, before the optimizer step), and
        # of them the seconds spent blocked in receives (recv_wait_s: the bubble, plus transfer time).
        self.measure_activations = False
        self.pipe_stats = {"max_in_flight": 0, "peak_saved_bytes": 0, "schedule_s": 0.0, "recv_wait_s": 0.0}

    # -- DeepSpeed's pipeline accessors ---------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    @property
    def micro_batches(self) -> int:
        return self.gradient_accumulation_steps()

    def set_dataiterator(self, iterator) -> None:
        self.data_iterator = iterator

    # -- the per-micro-batch API is not this engine's ---------------------------------------------------
    def forward(self, *args, **kwargs):
        raise RuntimeError(_ONLY_BATCHES.format("forward"))

    def backward(self, *args, **kwargs):
        raise RuntimeError(_ONLY_BATCHES.format("backward"))

    def step(self, *args, **kwargs):
        raise RuntimeError(_ONLY_BATCHES.format("step"))

    # -- a step -----------------------------------------------------------------------------------------
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Forward, backward and step of one batch (``gradient_accumulation_steps`` micro-batches); returns the
        mean loss over its micro-batches and data-parallel replicas, on every stage (collective)."""
        self._refuse_if_destroyed("train_batch")
        self.module.train()
        start = time.perf_counter()
        self.link.wait_s = 0.0

        def schedule():
            order = schedule_for(self.schedule, self.stage_id, self.num_stages, self.micro_batches, self.chunks)
            run = _MicroBatches(self, self._iterator(data_iter), train=True)
            with _SavedBytes(self.measure_activations, self.module) as saved:
                for op, chunk, i in order:
                    if op == "F":
                        run.forward(chunk, i)
                    else:
                        run.backward(chunk, i)
            return run, saved

        try:
            run, saved = self._agreed_schedule(schedule, "train_batch")
            self._reduce_accumulated_grads()
        except BaseException:  # the failed step's gradients go; the next starts from none
            self.optimizer.zero_grad()
            self.module.tied.drop_copy_grads()
            raise
        self.pipe_stats = {"max_in_flight": run.peak_in_flight, "peak_saved_bytes": saved.peak,
                           "schedule_s": time.perf_counter() - start, "recv_wait_s": self.link.wait_s}
        loss = self._agreed_loss(run.losses)
        self._meter.add_loss(loss, for_step=self.monitor is not None)
        self.micro_steps += self.micro_batches
        self._step_applied = False
        self._take_optimizer_step()
        return loss

    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", num_micro_batches: int | None = None):
        """Forward only, over ``num_micro_batches`` (default: gradient_accumulation_steps) micro-batches; returns
        their mean loss on every stage (``reduce_output=None``: each micro-batch's, averaged over replicas), and
        with ``return_logits`` also the last stage's outputs (None on the others)."""
        self._refuse_if_destroyed("eval_batch")
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got {reduce_output!r}")
        was_training = self.module.training
        self.module.eval()
        count = num_micro_batches or self.micro_batches

        def forwards():
            run = _MicroBatches(self, self._iterator(data_iter), train=False, compute_loss=compute_loss)
            for i in range(count):
                for chunk in range(self.chunks):  # (messages between two ranks keep this order on both)
                    run.forward(chunk, i)
            return run

        try:
            run = self._agreed_schedule(forwards, "eval_batch")
        finally:
            self.module.train(was_training)
        logits = run.outputs if return_logits and self.is_last_stage() else None
        if not compute_loss:
            return logits if return_logits else None
        if reduce_output is None:  # each micro-batch's (collective: every stage takes part in each)
            result = [self._agreed_loss(run.losses[i:i + 1]) for i in range(count)]
        else:
            result = self._agreed_loss(run.losses)
        return (result, logits) if return_logits else result

    def _agreed_schedule(self, schedule, what: str):
        """Run ``schedule()`` (this stage's passes: point-to-point messages only), then agree with every rank how
        it ended, before any collective. A stage that raises sends an abort to its neighbours (which may be
        waiting for its messages: they stop too, and pass the abort on), and every rank raises after the
        agreement, naming the rank that failed; the channels are then drained, so the next step starts clean.
        The failing rank raises its own error; the others a :class:`PipelineError`."""
        error = None
        try:
            result = schedule()
        except Exception as exc:  # (not KeyboardInterrupt & co: the process is going away)
            error = exc
            self.link.terminate(ABORT)  # before agreeing: a neighbour may be waiting for our next message
        if error is None:
            status = OK
        else:
            status = STOPPED if isinstance(error, PeerAborted) else FAILED
        message = f"pipeline stage {self.stage_id}: {type(error).__name__}: {error}" if error is not None else ""
        failures = comm.agree_outcome(status, message)
        if failures:
            self.link.terminate(END)
            self.link.drain()
        self.link.finish()
        if error is None and not failures:
            return result
        if status == FAILED or not failures:
            raise error
        first = failures[0]
        raise PipelineError(f"{what} stopped on rank {comm.get_rank()}: rank {first.rank} failed at {first.message}"
                            + (f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else "")) from error

    def _reduce_accumulated_grads(self) -> None:
        """The accumulation boundary, once every rank's schedule succeeded: the tied weights' gradients meet at
        their owner, then the ZeRO stage reduces over the data-parallel group (stages 0-1 reduce only after
        the boundary's backward, so running it after the last backward changes nothing but the timing)."""
        optimizer = self.optimizer
        optimizer.begin_backward(True)
        try:
            self.module.tied.reduce_grads()
        except BaseException:
            optimizer.cancel_backward()
            raise
        optimizer.finish_backward(True)
        self._backward_since_step = False

    def _iterator(self, data_iter):
        if data_iter is not None:
            return data_iter
        if self.data_iterator is None and self.training_dataloader is not None:
            self.data_iterator = iter(RepeatingLoader(self.training_dataloader))
        if self.data_iterator is None and (self.is_first_stage() or self.is_last_stage()):
            raise ValueError("train_batch/eval_batch: give data_iter (an iterator of (inputs, labels) micro-batches), "
                             "or pass training_data to zeroengine.initialize")
        return self.data_iterator

    def _agreed_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses over data-parallel replicas, sent to every stage."""
        mesh = self.mesh
        if self.is_last_stage():
            mean = torch.stack([loss.detach().float() for loss in losses]).mean().to(self.device)
        else:
            mean = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage() and mesh.dp > 1:
            mean = comm.all_reduce_value(mean, group=mesh.dp_group) / mesh.dp
        if self.num_stages > 1:
            mean = mean.reshape(1).clone()
            comm.broadcast(mean, src=mesh.stage_rank(self.num_stages - 1), group=mesh.pp_group)
            mean = mean[0]
        return mean

    def _after_optimizer_step(self, result) -> None:
        if result.applied:
            self.module.tied.sync()  # the owners stepped; the other stages' copies take their values


class _MicroBatches:
    """One train_batch's (or eval_batch's) micro-batches on this stage: what each forward left for its backward."""

    def __init__(self, engine: PipelineEngine, data, train: bool, compute_loss: bool = True):
        self.engine, self.data, self.train, self.compute_loss = engine, data, train, compute_loss
        self.inputs: dict[int, object] = {}
        self.outputs_of: dict[int, object] = {}
        self.losses: list[torch.Tensor] = []
        self.outputs: list = []  # eval_batch's last-stage outputs
        self.live = self.peak_in_flight = 0

    def _next_batch(self, i: int):
        try:
            batch = next(self.data)
        except StopIteration:
            raise ValueError(f"the data iterator ran out at micro-batch {i} of the step (a step takes "
                             f"{self.engine.micro_batches} micro-batches): pass an endless iterator, e.g. "
                             "zeroengine.data.RepeatingLoader(loader) (DeepSpeed's deepspeed.utils.RepeatingLoader), "
                             "which restarts the loader with a new epoch each pass") from None
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(f"a pipeline micro-batch must be a pair (inputs, labels), got {type(batch).__name__}"
                             + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
        return batch

    def _to_device(self, x, cast: bool):
        engine = self.engine
        if isinstance(x, (tuple, list)):
            return tuple(self._to_device(t, cast) for t in x)
        if isinstance(x, torch.Tensor):
            x = x.to(engine.device)
            return engine.policy.cast_input(x) if cast else x
        return x

    def forward(self, chunk: int, i: int) -> None:
        engine = self.engine
        module = engine.module
        first, last = module.is_first_chunk(chunk), module.is_last_chunk(chunk)
        batch = self._next_batch(i) if first or last else None
        if first:
            inputs = self._to_device(batch[0], cast=True)
        else:
            inputs = engine.link.recv_activations()
        outputs = module(inputs, chunk)
        if not last:
            engine.link.send_activations(outputs)
            if self.train:
                self.inputs[chunk, i], self.outputs_of[chunk, i] = inputs, outputs
        else:
            if not self.train:
                self.outputs.append(outputs)
            if self.compute_loss:
                labels = self._to_device(batch[1], cast=False)
                loss = module.loss_fn(outputs, labels) if module.loss_fn is not None else outputs
                if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                    raise ValueError("the last pipeline stage must produce a scalar loss: give PipelineModule a "
                                     "loss_fn(outputs, labels), or make the last layer return the loss")
                self.losses.append(loss)
                if self.train:
                    self.inputs[chunk, i] = inputs
        if self.train:
            self.live += 1
            self.peak_in_flight = max(self.peak_in_flight, self.live)

    def backward(self, chunk: int, i: int) -> None:
        """One micro-batch's backward through this chunk; gradients accumulate (the data-parallel reduction waits
        for the end of the schedule: PipelineEngine._reduce_accumulated_grads)."""
        engine = self.engine
        optimizer = engine.optimizer
        first, last = engine.module.is_first_chunk(chunk), engine.module.is_last_chunk(chunk)
        optimizer.begin_backward(False)
        try:
            with engine_backward():
                if last:
                    scaled = self.losses[i].float() / engine.micro_batches
                    if optimizer.loss_scaler is not None:
                        scaled = scaled * optimizer.loss_scale
                    scaled.backward()
                else:
                    stage_outputs = self.outputs_of.pop((chunk, i))
                    grads = engine.link.recv_grads(stage_outputs)
                    outputs = [t for t in as_tuple(stage_outputs) if needs_grad(t)]
                    if outputs:
                        torch.autograd.backward(outputs, grads)
            inputs = self.inputs.pop((chunk, i))
            if not first:
                engine.link.send_grads(inputs)
            if last:
                self.losses[i] = self.losses[i].detach()  # its graph is spent
        except BaseException:
            optimizer.cancel_backward()
            raise
        optimizer.finish_backward(False)
        engine._backward_since_step = False
        self.live -= 1


class _SavedBytes:
    """With ``enabled``: the most activation bytes autograd held saved for backward at once (pack/unpack hooks;
    the parameters it saves, e.g. a linear layer's weight, are not activations and not counted)."""

    def __init__(self, enabled: bool, module: torch.nn.Module):
        self.enabled, self.live, self.peak = enabled, 0, 0
        self._hooks = None
        self._param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()} if enabled else set()

    def __enter__(self):
        if self.enabled:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self._hooks is not None:
            self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self._param_storages:
            return _Counted(t, 0, self)
        size = t.numel() * t.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        return _Counted(t, size, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor


class _Counted:
    """A saved tensor, counted until autograd frees it."""

    __slots__ = ("tensor", "size", "owner")

    def __init__(self, tensor, size, owner):
        self.tensor, self.size, self.owner = tensor, size, owner

    def __del__(self):
        self.owner.live -= self.size
