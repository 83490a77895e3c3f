#!/usr/bin/env bash
# The main job: install, then train the example GPT on 2 processes through the launcher.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
CKPT=${ZE_EXAMPLE_CHECKPOINT_DIR:-$(mktemp -d)/example_gpt}
"$PY" -m zeroengine.launcher.main --num_procs 2 examples/gpt/train.py \
  --zeroengine_config examples/gpt/config.json --save_dir "$CKPT" "$@"
# The sharded checkpoint it saved, consolidated into one plain fp32 state_dict.
"$PY" -m zeroengine.checkpoint.consolidate "$CKPT" "$CKPT/model_fp32.pt"
