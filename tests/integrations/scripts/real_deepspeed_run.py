"""Run a script under the real DeepSpeed test anchor on CPU with plain gloo collectives:

    torchrun ... tests/integrations/scripts/real_deepspeed_run.py SCRIPT [ARGS...]

DeepSpeed's CPU backend would otherwise JIT-compile its shared-memory all-reduce (deepspeed_shm_comm) when
its first process group starts: 35-90 s on 2 cores, again in every fresh checkout (the build records its
paths), for an op these tests do not need (tests/migration/ds_checkpoint_common.skip_shared_memory_op does
the same for the migration tests' ranks). The script itself runs unchanged, as ``__main__``."""
import runpy
import sys

import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
