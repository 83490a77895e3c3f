"""DeepSpeed's checkpoint files, read as data and written for DeepSpeed, without importing DeepSpeed.

DeepSpeed 0.19 pickles three of its own types into its files: the loss scaler
(``LossScaler`` / ``DynamicLossScaler``, plain attribute bags), the ZeRO stage
(``ZeroStageEnum``, an int enum) and the partition map (``fragment_address``, a
dataclass of two ints). Everything else in them is tensors, dicts, lists and
numbers. Files are read with ``torch.load(weights_only=True)`` and these names
allowlisted as the stand-ins below, so reading a DeepSpeed checkpoint never runs
code from it: any other global is refused, naming the file and the type.

Writing goes the other way: :func:`save_for_deepspeed` pickles the stand-ins
under DeepSpeed's module paths, so DeepSpeed unpickles its own classes from the
files zeroengine writes.
"""
from __future__ import annotations

import enum
import os
import pickle
import re
import zipfile
from dataclasses import dataclass

import torch

from ..files import CheckpointError, atomic_write

_LOSS_SCALER_MODULE = "deepspeed.runtime.fp16.loss_scaler"


class _Attributes:
    """An object whose state is its attributes (how DeepSpeed's loss scalers pickle)."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__


class LossScaler(_Attributes):
    """DeepSpeed's static loss scaler: ``cur_scale``, ``dynamic`` (False)."""


class DynamicLossScaler(_Attributes):
    """DeepSpeed's dynamic loss scaler: ``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_factor``,
    ``scale_window``, ``min_scale``, ``delayed_shift``, ``cur_hysteresis``, ``consecutive_hysteresis``,
    ``raise_error_at_min_scale``, ``dynamic`` (True), ``dtype``."""


class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclass
class fragment_address:  # noqa: N801 - DeepSpeed's name, which the files record
    """Where a parameter's slice lies in a rank's flat partition: ``numel`` elements from ``start``."""
    numel: int
    start: int


# stand-in -> the "module.name" DeepSpeed pickles it as
DEEPSPEED_NAMES: dict[type, str] = {
    LossScaler: f"{_LOSS_SCALER_MODULE}.LossScaler",
    DynamicLossScaler: f"{_LOSS_SCALER_MODULE}.DynamicLossScaler",
    ZeroStageEnum: "deepspeed.runtime.zero.config.ZeroStageEnum",
    fragment_address: "deepspeed.utils.tensor_fragment.fragment_address",
}
_ALLOWED = [(cls, name) for cls, name in DEEPSPEED_NAMES.items()]
_UNSUPPORTED_GLOBAL = re.compile(r"(?:GLOBAL|global) ([\w.]+)")


def load_deepspeed_file(path: str, mmap: bool = True):
    """``torch.load`` one DeepSpeed file as data: weights only, DeepSpeed's own types as stand-ins.

    Raises :class:`CheckpointError` naming the file for a missing, truncated or corrupted file, and naming the
    type for a pickle that holds anything else (nothing in the file is executed)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"DeepSpeed checkpoint file {path} is missing")
    try:
        with torch.serialization.safe_globals(_ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = _UNSUPPORTED_GLOBAL.search(str(err))
        what = f"type {found.group(1)}" if found else "an object"
        raise CheckpointError(f"refusing DeepSpeed checkpoint file {path}: it holds {what}, which is not among "
                              f"the types DeepSpeed 0.19 writes into checkpoints (plain containers, numbers, "
                              f"tensors, {', '.join(sorted(DEEPSPEED_NAMES.values()))}); loading it could run "
                              "code, so nothing was loaded") from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, ValueError) as err:
        size = os.path.getsize(path)
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path} ({size} bytes): it is truncated or "
                              f"corrupted ({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None


class _DeepSpeedPickler(pickle._Pickler):
    """Pickles each stand-in as a reference to DeepSpeed's class of that name (which need not be importable
    here); everything else as pickle does. The pure-Python pickler: only the small non-tensor part of a
    checkpoint goes through it (torch.save writes tensors' storages separately)."""

    def save_global(self, obj, name=None):
        qualified = DEEPSPEED_NAMES.get(obj)
        if qualified is None:
            return super().save_global(obj, name)
        module, _, attr = qualified.rpartition(".")
        if self.proto >= 4:
            self.save(module)
            self.save(attr)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{attr}\n".encode())
        self.memoize(obj)


class _PickleModule:
    """What ``torch.save(pickle_module=...)`` needs: a Pickler (and the protocol constant)."""
    Pickler = _DeepSpeedPickler
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
    Unpickler = pickle.Unpickler
    load = staticmethod(pickle.load)


def save_for_deepspeed(obj, path: str) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically (temporary name, fsync, rename), with the stand-ins pickled
    as DeepSpeed's classes."""
    atomic_write(path, lambda f: torch.save(obj, f, pickle_module=_PickleModule, pickle_protocol=2))
