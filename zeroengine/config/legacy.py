"""DeepSpeed's deprecated and alternative spellings, rewritten to the current keys.

Old configs keep working: each spelling below is rewritten in the raw dict
before validation, so the models only know the current names. Giving both the
old and the new spelling is an error (which one would win is a guess).
The table ``LEGACY_KEYS`` also feeds the generated reference and the
"did you mean" suggestions.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple

from .errors import ConfigError, describe, join_path


class LegacyKey(NamedTuple):
    section: str   # dotted path of the object holding the key ("" = top level)
    old: str
    new: str       # the current key, as a dotted path from the top level
    note: str = ""


_ZERO = "zero_optimization"

LEGACY_KEYS: List[LegacyKey] = [
    LegacyKey("", "bfloat16", "bf16"),
    LegacyKey("", "csv_monitor", "monitor.csv"),
    LegacyKey("", "tensorboard", "monitor.tensorboard"),
    LegacyKey("", "zero_optimization", "zero_optimization.stage",
              "the old boolean form: true is stage 1, false stage 0"),
    LegacyKey(_ZERO, "stage3_gather_fp16_weights_on_model_save",
              "zero_optimization.stage3_gather_16bit_weights_on_model_save"),
    LegacyKey(_ZERO, "cpu_offload", "zero_optimization.offload_optimizer", "true is {\"device\": \"cpu\"}"),
    LegacyKey(_ZERO, "cpu_offload_params", "zero_optimization.offload_param", "true is {\"device\": \"cpu\"}"),
    LegacyKey(_ZERO, "cpu_offload_param", "zero_optimization.offload_param", "true is {\"device\": \"cpu\"}"),
    LegacyKey(_ZERO, "cpu_offload_use_pin_memory", "pin_memory", "of the offload blocks made by the two keys above"),
]

# DeepSpeed's ZeRO model also accepts its Python field names for the stage3_* keys
# (pydantic populate_by_name), so `"max_live_parameters": ...` works there too.
_FIELD_NAMES = ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")
LEGACY_KEYS += [LegacyKey(_ZERO, name, f"{_ZERO}.stage3_{name}", "DeepSpeed's field name for the same key")
                for name in _FIELD_NAMES]


def legacy_keys_at(section: str) -> List[str]:
    """Old spellings accepted directly under ``section`` (for suggestions)."""
    return [entry.old for entry in LEGACY_KEYS if entry.section == section]


def apply_legacy_keys(data: Dict[str, Any]) -> Dict[str, str]:
    """Rewrite old spellings in ``data`` (the raw top-level dict) in place. Returns the blocks moved, as
    {new path: the path the user wrote}, so errors inside them can name what the user wrote."""
    moved: Dict[str, str] = {}
    if "bfloat16" in data:
        moved["bf16"] = "bfloat16"
    _move(data, "", "bfloat16", data, "bf16")
    if "csv_monitor" in data or "tensorboard" in data:
        if data.get("monitor") is None:  # absent, or null: the top-level spellings fill it
            data["monitor"] = {}
        monitor = data["monitor"]
        if isinstance(monitor, dict):
            for old, new in (("csv_monitor", "csv"), ("tensorboard", "tensorboard")):
                if old in data:
                    moved[f"monitor.{new}"] = old
                _move(data, "", old, monitor, new, new_path=f"monitor.{new}")
    zero = data.get("zero_optimization")
    if isinstance(zero, bool):
        # DeepSpeed's first format: "zero_optimization": true meant stage 1.
        data["zero_optimization"] = {"stage": 1 if zero else 0}
    elif isinstance(zero, dict):
        _move(zero, "zero_optimization", "stage3_gather_fp16_weights_on_model_save",
              zero, "stage3_gather_16bit_weights_on_model_save")
        for name in _FIELD_NAMES:
            _move(zero, "zero_optimization", name, zero, f"stage3_{name}")
        _cpu_offload_flags(zero)
    return moved


def as_written(error: ConfigError, moved: Dict[str, str]) -> ConfigError:
    """``error`` with key paths inside moved blocks spelled as the user wrote them (``csv_monitor.x``, not
    ``monitor.csv.x``)."""
    def written(path: str) -> str:
        for new, old in moved.items():
            if path == new or path.startswith(new + "."):
                return old + path[len(new):]
        return path

    if not any(written(p.key_path) != p.key_path for p in error.problems):
        return error
    problems = [type(p)(written(p.key_path), p.message) for p in error.problems]
    return type(error).from_problems(problems, source=error.source)


def _move(src: dict, section: str, old: str, dst: dict, new: str, new_path: str = "") -> None:
    if old not in src:
        return
    new_path = new_path or join_path(section, new)
    if new in dst:
        raise ConfigError(new_path, f"given twice: as '{new_path}' and as its deprecated spelling "
                                    f"'{join_path(section, old)}'; keep only '{new_path}'")
    dst[new] = src.pop(old)


def _cpu_offload_flags(zero: dict) -> None:
    """``cpu_offload``, ``cpu_offload_param(s)``, ``cpu_offload_use_pin_memory`` → offload blocks."""
    made = []
    for old, block in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param"),
                       ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        path = join_path("zero_optimization", old)
        value = zero.pop(old)
        if value is None:  # DeepSpeed's default for these deprecated fields: not given
            continue
        enabled = _flag(value, path)
        if not enabled:
            continue
        if block in zero:
            raise ConfigError(join_path("zero_optimization", block),
                              f"given twice: as '{block}' and as the deprecated '{old}: true'; keep only '{block}'")
        zero[block] = {"device": "cpu"}
        made.append(block)
    if "cpu_offload_use_pin_memory" in zero:
        path = "zero_optimization.cpu_offload_use_pin_memory"
        pin = zero.pop("cpu_offload_use_pin_memory")
        pin = False if pin is None else _flag(pin, path)
        if pin and not made:
            raise ConfigError(path, "only applies with cpu_offload / cpu_offload_params: true; "
                                    "set pin_memory in offload_optimizer / offload_param instead")
        for block in made:
            zero[block]["pin_memory"] = pin


def _flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {describe(value)}")
    return value
