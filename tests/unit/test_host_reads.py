"""No host-device synchronisation in a steady-state micro-step (issue: the host waited on the device every
micro-step for the loss, and twice per step for the norm and the overflow flag).

On CPU a "wait for the device" cannot be observed, so this counts what causes one: zeroengine code reading a
tensor's value on the host (``item``, ``float()``, ``bool()``, ``tolist``, ...). Reads inside torch (its Adam
keeps the step count in host memory by design) are not zeroengine's. tests/gpu/test_no_sync.py checks the same
steps on CUDA with torch.cuda.set_sync_debug_mode("error")."""
import os
import sys

import pytest
import torch
from parity import base_config, global_batches, make_model
from torch.overrides import TorchFunctionMode

import zeroengine

_READS = {"item", "__float__", "__bool__", "__int__", "__index__", "tolist", "numpy", "__complex__"}
_PACKAGE = os.path.dirname(zeroengine.__file__)
_TORCH = os.path.dirname(torch.__file__)


class HostReads(TorchFunctionMode):
    """Counts value reads made by zeroengine's code (directly, or through the optimizer it steps), except of
    the optimizer's step counts: host state by design (torch's Adam keeps them on the CPU too)."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer = optimizer
        self.sites = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS and args and not self._host_state(args[0]):
            caller = sys._getframe(1)
            while caller is not None and caller.f_code.co_filename.startswith(_TORCH):
                caller = caller.f_back
            if caller is not None and caller.f_code.co_filename.startswith(_PACKAGE):
                self.sites.append(f"{name} at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}")
        return func(*args, **(kwargs or {}))

    def _host_state(self, tensor) -> bool:
        return any(state.get("step") is tensor for state in self.optimizer.state.values())


def count_host_reads(cfg: dict, steps: int = 2, gas: int = 2):
    """Per steady-state optimizer step: (host reads in its micro-steps, host reads in its step())."""
    torch.manual_seed(0)
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    batches = global_batches(steps + 2, gas, 1, cfg["train_micro_batch_size_per_gpu"])
    per_step = []
    for i, step in enumerate(batches):
        micro, stepping = HostReads(engine.optimizer), HostReads(engine.optimizer)
        for x, y in (m[0] for m in step):
            with micro:
                loss = engine(x, y)
                engine.backward(loss)
            with stepping:
                engine.step()
        if i >= 2:  # the first two steps record stage 3's order and warm everything up
            per_step.append((micro.sites, stepping.sites))
    engine.destroy()
    return per_step


def _config(stage: int, dtype: str, **extra):
    cfg = base_config(2, 2, 1, 1.0, dtype=dtype, stage=stage)  # gradient clipping on: decided on the device
    cfg["steps_per_print"] = None
    for key, value in extra.items():
        cfg[key] = value
    return cfg


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_steps_read_nothing_on_the_host(stage):
    for micro, stepping in count_host_reads(_config(stage, "fp32")):
        assert micro == [] and stepping == [], (micro, stepping)


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_without_an_overflow_check_reads_nothing_and_with_it_reads_once_per_step(stage):
    for micro, stepping in count_host_reads(_config(stage, "bf16", bf16={"enabled": True,
                                                                          "check_grad_overflow": False})):
        assert micro == [] and stepping == [], (micro, stepping)
    for micro, stepping in count_host_reads(_config(stage, "bf16")):  # DeepSpeed's default: skip non-finite steps
        assert micro == [] and len(stepping) == 1 and stepping[0].startswith("__bool__ at optimizer.py"), stepping


def test_fp16_reads_once_per_step_for_its_loss_scale():
    for micro, stepping in count_host_reads(_config(2, "fp16")):
        assert micro == [] and len(stepping) == 1, (micro, stepping)


def test_a_print_reads_the_loss_once_at_the_print():
    cfg = _config(1, "fp32")
    cfg["steps_per_print"] = 2
    reads = [len(stepping) for micro, stepping in count_host_reads(cfg, steps=4)]
    assert reads == [0, 1, 0, 1], reads  # global steps 3..6: prints at 4 and 6
