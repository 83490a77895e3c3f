"""Record pids, then sleep forever; with --fail_rank R, rank R exits 3 (noting the
time in fail.time) once every rank has recorded its pid. No torch: starts fast."""
import argparse
import os
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("pid_dir")
parser.add_argument("--fail_rank", type=int, default=-1)
parser.add_argument("--spawn_child", action="store_true")
args = parser.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def record(name, pid):
    tmp = os.path.join(args.pid_dir, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.rename(tmp, os.path.join(args.pid_dir, name))


if args.spawn_child:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record(f"{rank}.child.pid", child.pid)
record(f"{rank}.pid", os.getpid())
if rank == args.fail_rank:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(args.pid_dir, f"{r}.pid")) for r in range(world)):
        time.sleep(0.05)
    with open(os.path.join(args.pid_dir, "fail.time"), "w") as f:
        f.write(repr(time.time()))
    sys.exit(3)
time.sleep(600)
