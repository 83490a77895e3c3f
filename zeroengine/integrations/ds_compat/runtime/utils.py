"""``deepspeed.runtime.utils``: ``move_to_device`` (the sequence-parallel tutorial's) and ``see_memory_usage``."""
from __future__ import annotations

import gc

import psutil
import torch

from zeroengine import comm
from zeroengine.sequence_parallel import move_to_device  # noqa: F401

_GB = 1024 ** 3


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's memory report, printed on rank 0 only and only with ``force=True`` (as DeepSpeed: the
    library's own calls pass False): ``message``, then on a CUDA device the allocated and cached memory
    with their peaks (the peaks are reset after, so the next report shows the peak since this one), then the
    host's virtual memory in use."""
    if not force or comm.get_rank() != 0:
        return
    gc.collect()  # objects only the cycle collector frees would count as used
    print(message)
    if torch.cuda.is_available():
        print(f"MA {torch.cuda.memory_allocated() / _GB:.2f} GB "
              f"Max_MA {torch.cuda.max_memory_allocated() / _GB:.2f} GB "
              f"CA {torch.cuda.memory_reserved() / _GB:.2f} GB "
              f"Max_CA {torch.cuda.max_memory_reserved() / _GB:.2f} GB ")
        torch.cuda.reset_peak_memory_stats()
    vm = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / _GB:.2f} GB, percent = {vm.percent}%")
