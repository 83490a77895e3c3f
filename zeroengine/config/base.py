"""The strict pydantic base every config section derives from, and its field types.

Strictness is the point: DeepSpeed silently accepts ``"enabled": "yes"`` or a
misspelt key and trains with defaults the user never chose. Here every model
forbids unknown keys and validates in pydantic's strict mode, so a boolean
must be a JSON boolean and a number a JSON number.

Numbers: JSON has one number type and configs habitually write sizes in
scientific notation (``"reduce_bucket_size": 5e8``), which JSON parsers read as
a float. Integer fields therefore accept a float *that is a whole number* and
reject any other (``5.5``). Numeric *strings* such as ``"5e8"`` are rejected:
a quoted number is almost always a templating slip, and accepting strings would
also let a mistyped ``"auto"``-style placeholder through.
"""
from __future__ import annotations

from typing import Annotated, Any, Sequence

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError


class ConfigModel(BaseModel):
    """A config section: unknown keys are errors, values are strictly typed.

    Field names are the DeepSpeed key names, so a section's attributes read
    exactly like the JSON the user wrote.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _whole_number(value: Any) -> Any:
    """Turn a float that is a whole number (``5e8``) into an int; reject ``5.5``."""
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise ValueError(f"expected a whole number, got {value!r}")
    return value


Int = Annotated[int, BeforeValidator(_whole_number)]
PositiveInt = Annotated[Int, Field(gt=0)]
NonNegativeInt = Annotated[Int, Field(ge=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]


def rule_error(message: str, subpath: Sequence[str] = ()) -> PydanticCustomError:
    """An error for a rule spanning several keys, raised from a model validator.

    ``subpath`` names the key (relative to the model raising it) that the error
    is about, so the final ConfigError points at ``zero_optimization.offload_param``
    rather than at the whole ``zero_optimization`` block.
    """
    return PydanticCustomError("config_rule", "{message}", {"message": message, "subpath": tuple(subpath)})


def nested_problems_error(problems: list) -> PydanticCustomError:
    """Carry already-translated problems (with full key paths) out of a validator.

    Used where a section validates a free-form dict against a model chosen at
    run time (optimizer/scheduler ``params``, whose keys depend on ``type``).
    """
    message = "; ".join(str(p) for p in problems)
    return PydanticCustomError("config_nested", "{message}", {"message": message, "problems": list(problems)})
