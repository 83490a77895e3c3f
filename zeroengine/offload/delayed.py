"""ZeRO-Offload's delayed parameter update (DPU): the CPU optimizer step overlaps the next step's compute.

Without it, an offloaded step keeps the accelerator idle while the CPU Adam
runs (:mod:`zeroengine.offload.step` only overlaps the copies). With
``offload_optimizer.delayed_update`` (Note: one-step delayed update):

* at step t, every offloaded bucket's gradient chunk is copied into a host
  copy of this rank's gradient shard (the device buffers are reused by the
  next backward), then a background thread unscales, clips and steps the
  buckets, updating the fp32 masters and optimizer state;
* the model's parameters keep their values: step t+1's forward and backward
  run on them while the thread works;
* at step t+1, before anything else reads the masters, the thread is joined
  and its result written into the model (:meth:`ShardedOptimizer.land_delayed_update`),
  then step t+1's update starts the same way.

So update t+1 uses gradients computed one update earlier: w_{t+1} = w_t -
lr * adam(g(w_{t-1})). The math of each update (unscale, clip, Adam, in that
order and precision) is the undelayed step's; only which gradient it sees
changes, which is why the mode is opt-in and its effect on convergence is
measured (benchmarks/bench_delayed_update.py).

Why a thread works: the C++ CPU Adam releases the GIL (ops/csrc/adam/cpu_adam.cpp),
so Python's main thread goes on issuing the next step's kernels. The thread
steps a snapshot of the param groups taken when it starts (an LR scheduler
moves the live ones right after the step), restricted to one bucket's pieces
at a time, so nothing else the optimizer holds is stepped or read twice. It
calls the optimizer class's own ``step`` on a shallow copy of the optimizer:
torch's LR schedulers wrap ``optimizer.step`` per instance, and that wrapper
would step the real optimizer's live groups. Background steps of several
parts (MoE domains) share one optimizer and run one at a time (``_ONE_AT_A_TIME``).

A failed background step poisons the update: every later attempt to use it
raises, until a checkpoint load replaces masters and state (:meth:`discard`).
Its rank must not raise alone at the landing: its peers would wait in the
landing's all-gather (stage 3: the next forward's gathers) until the comm
timeout, with no word on why. So landing first agrees on every rank's outcome
(:func:`zeroengine.comm.outcome.agree_outcome`: one 8-byte status per rank in
a control all-gather on the host, the error texts only after a failure), and
then every rank raises the same error, naming the failing ranks and their errors.
"""
from __future__ import annotations

import threading

import torch

from zeroengine import comm
from zeroengine.comm.outcome import FAILED, OK, agree_outcome

from .step import pieces_holding, unscale_and_clip

_ONE_AT_A_TIME = threading.Lock()  # background steps of one process (parts sharing one optimizer) in turn


class DelayedUpdateError(RuntimeError):
    """A delayed update's background step failed; ``failed`` maps each failing (global) rank to its error."""

    def __init__(self, failed: dict[int, str]):
        where = "; ".join(f"rank {rank}: {error}" for rank, error in sorted(failed.items()))
        super().__init__(
            f"offload_optimizer.delayed_update: the background optimizer step failed on {where}. Its masters and "
            "optimizer state are partly updated, so no rank writes the update into the model; load a checkpoint "
            "to go on")
        self.failed = failed


def _summary(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())  # one line


class DelayedUpdate:
    """Runs the offloaded buckets' optimizer step in the background, one step at a time.

    ``pieces[b]`` are the optimizer params viewing bucket b's master chunk; ``buckets`` the offloaded
    buckets (layout indices). The caller runs the first ``warmup_steps`` optimizer steps undelayed.
    """

    def __init__(self, optimizer, layout, rank: int, pieces: list[list[torch.nn.Parameter]], buckets: list[int],
                 pin_memory: bool, warmup_steps: int, grad_dtype: torch.dtype = torch.float32):
        self.optimizer = optimizer
        self.layout = layout
        self.rank = rank
        self.pieces = pieces
        self.buckets = sorted(buckets)
        self.warmup_steps = warmup_steps
        pin = pin_memory and torch.cuda.is_available()
        # This rank's whole offloaded gradient shard, in the masters' dtype (fp32, or bf16 for bf16 masters): the
        # thread reads it while the next backward writes the device buffers again.
        self.host_grads = {b: torch.empty(layout.buckets[b].chunk_numel, dtype=grad_dtype, pin_memory=pin)
                           for b in self.buckets}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # this rank's background step's
        self._failed: dict[int, str] = {}  # every failing rank's error, once the ranks have agreed on them
        self._landed = True  # whether the last update's masters have been written into the model
        self._group_of: dict[int, int] | None = None
        self.creating_state = False  # the running step is the first: it adds the optimizer's state entries

    @property
    def pending(self) -> bool:
        """An update whose masters have not reached the model's parameters yet."""
        return not self._landed

    def start(self, device_grads: list[torch.Tensor | None], inv_scale: float, clip_coef) -> None:
        """Copy the offloaded buckets' gradients down and step them in the background. ``clip_coef`` may be a
        device tensor: the thread reads it, so the main thread does not wait for the device."""
        self.wait()
        if not self._landed:
            raise RuntimeError("offload_optimizer.delayed_update: the previous update has not reached the model")
        done = self._copy_down(device_grads)
        groups = self._snapshot_groups()
        self.creating_state = any(not self.optimizer.state.get(p) for b in self.buckets for p in self.pieces[b])
        self._landed = False
        self._thread = threading.Thread(target=self._run, args=(done, groups, inv_scale, clip_coef),
                                        name="zeroengine-delayed-update", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the background step (local: no collective); raise if it failed (then on every call, until
        :meth:`discard`: its masters and state are partly updated and must not reach the model)."""
        self.join()
        if self._error is not None or self._failed:
            raise DelayedUpdateError(self._failed or {comm.get_rank(): _summary(self._error)}) from self._error

    def join(self) -> None:
        """Wait for the background step, never raising: for readers of sizes, not values (a memory row), which
        must not stop one rank alone before the landing tells every rank of a failure."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
            self.creating_state = False

    def discard(self) -> None:
        """Wait, and forget the write-back and any failure: masters, state and weights are about to be replaced
        (a checkpoint load), or the engine is being destroyed."""
        self.join()
        self.creating_state = False
        self._error, self._failed = None, {}
        self._landed = True

    def take_landing(self, group) -> list[int]:
        """Wait, then the buckets whose updated masters must now be written into the model (once). Collective
        over ``group`` while an update is pending: the ranks first learn whether any rank's step failed, and
        then all raise (the update's state is the same on every rank, so all of them call this alike)."""
        self.join()
        if self._landed:
            return []
        if not self._failed:  # once agreed, a failure is raised again without another exchange
            mine = (OK, "") if self._error is None else (FAILED, _summary(self._error))
            self._failed = {f.rank: f.message for f in agree_outcome(*mine, group=group)}
        if self._failed:
            raise DelayedUpdateError(self._failed) from self._error
        self._landed = True
        return self.buckets

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.host_grads.values())

    # -- internals ------------------------------------------------------------
    def _copy_down(self, device_grads):
        """Start copying each offloaded bucket's chunk into its host copy; returns the event the thread waits on
        (None: copied already)."""
        on_device = False
        for b in self.buckets:
            host, grad = self.host_grads[b], device_grads[b]
            if grad is None:  # a bare step() with no backward: zero gradients, as the in-memory path uses
                host.zero_()
            elif grad.device.type != "cuda":
                host.copy_(grad)
            else:
                # Converted on the device and copied on the current stream, one bucket at a time: the converted
                # temporary goes back to the caching allocator at once, which hands its memory only to later
                # work on this stream, ordered after the copy; the next backward's writes wait for it too.
                host.copy_(grad.to(host.dtype), non_blocking=True)
                on_device = True
        if not on_device:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _snapshot_groups(self) -> list[dict]:
        """Each param group's hyperparameters as they are now (the scheduler moves them after this step)."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _bucket_groups(self, b: int, groups: list[dict]) -> list[dict]:
        """Param groups holding only bucket b's pieces, with the snapshot's hyperparameters."""
        if self._group_of is None:  # the pieces were put in their groups after construction
            self._group_of = {id(p): i for i, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        by_group: dict[int, list] = {}
        for piece in self.pieces[b]:
            by_group.setdefault(self._group_of[id(piece)], []).append(piece)
        return [{**groups[i], "params": params} for i, params in sorted(by_group.items())]

    def _run(self, copied, groups, inv_scale: float, clip_coef) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            coef = float(clip_coef)
            cls = type(self.optimizer)
            shadow = object.__new__(cls)  # the same optimizer (state, kernels), stepping other group lists
            shadow.__dict__.update(self.optimizer.__dict__)
            with _ONE_AT_A_TIME, torch.no_grad():
                for b in self.buckets:
                    grad = self.host_grads[b]
                    unscale_and_clip(grad, inv_scale, coef)
                    shadow.param_groups = self._bucket_groups(b, groups)
                    with pieces_holding(self.pieces[b], self.layout.buckets[b].pieces_in_chunk(self.rank), grad):
                        cls.step(shadow)  # the class's: a scheduler's per-instance wrapper steps the real one
        except BaseException as error:  # re-raised on the main thread by wait()
            self._error = error
