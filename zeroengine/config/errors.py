"""ConfigError: the one exception a bad config produces.

Every problem is reported against a *key path* such as
``zero_optimization.offload_optimizer.device`` so that a user can find the
offending line in a config file without reading a traceback. Misspellings get
the closest valid key, because almost every unknown key in a real DeepSpeed
config is a typo of a valid one.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (dotted key path) and what."""

    key_path: str
    message: str

    def __str__(self) -> str:
        return f"{self.key_path}: {self.message}" if self.key_path else self.message


class ConfigError(Exception):
    """A config that zeroengine cannot run with.

    ``key_path`` is the dotted path of the first problem ("" when the problem is
    the config source itself, e.g. a file that is not valid JSON/HJSON);
    ``problems`` lists every problem found; ``source`` names the config file
    when there is one. ``str(error)`` gives one line per problem, each starting
    with its key path.
    """

    def __init__(self, key_path: str, message: str, *, source: Optional[str] = None):
        self._init([Problem(key_path, message)], source)

    @classmethod
    def from_problems(cls, problems: Sequence[Problem], *, source: Optional[str] = None) -> "ConfigError":
        if not problems:
            raise ValueError("ConfigError needs at least one problem")
        error = cls.__new__(cls)
        error._init(list(problems), source)
        return error

    def _init(self, problems: list, source: Optional[str]) -> None:
        self.problems = tuple(problems)
        self.key_path = problems[0].key_path
        self.source = source
        lines = [str(p) for p in self.problems]
        if source:
            lines.append(f"(in config file {source})")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        # Exceptions are pickled as cls(*args); ours rebuild from their problems instead,
        # so a ConfigError raised in a spawned rank reaches the parent intact.
        return (_rebuild, (type(self), self.problems, self.source))

    def with_source(self, source: Optional[str]) -> "ConfigError":
        """The same problems, attributed to the config file they came from."""
        if source is None or self.source is not None:
            return self
        return type(self).from_problems(self.problems, source=source)


def _rebuild(cls: type, problems: Sequence[Problem], source: Optional[str]) -> ConfigError:
    return cls.from_problems(problems, source=source)


def closest(word: str, candidates: Iterable[str]) -> Optional[str]:
    """The candidate a user most likely meant by ``word`` (case-insensitive), or None."""
    by_lower = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``"; did you mean 'X'?"`` for the closest candidate, or "" when none is close."""
    match = closest(word, candidates)
    return f"; did you mean '{match}'?" if match else ""


def join_path(*parts: object) -> str:
    """Dotted key path; list indices are written as ``betas[1]``."""
    path = ""
    for part in parts:
        if part == "" or part is None:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else str(part)
    return path


def describe(value: object) -> str:
    """A value as the user wrote it in JSON, with its JSON kind for non-scalars."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (list, tuple)):
        return f"a list {list(value)!r}"
    if isinstance(value, dict):
        return "an object"
    return repr(value)
