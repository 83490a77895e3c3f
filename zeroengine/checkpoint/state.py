"""What a checkpoint records besides tensors: parameter names, RNG states, client_state rules."""
from __future__ import annotations

import random
import sys
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from .files import CheckpointError

if TYPE_CHECKING:
    from zeroengine.moe.checkpoint_places import StoredAs


def parameter_places(module: torch.nn.Module) -> dict[int, "StoredAs"]:
    """id(parameter) -> where its values are stored: a name (the first one, for a parameter shared under
    several names), and for stacked MoE experts an element offset into a larger stored tensor."""
    from zeroengine.moe.checkpoint_places import StoredAs, expert_checkpoint_places
    from zeroengine.tensor_parallel.layers import split_of

    from .tensor_split import piece_name

    places: dict[int, StoredAs] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        split = split_of(p)  # a tensor-parallel piece: stored under its own name (see tensor_split)
        places.setdefault(id(p), StoredAs(name if split is None else piece_name(name, split)))
    # expert parameters on different expert-parallel ranks share local names: use their global identity
    experts = expert_checkpoint_places(module)
    by_local = {place.name: pid for pid, place in places.items()}
    for local, place in experts.items():
        if local in by_local:
            places[by_local[local]] = place
    return places


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> the name its values are stored under (see :func:`parameter_places`)."""
    return {pid: place.name for pid, place in parameter_places(module).items()}


def stored_shape(place, p: torch.Tensor) -> list[int]:
    """The shape of the tensor ``p``'s values are stored in (its own, or a stacked expert's global one)."""
    from zeroengine.zero.param_guard import full_shape

    return list(place.shape) if place.shape is not None else list(full_shape(p))


def parameter_aliases(module: torch.nn.Module, names: dict[int, str]) -> dict[str, str]:
    """Every further name of a shared (tied) parameter -> the name its values are stored under."""
    return {name: names[id(p)] for name, p in module.named_parameters(remove_duplicate=False)
            if names[id(p)] != name}


# -- optimizer state that is not per element ---------------------------------
# Matrix-wise optimizers (Adafactor's row/column moments, SM3's accumulators) keep statistics of the whole
# parameter beside per-element state; each rank holding a piece has the same copy. A checkpoint keeps them whole
# under this key of each entry's state, and a load gives them to every piece of the parameter, whatever the
# partition (zeroengine/optim/partitioned.py: ``whole_parameter_state``).
WHOLE_PARAMETER = "whole_parameter"


def whole_parameter_keys(zero_optimizer) -> tuple[str, ...]:
    return tuple(getattr(getattr(zero_optimizer, "optimizer", zero_optimizer), "whole_parameter_state", ()))


# -- RNG ----------------------------------------------------------------------
def capture_rng() -> dict:
    state = {"torch": torch.get_rng_state(), "python": _plain(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # only when the user's code uses numpy; never imported here for nothing
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        for device, rng in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, device)
    if "numpy" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# -- client_state ---------------------------------------------------------------
# Exact types: a subclass (numpy.float64 is a float, an IntEnum an int, a namedtuple a tuple, a
# defaultdict a dict) would be pickled as its own class, which torch.load(weights_only=True) refuses.
_SCALARS = (str, int, float, bool, type(None), torch.Size, torch.dtype)
_CONTAINERS = (dict, OrderedDict, list, tuple)


def numbers_as_python(value):
    """``value`` with numpy scalars (``np.float64(0.02)``, as an lr computed with numpy often is) turned into
    the Python numbers they equal, through dicts, lists and tuples. For state the engine saves on the user's
    behalf (param groups, scheduler, loss scaler), which must load back with ``weights_only=True``."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic):
        return value.item()
    if type(value) in (dict, OrderedDict):
        return type(value)((key, numbers_as_python(item)) for key, item in value.items())
    if type(value) in (list, tuple):
        return type(value)(numbers_as_python(item) for item in value)
    return value


def check_plain(value, path: str = "client_state"):
    """Refuse anything ``torch.load(weights_only=True)`` could not read back: the checkpoint must stay data."""
    kind = type(value)
    if kind in _SCALARS or isinstance(value, torch.Tensor):
        return value
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in (str, int, float, bool, type(None)):
                raise CheckpointError(f"{path} has a key of type {type(key).__name__}; keys must be plain "
                                      "(str, int, float, bool, None)")
            check_plain(item, f"{path}[{key!r}]")
        return value
    if kind in (list, tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{path}[{i}]")
        return value
    plain = next((base for base in (*_SCALARS[:4], *_CONTAINERS) if isinstance(value, base)), None)
    if plain is not None:
        hint = f" (a subclass of {plain.__name__}: store {plain.__name__}(value) instead)"
    elif hasattr(value, "state_dict") or hasattr(value, "__dict__"):
        hint = " (save its state_dict() or vars() instead)"
    else:
        hint = ""
    raise CheckpointError(f"{path} is a {kind.__module__}.{kind.__name__}: a checkpoint holds only "
                          f"plain types (dict, list, tuple, str, int, float, bool, None) and tensors, so that "
                          f"loading it cannot run code{hint}")
