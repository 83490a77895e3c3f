"""Starts the process group with ``init_distributed(distributed_port=..., timeout=...)`` in a fresh process (none
up yet) and prints, as JSON, the rendezvous it really used and the timeouts it really set.

python init_distributed_probe.py zeroengine|deepspeed PORT SECONDS"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group, _get_default_store

from zeroengine.comm import backend

entry, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
assert not dist.is_initialized()
if entry == "zeroengine":
    import zeroengine

    zeroengine.init_distributed(distributed_port=port, timeout=timedelta(seconds=seconds))
else:  # DeepSpeed's signature, as the alias gives it
    from zeroengine.integrations.ds_compat import init_distributed

    init_distributed(dist_backend="gloo", auto_mpi_discovery=False, distributed_port=port,
                     timeout=timedelta(seconds=seconds))
store = _get_default_store()
while hasattr(store, "underlying_store"):  # the default group's PrefixStore over the rendezvous' TCPStore
    store = store.underlying_store
group = _get_default_group()._get_backend(torch.device("cpu"))
print(json.dumps({"world": dist.get_world_size(), "master_port_env": os.environ.get("MASTER_PORT"),
                  "store_port": store.port, "store_timeout_s": store.timeout.total_seconds(),
                  "group_timeout_s": group.options._timeout.total_seconds(), "recorded_timeout_s": backend.state.timeout_s}))
dist.destroy_process_group()
