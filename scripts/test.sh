#!/usr/bin/env bash
# The test command (the README's and CI's): install, lint (ruff, rules in pyproject.toml), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
"$PY" -m ruff check .
# Two pytest workers (ZEROENGINE_TEST_WORKERS; 0 runs in one process), each taking whole files: the suite's
# processes leave a core idle much of the time (a rank waiting on a deadline, one process importing transformers),
# which the other worker uses; 1,357 s in one process, 1,147 s in two, on 2 cores. Whole files, because the
# integration modules start all their runs from a module fixture; in collection order (--no-loadscope-reorder), which
# tests/conftest.py makes longest first.
exec "$PY" -m pytest -q -p no:cacheprovider -n "${ZEROENGINE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  tests "$@"
