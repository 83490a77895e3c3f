"""The every-``steps_per_print`` progress line and optional wall-clock breakdown."""
from __future__ import annotations

import logging
import time
from collections import defaultdict

import psutil
import torch

from zeroengine.memory import format_bytes

logger = logging.getLogger("zeroengine")


def get_logger() -> logging.Logger:
    """The "zeroengine" logger at INFO.

    It prints by itself only when the application has not configured logging
    (no root handler); otherwise records propagate to the application's
    handlers like any library's, with no duplicate lines.
    """
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[zeroengine] %(message)s"))
        logger.addHandler(handler)
    return logger


def set_log_level(level: str | None) -> None:
    """Apply the config's ``log_level`` (DeepSpeed's key) to the "zeroengine" logger tree.

    Every zeroengine module logs under "zeroengine.*", so the children follow;
    null leaves the level alone.
    """
    if level is None:
        return
    value = logging.getLevelName(level.upper())
    logger.setLevel(value)
    for handler in logger.handlers:
        handler.setLevel(value)


class StepTimers:
    """Seconds per phase (forward / backward / step) since the last report, reported per optimizer step
    (as DeepSpeed's per-step lines: a forward of each micro-step of an accumulation step adds up).

    On CUDA each phase ends with a synchronize, so it times the work and not only its launches (which is
    why this is off by default: the sync costs overlap)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._started: dict[str, float] = {}
        self.steps = 0

    def start(self, name: str) -> None:
        _sync()
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        t0 = self._started.pop(name, None)
        if t0 is not None:
            _sync()
            self.totals[name] += time.perf_counter() - t0
        if name == "step":
            self.steps += 1

    def report_and_reset(self) -> str:
        steps = max(self.steps, 1)
        text = " | ".join(f"{k} {v * 1000 / steps:.1f}ms" for k, v in self.totals.items()) + " (per step)"
        self.totals.clear()
        self.steps = 0
        return text


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _LossSum:
    """A running sum of scalar losses kept where they were computed: adding one launches a tiny add on the
    device and never waits for it; the host reads the sum only when asked (a print, a monitor row)."""

    def __init__(self) -> None:
        self.total = None
        self.count = 0

    def add(self, loss: torch.Tensor) -> None:
        value = loss.detach().to(torch.float64)
        self.total = value if self.total is None else self.total + value
        self.count += 1

    def take_mean(self) -> float:
        """The mean so far (NaN if none; one host read of a device value); starts a new sum."""
        return float(self.take_mean_tensor())

    def take_mean_tensor(self) -> torch.Tensor:
        """The mean so far as a float64 tensor where the losses were (NaN if none; no host read); starts a new
        sum."""
        total, count = self.total, self.count
        self.total, self.count = None, 0
        return total / count if count else torch.tensor(float("nan"), dtype=torch.float64)


class ProgressMeter:
    """Averages the loss over a print window and measures throughput."""

    def __init__(self, samples_per_step: int) -> None:
        self.samples_per_step = samples_per_step
        self._window = _LossSum()
        self._step = _LossSum()  # this optimizer step's micro-batch losses (for the monitors)
        self.window_start = time.perf_counter()
        self.window_steps = 0

    def add_loss(self, loss, for_step: bool = True) -> None:
        """Add a micro-batch's loss (a tensor stays on its device); ``for_step``: also to the step's mean."""
        self._window.add(loss)
        if for_step:
            self._step.add(loss)

    def take_step_loss(self) -> float:
        """Mean loss of the micro-batches since the last call (NaN if none); starts the next step's."""
        return self._step.take_mean()

    def add_step(self) -> None:
        self.window_steps += 1

    def close_window(self) -> tuple[torch.Tensor, float]:
        """Return (mean local loss, a tensor where the losses were; samples/s) for the window and start a new one."""
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        loss = self._window.take_mean_tensor()
        rate = self.window_steps * self.samples_per_step / elapsed
        self.window_steps = 0
        self.window_start = time.perf_counter()
        return loss, rate


def format_progress(step: int, loss: float, lr: float, samples_per_s: float, memory: dict, loss_scale=None,
                    skipped: int = 0) -> str:
    rss = psutil.Process().memory_info().rss
    parts = [
        f"step {step}",
        f"loss {loss:.4f}",
        f"lr {lr:.3e}",
        f"samples/s {samples_per_s:.1f}",
        f"model states {format_bytes(sum(memory[k] for k in ('params', 'grads', 'optimizer_states', 'master_params')))}",
        f"rss {format_bytes(rss)}",
    ]
    if loss_scale is not None:
        parts.append(f"loss_scale {loss_scale:g}")
    if skipped:
        parts.append(f"skipped {skipped}")
    return " | ".join(parts)
