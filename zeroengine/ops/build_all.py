"""Ahead-of-time build of every op this machine can build.

    python -m zeroengine.ops.build_all [--verbose]

Builds into the same cache that the JIT path uses (see cache.py), so a later
``load()`` finds the build and imports it without compiling. The install
hook in setup.py runs it: ``ZEROENGINE_BUILD_OPS=1 pip install -e .``.
"""
from __future__ import annotations

import argparse
import sys

from zeroengine.ops.builder import OpUnavailableError
from zeroengine.ops.registry import all_builders, format_status_table


def build_all(verbose: bool = False) -> list[dict]:
    """Build each compatible op; return every op's ``status()`` afterwards.

    An op that cannot be built here is skipped; one whose build fails has the
    failure as its status reason.
    """
    statuses = []
    for builder in all_builders():
        status = builder.status()
        if status["compatible"]:
            try:
                builder.load(verbose=verbose)
                status = builder.status()
            except OpUnavailableError as exc:
                status["reason"] = status["failure"] = exc.reason  # shown in the table instead of the cache
        statuses.append(status)
    return statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    statuses = build_all(verbose=args.verbose)
    print(format_status_table(statuses))
    # Fail only for ops that should have built: incompatibility is not an error.
    return 1 if any(s["compatible"] and not s["built"] for s in statuses) else 0


if __name__ == "__main__":
    sys.exit(main())
