"""A training script that survives its own crash, as a user writes one for ``zeroengine --max_restarts``.

    restart_train.py OUT_DIR STEPS [--crash_at STEP]

For each ZeRO stage 0-3: initialize with training_data (the engine's loader), resume from OUT_DIR/stage<s> if a
checkpoint is there, train to STEPS optimizer steps saving a checkpoint after every step (the data position goes
with it), and write the final parameters to OUT_DIR/stage<s>.pt (rank 0). With --crash_at, rank 1 of the first
attempt (ZEROENGINE_RESTART_COUNT 0) dies abruptly (os._exit) right after step STEP of stage 1 was saved; the
launcher restarts the job and every stage resumes from its last checkpoint.
"""
import argparse
import os

import torch

import zeroengine

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("steps", type=int)
parser.add_argument("--crash_at", type=int, default=None)
args = parser.parse_args()
attempt = int(os.environ["ZEROENGINE_RESTART_COUNT"])


class Samples(torch.utils.data.Dataset):
    """13 samples (odd: the ranks' shares are padded), the same on every rank."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(13, 6, generator=g), torch.randn(13, 3, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


for stage in range(4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
              "steps_per_print": 1000}
    engine, _, loader, _ = zeroengine.initialize(model=model, config=config, training_data=Samples())
    folder = os.path.join(args.out, f"stage{stage}")
    engine.load_checkpoint(folder)  # nothing there on a first attempt: (None, None), and training starts
    while engine.global_steps < args.steps:
        for x, y in loader:  # the pass under way at the checkpoint goes on where it stopped
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            engine.save_checkpoint(folder)
            if (args.crash_at is not None and attempt == 0 and stage == 1 and engine.global_steps == args.crash_at
                    and engine.global_rank == 1):
                os._exit(1)  # a rank dying mid-run, checkpoint written
            if engine.global_steps == args.steps:
                break
    with zeroengine.zero.GatheredParameters(list(engine.module.parameters())):
        if engine.global_rank == 0:
            torch.save({n: p.detach().clone() for n, p in engine.module.named_parameters()},
                       os.path.join(args.out, f"stage{stage}.pt"))
    engine.destroy()
