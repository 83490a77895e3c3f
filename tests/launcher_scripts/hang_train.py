"""A 2-rank training loop in which one rank does not arrive at a collective, for the watchdog's tests.

    hang_train.py stuck   # rank 1 is stuck in its own code (a long sleep) before its third step
    hang_train.py early   # rank 1's loop ends one step before rank 0's; its script ends normally

Run under the launcher with a short ZEROENGINE_COMM_TIMEOUT: rank 0 waits in the step's gradient reduction and
its error is the hang report naming rank 1 (stuck, with its stack printed; or left early).
"""
import sys
import time

import torch

import zeroengine

STEPS = 4


def slow_data_loading():
    time.sleep(3600)  # the line rank 1's printed stack points at


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2}, "steps_per_print": 1000}
engine, _, _, _ = zeroengine.initialize(model=model, config=config)
steps = STEPS - 1 if sys.argv[1] == "early" and engine.global_rank == 1 else STEPS
for step in range(steps):
    if sys.argv[1] == "stuck" and engine.global_rank == 1 and step == 2:
        slow_data_loading()
    x, y = torch.randn(2, 6), torch.randn(2, 3)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
print(f"rank {engine.global_rank}: finished {steps} steps", flush=True)
