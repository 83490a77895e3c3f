"""``deepspeed.utils.zero_to_fp32`` under the alias: DeepSpeed's functions, positional orders and script
arguments, over zeroengine's consolidation (zeroengine.checkpoint), which reads zeroengine's checkpoints and
DeepSpeed's (stages 0-3, universal folders) alike."""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys

import torch

from zeroengine import checkpoint as _checkpoint
from zeroengine.checkpoint.manifest import MANIFEST


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False):
    """The full fp32 state_dict (``lazy_mode`` accepted; values are loaded at once)."""
    return _checkpoint.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters,
                                                                lazy_mode)


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """One torch.save file ``output_dir/pytorch_model.bin`` (``max_shard_size`` accepted, one file always;
    ``safe_serialization=True`` refused, naming itself)."""
    return _checkpoint.convert_zero_checkpoint_to_fp32_state_dict(
        checkpoint_dir, output_dir, tag=tag, exclude_frozen_parameters=exclude_frozen_parameters,
        safe_serialization=safe_serialization, max_shard_size=max_shard_size, dtype=dtype)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load the consolidated fp32 weights into ``model`` (moved to the CPU first, as DeepSpeed does)."""
    return _checkpoint.load_state_dict_from_zero_checkpoint(model.cpu(), checkpoint_dir, tag)


def get_optim_files(checkpoint_dir) -> list[str]:
    """A DeepSpeed tag folder's ``*_optim_states.pt`` files in rank order (Lightning's converter reads them)."""
    return _deepspeed_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_file(checkpoint_dir, zero_stage) -> str:
    """A DeepSpeed tag folder's model-states file (rank 0's at stage 3)."""
    _refuse_zeroengine_folder(checkpoint_dir)
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if int(zero_stage) == 3 else "mp_rank_00_model_states.pt"
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def _deepspeed_files(checkpoint_dir, pattern: str) -> list[str]:
    _refuse_zeroengine_folder(checkpoint_dir)
    files = sorted(glob.glob(os.path.join(checkpoint_dir, pattern)),
                   key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)])
    if not files:
        raise FileNotFoundError(f"can't find {pattern} files in directory '{checkpoint_dir}'")
    return files


def _refuse_zeroengine_folder(checkpoint_dir) -> None:
    """DeepSpeed's file helpers have nothing to list in a zeroengine checkpoint (another layout): say so."""
    if os.path.exists(os.path.join(checkpoint_dir, MANIFEST)):
        raise _checkpoint.CheckpointError(
            f"{checkpoint_dir} is a zeroengine checkpoint, which has no DeepSpeed rank files: consolidate it with "
            "get_fp32_state_dict_from_zero_checkpoint (this module's, which reads both layouts) or ze_to_fp32, "
            "or write DeepSpeed's layout with ze_to_deepspeed")


def main(argv=None) -> int:
    """``python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] ...``: DeepSpeed's script arguments."""
    parser = argparse.ArgumentParser(prog="zero_to_fp32.py")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                             args.safe_serialization, args.tag,
                                                             args.exclude_frozen_parameters)
    except _checkpoint.CheckpointError as err:
        print(f"zero_to_fp32: {err}", file=sys.stderr)
        return 1
    print(f"zero_to_fp32: wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
