"""load_config: from a file, a dict or a config object to a resolved ZeroEngineConfig.

The steps, in order, each in its own module:

1. read the source (every file is parsed as HJSON, a superset of JSON, so
   comments and trailing commas work in ``.json`` files too);
2. rewrite DeepSpeed's deprecated spellings (``legacy.py``);
3. drop switched-off DeepSpeed features zeroengine lacks, reject switched-on
   ones (``unsupported.py``);
4. resolve "auto" (``auto.py``; the batch keys in step 6);
5. validate against the models, translating pydantic errors (``translate.py``);
6. derive the batch sizes for the world size (``batch.py``).

Every failure is a ConfigError naming the key path and, for files, the file.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Union

import hjson

from .auto import resolve_auto
from .batch import resolve_batch, take_auto_batch_keys
from .errors import ConfigError
from .legacy import apply_legacy_keys, as_written
from .root import ZeroEngineConfig
from .translate import validate
from .unsupported import drop_unsupported_features

ConfigSource = Union[str, "os.PathLike[str]", Dict[str, Any], ZeroEngineConfig]


def load_config(source: ConfigSource, world_size: int = 1, hidden_size: Optional[int] = None) -> ZeroEngineConfig:
    """Load and resolve a config for a data-parallel world of ``world_size`` ranks.

    ``source``: path to a JSON/HJSON file, a dict, or a ZeroEngineConfig (which
    is re-resolved from the input it was built from, e.g. for another world
    size). ``hidden_size``: the model's hidden size, used to resolve "auto"
    bucket sizes; a config object keeps the one it was first resolved with.
    """
    _check_positive_int("world_size", world_size, allow_none=False)
    _check_positive_int("hidden_size", hidden_size, allow_none=True)
    origin = None
    if isinstance(source, ZeroEngineConfig):
        _refuse_changed(source)
        data = source._source_data if source._source_data is not None else source.model_dump(exclude_unset=True)
        if hidden_size is None:
            hidden_size = source._hidden_size
    elif isinstance(source, dict):
        data = source
    elif isinstance(source, (str, os.PathLike)):
        origin = os.fspath(source)
        data = read_config_file(origin)
    else:
        raise ConfigError("", "the config must be a path to a JSON/HJSON file, a dict or a ZeroEngineConfig, "
                              f"got {type(source).__name__}")
    try:
        return build_config(data, world_size, hidden_size)
    except ConfigError as error:
        raise error.with_source(origin) from None


def build_config(data: Dict[str, Any], world_size: int = 1, hidden_size: Optional[int] = None) -> ZeroEngineConfig:
    """Steps 2-6 of the module docstring on an already-parsed config (which is not modified)."""
    if not isinstance(data, dict):
        raise ConfigError("", f"the config must be a JSON object ({{...}}), got {type(data).__name__}")
    work = copy.deepcopy(data)
    moved = apply_legacy_keys(work)
    try:
        drop_unsupported_features(work)
        any_auto_batch = take_auto_batch_keys(work)
        resolve_auto(work, hidden_size)
        cfg = validate(ZeroEngineConfig, work)
    except ConfigError as error:
        raise as_written(error, moved) from None
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = resolve_batch(
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
        world_size, any_auto=any_auto_batch)
    cfg._source_data = copy.deepcopy(data)
    cfg._hidden_size = hidden_size
    cfg._built = cfg.model_dump()
    return cfg


def _refuse_changed(cfg: ZeroEngineConfig) -> None:
    """A config object is re-resolved from the input it was built from (for the world it meets), so a value
    assigned to it afterwards would be lost without a word: name it instead."""
    if cfg._built is None:
        return
    changed = _first_difference(cfg._built, cfg.model_dump(), "")
    if changed is not None:
        raise ConfigError(changed, "this config object was changed after it was loaded; zeroengine re-reads a "
                                   "config from the dict or file it was loaded from, so the change would be lost: "
                                   "change the dict or file and load it again")


def _first_difference(before: Any, after: Any, path: str) -> Optional[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after)):
            found = _first_difference(before.get(key), after.get(key), f"{path}.{key}" if path else key)
            if found is not None:
                return found
        return None
    return None if before == after else path


class _DuplicateKey(Exception):
    pass


def _reject_duplicates(pairs: list) -> dict:
    # JSON parsers keep the last of two equal keys; the first one would be silently ignored.
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _plain_json(text: str) -> Any:
    """``text`` read by Python's JSON parser, or None where it is not plain JSON (comments, HJSON)."""
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError:
        return None


def read_config_file(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """Parse a JSON or HJSON config file into a dict; ConfigError (with line and column) if malformed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        hint = "; to pass JSON text, pass json.loads(text) instead" if str(path).lstrip().startswith("{") else ""
        raise ConfigError("", f"config file not found: {path}{hint}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError("", f"cannot read config file {path}: {error}") from None
    if not _as_strict_json(text).strip():  # nothing but whitespace and comments
        raise ConfigError("", f"config file {path} is empty (nothing but whitespace and comments): it must hold "
                              "a JSON object ({...})")
    try:
        data = _plain_json(text)  # Python's JSON (DeepSpeed's reader): Infinity too, which hjson reads as a key
        if data is None:
            data = hjson.loads(text, object_pairs_hook=_reject_duplicates)
    except hjson.HjsonDecodeError as error:
        raise _malformed(path, text, error) from None
    except (IndexError, ValueError) as error:  # hjson's own failures on some inputs (an unclosed /* comment)
        strict = _strict_json_account(text)
        if strict is None:
            raise ConfigError("", f"{path}: malformed JSON/HJSON ({type(error).__name__}: {error})") from None
        unclosed = " (a /* comment is never closed)" if text.count("/*") > text.count("*/") else ""
        raise ConfigError("", f"{path}, {strict[0]}: malformed JSON/HJSON: {strict[1]}{unclosed}") from None
    except _DuplicateKey as error:
        raise ConfigError("", f"{path}: key '{error.args[0]}' appears twice in the same object; "
                              "remove one of them") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: the config must be a JSON object ({{...}}), got {type(data).__name__}")
    return data


def _malformed(path: Path, text: str, error: "hjson.HjsonDecodeError") -> ConfigError:
    """Where a file fails to parse. A typo in plain JSON (``tru``, ``True``) reads to hjson as an unquoted
    string running on, so it fails only at the end of the file. There JSON's own parser is asked too (on
    the text with comments and trailing commas blanked: :func:`_as_strict_json`), and both answers are
    given: JSON's first for a ``.json`` file (it names the typo's place), hjson's first otherwise (JSON
    would stop at the first other hjson-only syntax, such as an unquoted key)."""
    # error.msg can be an unformatted template ("Invalid control character %r at"); str(error) is formatted
    hjson_at, hjson_says = f"line {error.lineno}, column {error.colno}", str(error).rsplit(": line ", 1)[0]
    if error.pos < len(text.rstrip()):
        return ConfigError("", f"{path}, {hjson_at}: malformed JSON/HJSON: {hjson_says}")
    strict = _strict_json_account(text)
    if strict is None:
        return ConfigError("", f"{path}, {hjson_at}: malformed HJSON: {hjson_says}")
    json_at, json_says = strict
    if path.suffix.lower() == ".json":
        return ConfigError("", f"{path}, {json_at}: malformed JSON: {json_says} (read as HJSON: {hjson_at}: "
                               f"{hjson_says})")
    return ConfigError("", f"{path}, {hjson_at}: malformed HJSON: {hjson_says} (read as strict JSON: {json_at}: "
                           f"{json_says})")


def _strict_json_account(text: str) -> tuple[str, str] | None:
    """("line L, column C", message) where JSON's own parser fails on ``text`` read as strict JSON
    (:func:`_as_strict_json`), or None where it parses."""
    try:
        json.loads(_as_strict_json(text))
    except json.JSONDecodeError as strict:
        return f"line {strict.lineno}, column {strict.colno}", strict.msg
    return None


def _as_strict_json(text: str) -> str:
    """``text`` with what hjson allows and JSON does not blanked out, outside strings: comments (``#``,
    ``//``, ``/* */``) and trailing commas. Same length and line breaks, so JSON's line and column still
    point into the file."""
    out, i, n = list(text), 0, len(text)
    last_comma = None  # index of a comma with only blanks (or blanked comments) after it so far

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i, last_comma = j + 1, None
        elif c == "#" or text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        else:
            if c in "}]" and last_comma is not None:
                out[last_comma] = " "
            if not c.isspace():
                last_comma = i if c == "," else None
            i += 1
    return "".join(out)


def _check_positive_int(name: str, value: Any, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, f"load_config({name}=...) must be a positive int, got {value!r}")
