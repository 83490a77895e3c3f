"""Rank 1 raises after init; rank 0 (with a child process) sleeps forever."""
import os
import subprocess
import sys
import time

import torch.distributed as dist

pid_dir = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if rank == 0:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(pid_dir, "0.child.pid"), "w") as f:
        f.write(str(child.pid))
with open(os.path.join(pid_dir, f"{rank}.pid.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(pid_dir, f"{rank}.pid.tmp"), os.path.join(pid_dir, f"{rank}.pid"))
if rank == 1:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(pid_dir, "0.pid")) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(os.path.join(pid_dir, "fail.time"), "w") as f:
        f.write(repr(time.time()))
    raise RuntimeError("rank 1 fails on purpose")
time.sleep(600)
