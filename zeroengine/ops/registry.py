"""Every op zeroengine can build, for ``ze_report`` and ``build_all``."""
from __future__ import annotations

from zeroengine.ops.builder import OpBuilder
from zeroengine.ops.op_builders import (
    AsyncIOBuilder,
    CPUAdamBuilder,
    FusedAdamBuilder,
    MoEDispatchBuilder,
    MoEDispatchCUDABuilder,
)

_BUILDERS: tuple[type[OpBuilder], ...] = (CPUAdamBuilder, FusedAdamBuilder, MoEDispatchBuilder,
                                          MoEDispatchCUDABuilder, AsyncIOBuilder)


def all_builders() -> list[OpBuilder]:
    """A fresh builder for each op."""
    return [cls() for cls in _BUILDERS]


def get_builder(name: str) -> OpBuilder:
    for cls in _BUILDERS:
        if cls.NAME == name:
            return cls()
    known = ", ".join(cls.NAME for cls in _BUILDERS)
    raise KeyError(f"unknown op {name!r} (known: {known})")


def format_status_table(statuses: list[dict]) -> str:
    """Rows of ``OpBuilder.status()`` as an aligned text table."""
    header = ("op", "compatible", "built", "cache / reason")
    rows = [
        (
            s["name"],
            "yes" if s["compatible"] else "no",
            "yes" if s["built"] else "no",
            s["cache_path"] if s["compatible"] and not s.get("failure") else s["reason"],
        )
        for s in statuses
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
        for row in (header, *rows)
    ]
    return "\n".join(lines)
