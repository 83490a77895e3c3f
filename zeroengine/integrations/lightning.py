"""PyTorch Lightning on zeroengine: ``Trainer(strategy=ZeroEngineStrategy(stage=3))``, or by name once this
module is imported: ``zeroengine``, ``zeroengine_stage_1`` / ``_2`` / ``_3``, ``zeroengine_stage_2_offload``
(optimizer state on CPU) and ``zeroengine_stage_3_offload`` (optimizer state and parameters on CPU).

Lightning owns the loop; the engine owns gradients, the step and the weights:

* the LightningModule is wrapped by :func:`zeroengine.initialize` with the optimizer its
  ``configure_optimizers`` returns, at ``fit``; ``trainer.strategy.model`` is then the engine;
* Lightning steps the scheduler (the engine's is left unset) and clips through the engine
  (``gradient_clip_val`` becomes the config's ``gradient_clipping``, by norm only);
* checkpoints are engine checkpoints, written by every rank into the ``.ckpt`` path as a directory, with
  Lightning's own state (loops, callbacks, schedulers) as the client state; they load at any world size.

Note: gradient accumulation. Lightning divides each micro-batch's loss by ``accumulate_grad_batches``
and decides which micro-batch ends a group (the group is full, or the epoch's last batch is reached).
DeepSpeed's strategy hands the loss to an engine configured with the same accumulation steps, which
divides it again: gradients come out ``accumulate_grad_batches`` times too small (Lightning issue #6170;
Adam's scale invariance hides it, SGD does not). Here the engine is configured with one accumulation step
(so Lightning's division is the only one), and before each backward the strategy tells the engine whether
this micro-batch ends Lightning's group (``set_gradient_accumulation_boundary``). Steps, the scheduler and
``global_step`` then fall exactly where plain Lightning puts them, partial last groups included.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Callable, Mapping, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.precision.utils import _convert_fp_tensor
from lightning_utilities import apply_to_collection
from pytorch_lightning.core.optimizer import _init_optimizers_and_lr_schedulers
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import GradClipAlgorithmType
from pytorch_lightning.utilities.exceptions import MisconfigurationException

import zeroengine
from zeroengine.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint, load_client_state
from zeroengine.config.loader import read_config_file

_DTYPES = {"32-true": torch.float32, "32": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
           "16-mixed": torch.float16, "16-true": torch.float16}
_TAG = "checkpoint"  # the engine tag inside each Lightning .ckpt directory (DeepSpeed's strategy uses the same)
# Lightning owns these; a config that sets them would disagree with the Trainer.
_TRAINER_OWNED = {
    "gradient_accumulation_steps": "Trainer(accumulate_grad_batches=...)",
    "train_batch_size": "the DataLoader's batch_size",
    "scheduler": "configure_optimizers() (Lightning steps the scheduler)",
    "optimizer": "configure_optimizers()",
}


class ZeroEnginePrecision(Precision):
    """Lightning's precision plugin for the engine: backward and step go through it; the engine keeps fp32
    masters and casts the model (bf16/fp16 config sections); batches are cast to the training dtype here."""

    def __init__(self, precision: str = "32-true"):
        precision = str(precision)
        if precision not in _DTYPES:
            raise ValueError(f"precision={precision!r} is not supported by ZeroEngineStrategy; use one of "
                             f"{sorted(_DTYPES)}")
        self.precision = precision
        self._dtype = _DTYPES[precision]

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self._dtype)

    def backward(self, tensor: torch.Tensor, model: "pl.LightningModule", optimizer, *args, **kwargs) -> None:
        model.trainer.strategy.model.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs) -> Any:
        result = closure()  # training_step and backward
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise MisconfigurationException("training_step returned None: skipping a batch is not supported with "
                                            "ZeroEngineStrategy (every rank must take part in each step)")
        model.trainer.strategy.model.step()
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        pass  # the engine clips the global norm (the config's gradient_clipping, set from gradient_clip_val)


class ZeroEngineStrategy(DDPStrategy):
    """Train a LightningModule with zeroengine at ZeRO ``stage`` 0-3 (see the module docstring).

    ``config``: a zeroengine/DeepSpeed config (dict or JSON/HJSON path) for everything Lightning does not set
    itself: ZeRO options, offload, bf16/fp16 details, activation checkpointing, monitors. ``stage`` is
    ``zero_optimization.stage`` (given in both places, they must agree; given in neither, 2);
    ``offload_optimizer`` / ``offload_parameters`` add CPU offload sections."""

    strategy_name = "zeroengine"

    def __init__(self, stage: Optional[int] = None, config: Optional[dict | str | os.PathLike] = None,
                 offload_optimizer: bool = False,
                 offload_parameters: bool = False, **kwargs: Any):
        self._ze_precision: Optional[ZeroEnginePrecision] = None
        super().__init__(**kwargs)
        self.config = _base_config(stage, config, offload_optimizer, offload_parameters)

    # -- Lightning's switches ------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> Precision:
        return self._ze_precision if self._ze_precision is not None else ZeroEnginePrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # The Trainer assigns a plain/mixed/half plugin from precision=...; keep its precision, route it here.
        if plugin is not None and not isinstance(plugin, ZeroEnginePrecision):
            plugin = ZeroEnginePrecision(getattr(plugin, "precision", "32-true"))
        self._ze_precision = plugin
        self._precision_plugin = plugin

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # Lightning decides where groups end (see "gradient accumulation")

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads its own checkpoint, so it must exist first

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the optimizer state is in the engine checkpoint

    # -- setup and teardown --------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
                raise MisconfigurationException("ZeroEngineStrategy clips gradients by their global norm only "
                                                "(gradient_clip_algorithm='norm')")
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise MisconfigurationException("ZeroEngineStrategy trains one optimizer (and at most one "
                                                f"scheduler); configure_optimizers() gave {len(optimizers)} "
                                                f"optimizers and {len(schedulers)} schedulers")
            engine, optimizer, _, _ = zeroengine.initialize(model=self.lightning_module, optimizer=optimizers[0],
                                                            config=self._engine_config(trainer))
            self.model = engine
            self.optimizers = [optimizer]
            self.lr_scheduler_configs = schedulers
        else:
            self.model_to_device()
        self.barrier()

    def _engine_config(self, trainer: "pl.Trainer") -> dict:
        config = copy.deepcopy(self.config)
        config["gradient_accumulation_steps"] = 1  # Lightning's groups: see "gradient accumulation"
        config.setdefault("train_micro_batch_size_per_gpu", 1)  # (only the progress line's samples/s reads it)
        config.setdefault("gradient_clipping", float(trainer.gradient_clip_val or 0.0))
        precision = self.precision_plugin.precision
        if precision.startswith("bf16"):
            config.setdefault("bf16", {"enabled": True})
        elif precision.startswith("16"):
            config.setdefault("fp16", {"enabled": True})
        return config

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        if module.automatic_optimization:
            # This micro-batch ends a group where plain Lightning would step: the group is full or the epoch ends.
            self.model.set_gradient_accumulation_boundary(not module.trainer.fit_loop._should_accumulate())
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def teardown(self) -> None:
        if self.lightning_module is not None and self.model is not self.lightning_module:
            self.model.destroy()
            self.model = self.lightning_module
        self._reset_optimizers_and_schedulers()  # (Strategy.teardown would move the engine's optimizer state)
        super().teardown()

    # -- checkpoints -----------------------------------------------------------------------------------
    def optimizer_state(self, optimizer) -> dict:
        return {}  # in the engine checkpoint

    def lightning_module_state_dict(self) -> dict:
        return {}  # in the engine checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Every rank writes its part of an engine checkpoint into ``filepath`` (a directory)."""
        if storage_options is not None:
            raise TypeError("ZeroEngineStrategy.save_checkpoint takes no storage_options (CheckpointIO plugins "
                            "do not apply: every rank writes its own part of the engine checkpoint)")
        filepath = self.broadcast(str(filepath))
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        # Synchronous even with checkpoint.async_save: ModelCheckpoint removes the previous best as soon as this
        # returns, so a save still being written then would leave no checkpoint at all if the run died meanwhile.
        self.model.save_checkpoint(filepath, tag=_TAG, client_state=client, async_save=False)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = str(checkpoint_path)
        if not os.path.isdir(os.path.join(path, _TAG)):
            raise FileNotFoundError(f"{path} is not a ZeroEngineStrategy checkpoint (no {_TAG}/ folder in it)")
        if self.model is self.lightning_module:  # not fitting: no engine; load the consolidated weights
            return {**load_client_state(path, _TAG), "state_dict": get_fp32_state_dict_from_zero_checkpoint(path, _TAG)}
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client = self.model.load_checkpoint(path, tag=_TAG, load_optimizer_states=fitting,
                                               load_lr_scheduler_states=False,
                                               load_module_strict=self.lightning_module.strict_loading)
        return client

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.model is self.lightning_module:  # not fitting: the consolidated weights load_checkpoint read
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # the engine restored it

    # -- names ---------------------------------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, registry) -> None:
        registry.register("zeroengine", cls, description="zeroengine, ZeRO stage 2", stage=2, override=True)
        for stage in (1, 2, 3):
            registry.register(f"zeroengine_stage_{stage}", cls, description=f"zeroengine, ZeRO stage {stage}",
                              stage=stage, override=True)
        registry.register("zeroengine_stage_2_offload", cls, description="zeroengine, ZeRO stage 2, optimizer "
                          "state on CPU", stage=2, offload_optimizer=True, override=True)
        registry.register("zeroengine_stage_3_offload", cls, description="zeroengine, ZeRO stage 3, optimizer "
                          "state and parameters on CPU", stage=3, offload_optimizer=True, offload_parameters=True,
                          override=True)


def _base_config(stage: Optional[int], config, offload_optimizer: bool, offload_parameters: bool) -> dict:
    if isinstance(config, (str, os.PathLike)):
        config = read_config_file(os.fspath(config))
    config = copy.deepcopy(config) if config is not None else {}
    if not isinstance(config, dict):
        raise TypeError(f"ZeroEngineStrategy(config=...) takes a dict or a path, got {type(config).__name__}")
    for key, owner in _TRAINER_OWNED.items():
        if key in config:
            raise MisconfigurationException(f"ZeroEngineStrategy: remove '{key}' from the config; with Lightning it "
                                            f"comes from {owner}")
    zero = config.setdefault("zero_optimization", {})
    if stage is not None and zero.setdefault("stage", stage) != stage:
        raise MisconfigurationException(f"ZeroEngineStrategy(stage={stage}) and the config's zero_optimization.stage "
                                        f"({zero['stage']}) disagree")
    zero.setdefault("stage", 2)
    if offload_optimizer:
        zero.setdefault("offload_optimizer", {"device": "cpu"})
    if offload_parameters:
        zero.setdefault("offload_param", {"device": "cpu"})
    return config


ZeroEngineStrategy.register_strategies(StrategyRegistry)
