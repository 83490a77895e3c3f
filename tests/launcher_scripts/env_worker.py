"""Write this rank's launcher variables and argv to OUT_DIR/rank<RANK>.json (no torch)."""
import json
import os
import sys

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
         "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
out_dir = sys.argv[1]
record = {name: os.environ.get(name) for name in NAMES}
record["argv"] = sys.argv[2:]
record["cwd"] = os.getcwd()
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)
