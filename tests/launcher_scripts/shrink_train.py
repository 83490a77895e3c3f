"""A job that loses a node: 4 ranks on 2 (fake) nodes, then 2 ranks on the one left, through one epoch.

    shrink_train.py OUT_DIR DOWN_FILE

24 indexed samples, 2 per rank and step, the engine's loader (initialize(training_data=...)), a checkpoint after
every step. Each rank appends the indices it trained in a step to OUT_DIR/samples_<attempt>_<rank>.txt once the
step's checkpoint is saved. On the first attempt, after step 1 and its checkpoint, the ranks meet (so all have
logged), then rank 2 (on the second node) writes that node's name to DOWN_FILE (the fake ssh then cannot reach
it) and dies. The launcher (--max_restarts 1 --min_nodes 1) leaves the node out and restarts the job at 2 ranks;
the loader continues the epoch where the checkpoint stopped, and the job ends when the pass does.
"""
import os
import sys

import torch

import zeroengine

out, down_file = sys.argv[1], sys.argv[2]
attempt = int(os.environ["ZEROENGINE_RESTART_COUNT"])


class Indexed(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(24, 6, generator=g), torch.randn(24, 3, generator=g)

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2}}
engine, _, loader, _ = zeroengine.initialize(model=model, config=config, training_data=Indexed())
folder = os.path.join(out, "ckpt")
engine.load_checkpoint(folder)
rank = engine.global_rank
for x, y, index in loader:
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(folder)
    with open(os.path.join(out, f"samples_{attempt}_{rank}.txt"), "a") as f:
        f.write(" ".join(str(i) for i in index.tolist()) + "\n")
    if attempt == 0 and engine.global_steps == 1:
        zeroengine.comm.barrier()  # every rank has logged step 1
        if rank == 2:
            with open(down_file, "w") as f:
                f.write("localhost\n")
            os._exit(1)
print(f"rank {rank} of {engine.world_size}: the epoch is done at step {engine.global_steps}", flush=True)
