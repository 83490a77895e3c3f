"""Turn pydantic's ValidationError into ConfigError problems users can act on.

Users must never see a raw pydantic traceback: its messages name Python types
("valid dictionary or instance of ZeroConfig") and never suggest the key the
user meant. This module rewrites each error in config terms and, for an
unknown key, looks up the keys valid at that level to suggest the closest.
"""
from __future__ import annotations

import typing
from typing import Optional, Sequence, Type

from pydantic import BaseModel, ValidationError

from .base import nested_problems_error
from .errors import ConfigError, Problem, describe, did_you_mean, join_path
from .legacy import legacy_keys_at
from .unsupported import unsupported_keys_at

_KIND = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "a list",
    "tuple_type": "a list",
}

_BOUND = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def validate(model_cls: Type[BaseModel], data: object, *, prefix: Sequence[str] = ()) -> BaseModel:
    """``model_cls.model_validate(data)`` that raises ConfigError instead of ValidationError."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError.from_problems(problems_from(error, model_cls, prefix=prefix)) from None


def validate_given_keys(model_cls: Type[BaseModel], data: object, path: Sequence[str]) -> dict:
    """For use inside a validator: check ``data`` against ``model_cls`` and return only the keys given.

    Used where a free-form dict is checked against a model chosen at run time
    (optimizer/scheduler ``params``, whose valid keys depend on ``type``);
    problems are reported with full key paths starting at ``path``.
    """
    try:
        validated = model_cls.model_validate(data)
    except ValidationError as error:
        raise nested_problems_error(problems_from(error, model_cls, prefix=path)) from None
    return validated.model_dump(exclude_unset=True)


def problems_from(error: ValidationError, model_cls: Type[BaseModel], *, prefix: Sequence[str] = ()) -> list:
    """One Problem per pydantic error, in config terms, with full key paths."""
    problems: list = []
    for err in error.errors(include_url=False):
        ctx = err.get("ctx") or {}
        if err["type"] == "config_nested":
            problems.extend(ctx["problems"])
            continue
        loc = tuple(prefix) + tuple(err["loc"]) + tuple(ctx.get("subpath", ()))
        problems.append(Problem(join_path(*loc), _message(err, model_cls, tuple(err["loc"]), prefix)))
    # Unknown keys first: a typo usually explains the "missing" errors after it.
    problems.sort(key=lambda p: 0 if p.message.startswith("unknown key") else 1)
    return problems


def _message(err: dict, model_cls: Type[BaseModel], loc: tuple, prefix: Sequence[str]) -> str:
    kind, value = err["type"], err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        return _unknown_key(str(loc[-1]), model_cls, loc[:-1], prefix)
    if value == "auto" and kind not in ("config_rule", "missing"):
        return ("'auto' is not accepted for this key; give a concrete value "
                "('auto' is resolved only for the keys listed in docs/config-reference.md)")
    if kind == "missing":
        return "required key is missing"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", err["msg"]))
    if kind == "config_rule":
        return err["msg"]
    if kind in _KIND:
        return f"expected {_KIND[kind]}, got {describe(value)}"
    if kind in _BOUND:
        bound = next(iter(ctx.values()))
        return f"must be {_BOUND[kind]} {bound}, got {describe(value)}"
    if kind == "finite_number":
        return f"must be a finite number, got {describe(value)}"
    if kind == "literal_error":
        hint = did_you_mean(value, _literal_options(ctx)) if isinstance(value, str) else ""
        return f"must be one of {ctx.get('expected')}, got {describe(value)}{hint}"
    if kind in ("too_short", "too_long"):
        return f"expected {ctx.get('min_length', ctx.get('max_length'))} items, got {describe(value)}"
    return f"{err['msg']} (got {describe(value)})"


def _literal_options(ctx: dict) -> list:
    return [part.strip().strip("'") for part in str(ctx.get("expected", "")).replace(" or ", ", ").split(",")]


def _unknown_key(key: str, model_cls: Type[BaseModel], parent: tuple, prefix: Sequence[str]) -> str:
    section = model_at(model_cls, parent)
    fields = list(section.model_fields) if section is not None else []
    # Deprecated spellings and switched-off DeepSpeed features are valid here too.
    path = join_path(*prefix, *parent)
    hint = did_you_mean(key, fields + legacy_keys_at(path) + unsupported_keys_at(path))
    if hint:
        return f"unknown key{hint}"
    return f"unknown key (valid keys here: {', '.join(fields)})" if fields else "unknown key"


def model_at(model_cls: Type[BaseModel], loc: tuple) -> Optional[Type[BaseModel]]:
    """The config model found by following ``loc`` (field names) from ``model_cls``."""
    current: Optional[Type[BaseModel]] = model_cls
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        current = section_model(current.model_fields[part].annotation)
    return current


def section_model(annotation: object) -> Optional[Type[BaseModel]]:
    """The model class inside ``Model`` / ``Optional[Model]`` / ``Annotated[Model, ...]``, else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = section_model(arg)
        if found is not None:
            return found
    return None


