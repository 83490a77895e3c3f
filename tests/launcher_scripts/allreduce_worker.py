"""Init gloo from the launcher's env, all_reduce, check the sum (torch only)."""
import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--expect_world", type=int, required=True)
args = parser.parse_args()

dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
assert world == args.expect_world, (world, args.expect_world)
assert rank == int(os.environ["RANK"]), (rank, os.environ["RANK"])
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
assert t.item() == expected, (t.item(), expected)
print(f"rank {rank}/{world} all_reduce ok sum={t.item():g}", flush=True)
dist.destroy_process_group()
