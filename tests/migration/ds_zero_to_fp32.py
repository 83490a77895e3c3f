"""DeepSpeed's own zero_to_fp32 on each folder given: OUT/<folder name>.pt (run with DeepSpeed importable)."""
import os
import sys

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

out = sys.argv[1]
for folder in sys.argv[2:]:
    state = get_fp32_state_dict_from_zero_checkpoint(folder)
    torch.save({k: v.clone() for k, v in state.items()}, os.path.join(out, os.path.basename(folder) + ".pt"))
