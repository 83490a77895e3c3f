"""What the engine hands the monitors at each optimizer step, and building them from the config.

Written every optimizer step (as DeepSpeed does), not every ``steps_per_print``:
curves need every point, and one small row per step costs nothing next to a step.

Metric names (CSV columns and TensorBoard tags):

* ``train/loss``: the mean of this step's micro-batch losses, averaged over the
  data-parallel ranks (one scalar all-reduce per step that every rank joins);
* ``train/lr``: the learning rate this step applied (of the first param group;
  read before the scheduler moves it);
* ``train/loss_scale``: the fp16 loss scale this step's gradients were scaled by
  (1.0 without fp16), so an overflow step shows the scale that overflowed;
* ``train/grad_norm``: the global gradient norm before clipping;
* ``train/samples_per_sec``: train_batch_size over the wall time since the
  previous step (rank 0's clock; the first step counts from initialize);
* ``train/skipped_steps``: steps skipped so far (fp16 overflows);
* ``memory/<kind>``: rank 0's ``engine.memory_breakdown()`` in bytes (params,
  grads, optimizer_states, master_params, buffers, and cpu / device);
* ``comm/payload_bytes``, ``comm/wire_bytes``: rank 0's collective traffic
  during the step (zeroengine.comm.counters; the monitor's own loss all-reduce excluded).
"""
from __future__ import annotations

import math
import os
import time

from zeroengine import comm

from .base import MonitorMaster, StepRecord


def _comm_totals() -> tuple[float, float]:
    return float(comm.counters.total_payload_bytes()), comm.counters.total_wire_bytes()


class StepRecorder:
    """Lives on every rank (all join the loss all-reduce); only rank 0's master has writers."""

    def __init__(self, master: MonitorMaster):
        self.master = master
        self._last_time = time.perf_counter()
        self._last_comm = _comm_totals()

    def restart_window(self) -> None:
        """Measure the next step from now: what ran in between (a checkpoint save or load, with its
        collectives and file I/O) is not the next step's traffic or time."""
        self._last_time = time.perf_counter()
        self._last_comm = _comm_totals()

    def record_step(self, engine, local_loss: float, lr: float, result) -> None:
        now = time.perf_counter()
        payload, wire = _comm_totals()
        # Someone may reset the process-wide counters (benchmarks do): then count from zero.
        d_payload = payload - self._last_comm[0] if payload >= self._last_comm[0] else payload
        d_wire = wire - self._last_comm[1] if wire >= self._last_comm[1] else wire
        loss = comm.all_reduce_scalar(local_loss) / engine.world_size
        self._last_comm = _comm_totals()
        elapsed, self._last_time = max(now - self._last_time, 1e-9), now
        if not self.master.active:
            return
        scale = result.loss_scale if result is not None and result.loss_scale is not None else 1.0
        grad_norm = result.grad_norm if result is not None and result.grad_norm is not None else math.nan
        metrics = {
            "train/loss": loss,
            "train/lr": float(lr),
            "train/loss_scale": float(scale),
            "train/grad_norm": float(grad_norm),
            "train/samples_per_sec": engine.train_batch_size() / elapsed,
            "train/skipped_steps": engine.skipped_steps,
        }
        metrics.update({f"memory/{kind}": nbytes for kind, nbytes in engine.memory_breakdown().items()})
        metrics["comm/payload_bytes"] = int(d_payload)
        metrics["comm/wire_bytes"] = int(round(d_wire))
        self.master.write(StepRecord(engine.global_steps, engine.global_samples, time.time(), metrics))

    def close(self) -> None:
        self.master.close()


def output_directory(backend_config) -> str:
    """``<output_path or the current directory>/<job_name>``, made absolute at start-up."""
    return os.path.abspath(os.path.join(backend_config.output_path or os.getcwd(), backend_config.job_name))


def build_recorder(monitor_config, rank: int) -> StepRecorder | None:
    """None when no writer is enabled (no files, no extra collective); writers only on rank 0."""
    if not monitor_config.enabled:
        return None
    from .csv_monitor import CsvMonitor
    from .tensorboard import TensorBoardMonitor

    monitors, problem = [], None
    if rank == 0:
        for key, section, writer in (("csv", monitor_config.csv, CsvMonitor),
                                     ("tensorboard", monitor_config.tensorboard, TensorBoardMonitor)):
            if not section.enabled:
                continue
            directory = output_directory(section)
            try:
                monitors.append(writer(directory))
            except OSError as err:
                problem = (f"monitor.{key}.output_path", f"cannot write the {key} monitor's files under "
                                                         f"{directory}: {err.strerror or err}")
                break
    # Every rank learns of rank 0's failure, so none goes on alone into a collective the others never join.
    from zeroengine import comm
    from zeroengine.config import ConfigError

    payload = (problem[0] + "\0" + problem[1] if problem else "").encode()
    failed = (comm.handshakes.exchange("monitor", payload)[0] if comm.get_world_size() > 1 else payload).decode()
    if failed:
        key, _, message = failed.partition("\0")
        raise ConfigError(key, message)
    return StepRecorder(MonitorMaster(monitors))
