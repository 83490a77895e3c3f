#!/usr/bin/env bash
# The main job: install, then train the example GPT on 2 processes through the launcher.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
exec "$PY" -m zeroengine.launcher.main --num_procs 2 examples/gpt/train.py \
  --zeroengine_config examples/gpt/config.json "$@"
