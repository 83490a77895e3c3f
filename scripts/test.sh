#!/usr/bin/env bash
# The test command (the README's and CI's): install, lint (ruff, rules in pyproject.toml), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
"$PY" -m ruff check .
exec "$PY" -m pytest -q -p no:cacheprovider tests "$@"
