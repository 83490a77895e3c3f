"""The training engine: forward, backward, step and the accumulation boundary.

The engine only orchestrates. Where gradients go and how the optimizer steps
is the ZeRO strategy's business (:mod:`zeroengine.zero`); loss scaling is the
scaler's; collectives are :mod:`zeroengine.comm`'s.
"""
from __future__ import annotations

import torch

from zeroengine import comm
from zeroengine.comm.scratch import scratch as comm_scratch
from zeroengine.parallel.mesh import ProcessMesh, data_parallel_mesh
from zeroengine.progress import ProgressMeter, StepTimers, format_progress, get_logger
from zeroengine.zero.grad_stores import engine_backward
from zeroengine.zero.optimizer import StepResult, ZeroOptimizer


def _clipping_line(config) -> str:
    """The effective gradient clipping, and where it comes from when the config does not say."""
    clip = config.gradient_clipping
    if "gradient_clipping" in config.model_fields_set:
        return f"gradient_clipping = {clip}" + (" (off)" if clip == 0 else "")
    return (f"gradient_clipping = {clip} (DeepSpeed 0.19's default; set \"gradient_clipping\": 0 to turn it "
            "off)")


# DeepSpeed engine methods zeroengine does not have, with what to do instead.
_DEEPSPEED_ONLY = {
    "no_sync": "at stages 0 and 1 gradients are reduced only at gradient-accumulation boundaries already, and "
               "at stages 2 and 3 each micro-step's gradients are reduced as they are produced (DeepSpeed refuses "
               "no_sync there too); set gradient_accumulation_steps, or mark the last micro-batch with "
               "set_gradient_accumulation_boundary(True)",
    "set_train_batch_size": "the batch size is fixed by the config; start from a config with the new "
                            "train_batch_size / gradient_accumulation_steps (checkpoints load at any batch size)",
    "offload_states": "offload is configured once, with zero_optimization.offload_optimizer / offload_param",
    "reload_states": "offload is configured once, with zero_optimization.offload_optimizer / offload_param",
    "load_universal_checkpoint": "zeroengine checkpoints load at any world size and stage with load_checkpoint",
}
_PLACEMENT = ("the training dtype comes from the config (fp16 / bf16 sections) and the device from initialize "
              "(the engine's buffers hold the parameters; do not cast or move engine.module after initialize "
              "either)")


class Engine(torch.nn.Module):
    """The model wrapped for ZeRO training; an ``nn.Module`` whose one child is ``module``, as DeepSpeed's
    engine is (so ``engine.named_parameters()`` names them ``module.<name>``, and tools that look for an
    ``nn.Module`` find one). Attributes the engine lacks are looked up on the model, as DeepSpeed does."""

    def __init__(self, module: torch.nn.Module, zero_optimizer: ZeroOptimizer, config, policy, lr_scheduler=None,
                 local_rank: int = 0, mesh: ProcessMesh | None = None):
        super().__init__()
        self.mesh = mesh or data_parallel_mesh()  # data × tensor × pipeline (zeroengine.parallel.mesh)
        self.module = module
        self.optimizer = zero_optimizer
        self.config = config
        self.policy = policy
        self.lr_scheduler = lr_scheduler
        self.device = comm.device_for_backend()  # where inputs should go: cuda:LOCAL_RANK under NCCL, else cpu
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.dp_world_size = self.mesh.dp  # DeepSpeed's name: the ranks ZeRO partitions over
        self.local_rank = local_rank
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.last_step: StepResult | None = None
        self._step_applied = False  # by the latest step() call (False between boundaries, as DeepSpeed)
        self._backward_since_step = False
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary()
        self._meter = ProgressMeter(config.train_batch_size)
        self._timers = StepTimers() if config.wall_clock_breakdown else None
        self._log = get_logger()
        self.monitor = None  # a zeroengine.monitor.StepRecorder, set by initialize() when the config enables one
        self.autoep = None  # what expert_parallel (AutoEP) converted: a zeroengine.moe.autoep.Conversion, or None
        self.autotp = None  # what tensor_parallel (AutoTP) split: a zeroengine.tensor_parallel.autotp.AutoTPResult
        self._destroyed = False
        self._compiled = False
        # the loader initialize(training_data=...) returned: its position is part of every checkpoint
        self.training_dataloader = None
        self._watch_data_resume = False  # until the first forward after a load: see _check_data_resume
        self._background_saves = None  # zeroengine.checkpoint.background.BackgroundSaver, on the first async save
        self.stateful_objects: dict = {}  # register_stateful's: saved per rank with every checkpoint
        if self.global_rank == 0:
            self._log.info(_clipping_line(config))

    # -- the DeepSpeed-style accessors ---------------------------------------
    @property
    def zero_stage(self) -> int:
        return self.config.zero_optimization.stage

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual override: the caller says which micro-step ends the accumulation
        (set it before each forward/backward; the last one True), instead of the micro-step count."""
        self._boundary_override = bool(is_boundary)

    # DeepSpeed's names for what the engine already knows.
    def zero_optimization_stage(self) -> int:
        return self.zero_stage

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last optimizer step; None before the first."""
        return self.last_step.grad_norm if self.last_step is not None else None

    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` updated the parameters: False before the first step, after a
        ``step()`` between accumulation boundaries, and after a step skipped for overflow (as DeepSpeed)."""
        return self._step_applied

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Each param group's momentum: Adam's ``betas``, else SGD's / RMSprop's ``momentum`` (as DeepSpeed)."""
        return [g["betas"] if "betas" in g else g.get("momentum", 0.0) for g in self.optimizer.param_groups]

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails: nn.Module's own (the child ``module``), then the model's
        # attributes (as DeepSpeed's engine), then a reason instead of a bare AttributeError.
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if name.startswith("__") or name == "module":
            raise AttributeError(name)
        if name in _DEEPSPEED_ONLY:
            raise AttributeError(f"Engine.{name}() (DeepSpeed's) is not supported: {_DEEPSPEED_ONLY[name]}")
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None:
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'Engine' object has no attribute {name!r}")

    # -- casts and moves: the config's dtype and initialize's device are fixed --------------------------
    def to(self, *args, **kwargs) -> "Engine":
        """Accepted only as a no-op (to the device and dtype the engine already trains in): Lightning and
        accelerate move the wrapped model to its device as they would any module."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if (device is not None and torch.device(device).type != self.device.type) or (
                dtype is not None and dtype != self.policy.param_dtype):
            raise RuntimeError(f"Engine.to({', '.join(map(str, args))}) is not supported: {_PLACEMENT}")
        return self

    def _refuse_cast(self, *args, **kwargs):
        raise RuntimeError(f"casting the engine (Engine.half(), .float(), .cuda(), ...) is not supported: {_PLACEMENT}")

    half = float = double = bfloat16 = cuda = cpu = type = _refuse_cast

    # -- torch.compile (zeroengine.compilation) --------------------------------
    def compile(self, backend="inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """Compile the model block by block with ``torch.compile(backend=backend, **compile_kwargs)`` (DeepSpeed's
        signature), at any ZeRO stage; ZeRO's hooks stay outside the compiled regions (stage 3 then gathers
        each block's parameters at once, as FSDP2 does). Every rank calls it, between steps. A second call
        does nothing (as DeepSpeed: it warns)."""
        from zeroengine import compilation

        self._refuse_if_destroyed("compile")
        compilation.check_supported(schedule, compiled_autograd_enabled)
        if self._compiled:
            self._log.warning("engine.compile(): the model is already compiled; nothing to do")
            return
        targets = compilation.compile_targets(self.module, self.zero_stage)
        if self.zero_stage == 3:  # (at stage 3 the targets are blocks or the model's children, never the model)
            self.optimizer.hooks.fetch_whole(targets)
        for target in targets:
            compilation.compile_forward(target, backend, dict(compile_kwargs or {}))
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` ran (DeepSpeed's property)."""
        return self._compiled

    # nn.Module methods that would act on the engine behind its buffers' back: refused, with the way that works.

    def load_state_dict(self, *args, **kwargs):
        raise RuntimeError("engine.load_state_dict() is not supported: the optimizer's master copies would keep the "
                           "old values; use engine.load_checkpoint(), or load inside "
                           "`with zeroengine.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):` "
                           "with engine.module.load_state_dict(...) on rank 0")

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    # -- the loop -------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._refuse_if_destroyed("forward")
        if self._watch_data_resume:
            self._check_data_resume()
        self._time("forward", start=True)
        args = tuple(self.policy.cast_input(a) for a in args)
        kwargs = {k: self.policy.cast_input(v) for k, v in kwargs.items()}
        out = self.module(*args, **kwargs)
        self._time("forward", start=False)
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps`` (times the loss scale in fp16).

        ``scale_wrt_gas=False`` (DeepSpeed's flag) backpropagates ``loss`` undivided: for a caller that
        already divided it by the accumulation steps (Hugging Face's Trainer does, then passes False).
        The loss is returned as given either way.

        Gradients are then reduced across ranks as the ZeRO stage requires
        (stages 0 and 1: only at the accumulation boundary; stage 2: every
        micro-step, into this rank's gradient shard).
        """
        self._refuse_if_destroyed("backward")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError("engine.backward expects a scalar loss tensor (reduce it with .mean() or .sum() first)")
        self._time("backward", start=True)
        self._meter.add_loss(loss, for_step=self.monitor is not None)  # stays on the device until printed
        scaled = loss.float() / self.gradient_accumulation_steps() if scale_wrt_gas else loss.float()
        if self.optimizer.loss_scaler is not None:
            scaled = scaled * self.optimizer.loss_scale
        boundary = self.is_gradient_accumulation_boundary()
        try:
            self.optimizer.begin_backward(boundary)
            self._backward_since_step = True
            with engine_backward():  # (other engines' stages 2-3 keep stray gradients meanwhile, as torch does)
                scaled.backward(retain_graph=retain_graph)
        except BaseException:
            self.optimizer.cancel_backward()
            raise
        try:
            self.optimizer.finish_backward(boundary)
        except BaseException:
            # Nothing this pass reduced can be trusted (stage 3: ranks ran different modules): no step uses it.
            self.optimizer.zero_grad()
            self._backward_since_step = False
            raise
        self._time("backward", start=False)
        return loss

    def step(self, lr_kwargs=None) -> None:
        """Step the optimizer, but only at a gradient-accumulation boundary.

        ``lr_kwargs`` (DeepSpeed's) is passed to the scheduler's ``step`` when given."""
        self._refuse_if_destroyed("step")
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            if not self._backward_since_step:
                # Stages 1-3 would step their zero gradient chunks (Adam's moments and weight decay still move
                # the weights) where stage 0 steps nothing: refuse, as DeepSpeed's stages 1-3 do (with a TypeError).
                raise RuntimeError("engine.step() at an accumulation boundary with no engine.backward() since the "
                                   "last optimizer step: there are no gradients to step with (call "
                                   "engine.backward(loss), not loss.backward())")
            self._backward_since_step = False
            self._take_optimizer_step(lr_kwargs)
        self.micro_steps += 1

    def _take_optimizer_step(self, lr_kwargs=None) -> None:
        """The optimizer step of an accumulation boundary, and what follows it (scheduler, counters, reports)."""
        self._time("step", start=True)
        lr = self.get_lr()[0]  # the rate this step applies, for the monitors (the scheduler moves it below)
        result = self.optimizer.step()
        self._after_optimizer_step(result)
        self.last_step = result
        self._step_applied = result.applied
        if result.applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
            if self.global_rank == 0:
                scaled = self.optimizer.loss_scaler is not None
                self._log.info(
                    f"step {self.global_steps + 1}: "
                    + (f"fp16 gradient overflow, step skipped; loss scale {result.loss_scale:g} -> "
                       f"{self.optimizer.loss_scale:g}" if scaled else
                       "non-finite gradients, step skipped (bf16.check_grad_overflow)"))
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._meter.add_step()
        self._time("step", start=False)
        self._monitor_step(lr, result)
        if self.config.steps_per_print and self.global_steps % self.config.steps_per_print == 0:
            self._report_progress()

    def _after_optimizer_step(self, result: StepResult) -> None:
        """What a subclass does once the optimizer stepped (the pipeline engine refreshes tied weights' copies)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad()

    def destroy(self) -> None:
        """Release what the engine holds on the model (DeepSpeed's ``destroy``; accelerate's ``free_memory``
        calls it): work still in flight is drained, the gradient and stage-3 hooks come off the parameters
        and modules, and the monitor's files are closed. The engine refuses further use; at stage 3 the
        parameters stay partitioned (take full values with ``GatheredParameters`` first if you need them)."""
        if self._destroyed:
            return
        self.wait_for_checkpoint()
        self.optimizer.zero_grad()
        self.optimizer.remove_hooks()
        if self.monitor is not None:
            self.monitor.close()
        self._destroyed = True

    def _refuse_if_destroyed(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"engine.{what}() after engine.destroy(): build a new engine with initialize()")

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held by this rank: by kind (params, grads, ...) and by place (cpu, device)."""
        tally = self.optimizer.memory_tally()
        tally.add("buffers", comm_scratch.tensors())  # gloo's collective temporaries, kept for reuse
        if self._background_saves is not None:  # async_save's host snapshot, kept for the next save
            tally.add("buffers", self._background_saves.buffers.tensors())
        return tally.as_dict()

    # -- checkpoints (zeroengine.checkpoint) ----------------------------------
    def save_checkpoint(self, save_dir: str, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, async_save: bool | None = None) -> str:
        """Save everything needed to resume (collective: every rank calls it). Returns the tag directory.

        ``exclude_frozen_parameters`` leaves out parameters that do not require grad (a frozen base model
        under adapters); load such a checkpoint with ``load_module_strict=False``.

        ``async_save`` (default: the config's ``checkpoint.async_save``): snapshot the state to host memory and
        write it in the background while training goes on; the tag directory is there (and ``latest`` names it)
        once every rank's files are on disk. A save in flight is waited for by the next save, a load,
        :meth:`wait_for_checkpoint` and :meth:`destroy` (zeroengine.checkpoint.background)."""
        from zeroengine.checkpoint.save import prepare_save, write_and_commit

        self.wait_for_checkpoint()
        if async_save is None:
            async_save = self.config.checkpoint.async_save
        try:
            try:
                job = prepare_save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
            finally:  # the payload holds what it needs: NVMe-offloaded state leaves host memory again
                self.optimizer.release_checkpoint_pieces()
            if not async_save:
                return write_and_commit(job)
            if self._background_saves is None:
                from zeroengine.checkpoint.background import BackgroundSaver

                self._background_saves = BackgroundSaver()
            return self._background_saves.start(job)
        finally:
            self._restart_monitor_window()

    def register_stateful(self, name: str, obj) -> None:
        """Save ``obj.state_dict()`` (this rank's) with every checkpoint, and load it back into ``obj`` in
        ``load_checkpoint``: the script's own stateful data loader (torchdata's ``StatefulDataLoader``), sampler
        or reader. Restored at the world size of the save only (zeroengine.checkpoint.stateful)."""
        from zeroengine.checkpoint.stateful import is_stateful

        if not isinstance(name, str) or not name:
            raise TypeError(f"register_stateful: name must be a non-empty str, got {name!r}")
        if not is_stateful(obj):
            raise TypeError(f"register_stateful({name!r}, ...): a {type(obj).__name__} has no state_dict() and "
                            "load_state_dict() methods")
        self.stateful_objects[name] = obj

    def wait_for_checkpoint(self) -> None:
        """Wait until the asynchronous save in flight (if any) is committed; raise its error if it failed."""
        if self._background_saves is not None:
            self._background_saves.wait()

    def load_checkpoint(self, load_dir: str, tag=None, *, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        load_module_strict: bool = True, custom_load_fn=None):
        """Resume from ``load_dir`` (any world size, any stage). Returns ``(tag_dir, client_state)``.

        Everything after ``tag`` is keyword-only: DeepSpeed's positional order puts ``load_module_strict``
        third, so a positional call written for it would silently mean other flags here.

        ``load_module_strict`` as in DeepSpeed (``load_state_dict``'s ``strict``): with False, parameters
        and buffers the checkpoint lacks keep this model's values (a trainable one starts with a fresh
        optimizer state) and stored ones this model lacks are skipped; for checkpoints saved with
        ``exclude_frozen_parameters=True``.

        ``custom_load_fn`` (DeepSpeed's) loads the model's weights instead of ``load_state_dict``: it is called
        on every rank as ``custom_load_fn(src=state_dict, dst=engine.module)``, ``state_dict`` being the full
        model's, consolidated from the checkpoint (fp32 parameters, buffers as saved), with every parameter
        whole meanwhile (at stage 3 gathered); what it writes into ``dst`` on rank 0 becomes every rank's
        weights and the optimizer's masters (the 16-bit values in 16-bit training, as DeepSpeed's masters are
        rebuilt from its 16-bit weights). Optimizer and scheduler states and ``client_state`` load as without it
        (the optimizer state of parameters whose names are not in the checkpoint starts fresh);
        ``load_module_strict`` does not apply."""
        from zeroengine.checkpoint import get_fp32_state_dict_from_zero_checkpoint, load_checkpoint

        self.wait_for_checkpoint()  # a save in flight may be the one to load
        self.optimizer.discard_delayed_update()  # the load writes masters, optimizer state and weights alike
        try:
            loaded = load_checkpoint(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                     load_lr_scheduler_states=load_lr_scheduler_states,
                                     load_module_only=load_module_only,
                                     strict=load_module_strict and custom_load_fn is None,
                                     report_unmatched=custom_load_fn is None)
            self._watch_data_resume = loaded[0] is not None and self.training_dataloader is not None
            if custom_load_fn is not None and loaded[0] is not None:
                self._load_with(custom_load_fn, get_fp32_state_dict_from_zero_checkpoint(loaded[0]))
            return loaded
        finally:
            # NVMe-offloaded state the load brought into host memory goes back (a no-op after a full load,
            # which already wrote it; after a failed one, whatever is in memory is what the model now has)
            self.optimizer.release_checkpoint_pieces(modified=True)
            self._restart_monitor_window()

    def _check_data_resume(self) -> None:
        """At the first forward after a load: warn (once, rank 0) when the script seems to skip, itself, the
        batches the resumed loader skipped already (zeroengine.data.TrainingDataLoader.skipped_twice_warning)."""
        self._watch_data_resume = False
        warning = getattr(self.training_dataloader, "skipped_twice_warning", lambda _: None)(
            self.gradient_accumulation_steps())
        if warning and self.global_rank == 0:
            self._log.warning(warning)

    def _load_with(self, custom_load_fn, state_dict: dict) -> None:
        """``custom_load_fn(src=state_dict, dst=self.module)`` with the parameters whole; rank 0's result is kept
        by every rank, and the optimizer's values of each parameter follow it."""
        from zeroengine.zero import GatheredParameters

        with GatheredParameters(list(self.module.parameters()), modifier_rank=0):
            custom_load_fn(src=state_dict, dst=self.module)
            with torch.no_grad():  # (stages 1-3 take the masters from the edited weights on leaving the block too)
                for piece in self.optimizer.checkpoint_pieces():
                    flat = piece.param.detach().reshape(-1)
                    if piece.value.data_ptr() != flat.data_ptr():
                        piece.value.copy_(flat[piece.start:piece.end].view_as(piece.value))
                self.optimizer.release_checkpoint_pieces(modified=True)
        if self.global_rank == 0:
            self._log.info("load_checkpoint: custom_load_fn loaded the model's weights (from the checkpoint's "
                           "consolidated state_dict, in place of the load by name)")

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The full model in its training dtype, as one plain state_dict on rank 0 (collective).

        At stage 3 this needs ``stage3_gather_16bit_weights_on_model_save``, as in DeepSpeed: the
        gather costs a full copy of the model on every rank. Returns False (and says why) when off.
        ``exclude_frozen_parameters`` leaves out parameters that do not require grad (a frozen base model
        under adapters: the file holds the adapters and the buffers).
        """
        from zeroengine.checkpoint.model_file import save_16bit_model

        try:
            return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)
        finally:
            self._restart_monitor_window()

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether stage 3 gathers the full weights to save them (``stage3_gather_16bit_weights_on_model_save``);
        Hugging Face's ``save_model`` asks before calling :meth:`_zero3_consolidated_16bit_state_dict`."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The full model's state_dict in its training dtype on rank 0, None on the others (collective; DeepSpeed's
        name, which accelerate and Hugging Face call). Parameters are gathered one module at a time."""
        from zeroengine.checkpoint.model_file import gathered_state_dict

        if self.zero_stage != 3:
            raise ValueError("_zero3_consolidated_16bit_state_dict needs ZeRO stage 3 (at stages 0-2 every rank "
                             "holds the full weights: use engine.module.state_dict())")
        self.optimizer.land_delayed_update()
        return gathered_state_dict(self.module, exclude_frozen=exclude_frozen_parameters)

    def _restart_monitor_window(self) -> None:
        if self.monitor is not None:  # a checkpoint's collectives and I/O are not the next step's
            self.monitor.restart_window()

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    # -- internals ------------------------------------------------------------
    def _time(self, name: str, start: bool) -> None:
        if self._timers is not None:
            (self._timers.start if start else self._timers.stop)(name)

    def _monitor_step(self, lr: float, result: StepResult) -> None:
        # Every rank calls in (the monitors' loss average is a collective); only rank 0 writes.
        if self.monitor is not None:
            self.monitor.record_step(self, self._meter.take_step_loss(), lr, result)

    def _report_progress(self) -> None:
        # Every rank takes part in the loss average (one tiny collective per print).
        local_loss, rate = self._meter.close_window()
        total = comm.all_reduce_value(local_loss.to(comm.device_for_backend(), torch.float64))
        loss = float(total) / self.world_size  # the print's one host read
        if self.global_rank != 0:
            return
        fp16 = self.optimizer.loss_scaler is not None
        line = format_progress(self.global_steps, loss, self.get_lr()[0], rate, self.memory_breakdown(),
                               loss_scale=self.optimizer.loss_scale if fp16 else None, skipped=self.skipped_steps)
        if self._timers is not None:
            line += " | " + self._timers.report_and_reset()
        self._log.info(line)
