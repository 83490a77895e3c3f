"""One plain state_dict from a sharded checkpoint, with no process group (``ze_to_fp32``).

Shard files are memory-mapped, so assembling the output costs one model's
worth of memory (the result), not two: the inputs stay in the page cache.
The result loads with plain ``torch.load`` + ``module.load_state_dict``,
tied parameters included (each of their names maps to the same tensor).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from zeroengine.progress import get_logger

from . import manifest as mf
from . import tensor_split as ts
from .files import CheckpointError, save_tensors
from .formats import read_manifest


def load_client_state(checkpoint_dir: str, tag: str | None = None) -> dict:
    """The ``client_state`` saved with a checkpoint, read without a training world (for a Lightning
    ``trainer.test(ckpt_path=...)`` that builds no engine)."""
    manifest = read_manifest(mf.find_tag_dir(checkpoint_dir, tag))
    return manifest.open(mf.COMMON)["client_state"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False, lazy_mode: bool = False, *,
                                             dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The full model state_dict: parameters from their fp32 master values (cast to ``dtype``), buffers as saved.

    ``checkpoint_dir`` is the ``save_dir`` given to ``save_checkpoint`` (the tag comes from ``latest`` unless
    given) or a tag directory itself. ``exclude_frozen_parameters`` leaves out the parameters that did not
    require grad when saved (the manifest names them; checkpoints from before it did are refused), and
    ``lazy_mode`` has no effect (values are loaded at once).
    """
    manifest = read_manifest(mf.find_tag_dir(checkpoint_dir, tag))
    frozen = set(manifest.data.get("frozen_params", []))
    if exclude_frozen_parameters and "frozen_params" not in manifest.data:
        raise CheckpointError(f"{manifest.tag_dir} does not record which parameters were frozen (saved by an "
                              "older zeroengine): exclude_frozen_parameters=True cannot tell them from buffers; "
                              "drop their keys from the full state_dict instead")
    files: dict[str, dict] = {}

    def opened(file: str) -> dict:
        if file not in files:
            files[file] = manifest.open(file)
        return files[file]

    # buffers and frozen parameters first, then the trained parameters, then tied names: DeepSpeed's order
    out: dict[str, torch.Tensor] = {}
    extras = dict(opened(mf.COMMON)["module_extras"])
    for file, info in manifest.data["files"].items():  # later pipeline stages' buffers and frozen parameters
        if info.get("module_extras"):
            extras.update(opened(file)["module_extras"])
    for name, value in extras.items():
        if not (exclude_frozen_parameters and name in frozen):
            out[name] = value.to(dtype) if value.is_floating_point() else value.clone()
    progress = _Progress(manifest)
    for base in dict.fromkeys(ts.base_name(name) for name in manifest.params):  # tensor-parallel pieces merged
        names = ts.stored_pieces(manifest.params, base)
        if names is None:
            raise CheckpointError(f"{manifest.tag_dir}: the tensor-parallel pieces of {base!r} are incomplete")
        flats = []
        for name in names:
            numel = ts.numel(manifest.params, name)
            flat = torch.empty(numel, dtype=dtype)
            for e in manifest.entries_overlapping(name, 0, numel):
                flat[e.start:e.end] = opened(e.file)["entries"][e.index]["value"]
            flats.append(flat)
            progress.advance(numel)
        out[base] = ts.merge(manifest.params, names, flats)
    for alias, name in manifest.data.get("aliases", {}).items():
        if name in out:
            out[alias] = out[name]
    return out


class _Progress:
    """A line every 10% of the parameters for checkpoints big enough to take a while (> 2^28 elements)."""

    def __init__(self, manifest: mf.Manifest):
        self.total = sum(math.prod(info["shape"]) for info in manifest.params.values())
        self.done, self.next_tenth = 0, 1
        self.log = get_logger() if self.total > 2**28 else None

    def advance(self, numel: int) -> None:
        self.done += numel
        if self.log is not None and self.done * 10 >= self.next_tenth * self.total:
            self.log.info(f"consolidating: {self.done / 1e6:,.0f}M of {self.total / 1e6:,.0f}M parameters")
            self.next_tenth = self.done * 10 // self.total + 1


DEFAULT_FILE_NAME = "pytorch_model.bin"  # what DeepSpeed writes into an output directory


def output_path(output: str) -> str:
    """``output`` itself, or ``output/pytorch_model.bin`` when it is a directory (an existing one, or a path
    ending in a separator): DeepSpeed 0.19.8's converter takes a directory, zeroengine's a file or either."""
    output = os.fspath(output)  # a pathlib.Path too
    if os.path.isdir(output) or output.endswith(os.sep):
        return os.path.join(output, DEFAULT_FILE_NAME)
    return output


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_file: str, *, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False,
                                               safe_serialization: bool = False, max_shard_size="5GB",
                                               dtype: torch.dtype = torch.float32) -> str:
    """Write :func:`get_fp32_state_dict_from_zero_checkpoint`'s result to ``output_file`` (atomically) and
    return the path written (``output_file/pytorch_model.bin`` for a directory, as DeepSpeed's).

    Keyword-only after the output (DeepSpeed's positional order differs: its third is ``max_shard_size``):
    ``exclude_frozen_parameters`` as there, ``safe_serialization`` only False (torch.save format),
    ``max_shard_size`` accepted with no effect (one file, whatever its size).
    """
    if safe_serialization:
        raise CheckpointError("safe_serialization=True is not supported: the output is one torch.save file "
                              "(load it with torch.load, weights_only=True)")
    path = output_path(output_file)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters, dtype=dtype)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_tensors(state, path)
    except OSError as err:
        raise CheckpointError(f"cannot write {path}: {err.strerror or err}") from None
    return path


def convert_zero_checkpoint_to_16bit_state_dict(checkpoint_dir: str, output_file: str, tag: str | None = None,
                                                dtype: torch.dtype = torch.bfloat16) -> str:
    """The same, for inference in 16 bits (floating tensors cast to ``dtype``)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    return convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=tag, dtype=dtype)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None):
    """Load the consolidated fp32 weights into a plain (unwrapped) ``model``; returns the model."""
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag))
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ze_to_fp32",
        description="Consolidate a zeroengine checkpoint (any world size, any ZeRO stage) into one fp32 "
                    "state_dict file loadable with torch.load + module.load_state_dict.")
    parser.add_argument("checkpoint_dir", help="the save_dir given to save_checkpoint, or one tag directory")
    parser.add_argument("output_file", help="where to write the state_dict (torch.save format); a directory "
                                            f"gets {DEFAULT_FILE_NAME} in it, as DeepSpeed's zero_to_fp32.py")
    parser.add_argument("-t", "--tag", default=None, help="the tag to convert (default: the one 'latest' names)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="dtype of the floating-point tensors written (default fp32)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out parameters that did not require grad (DeepSpeed's flag)")
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, tag=args.tag,
                                                             exclude_frozen_parameters=args.exclude_frozen_parameters,
                                                             dtype=dtype)
    except CheckpointError as err:
        print(f"ze_to_fp32: {err}", file=sys.stderr)
        return 1
    size = os.path.getsize(written)
    print(f"ze_to_fp32: wrote {written} ({size / 2**20:.1f} MiB, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
