#!/usr/bin/env bash
# The main job: install, then train the example GPT (byte-level, on the Python standard library's source) on 2
# processes through the launcher; it ends with a sample from the model, then the plot of its loss.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
CKPT=${ZE_EXAMPLE_CHECKPOINT_DIR:-$(mktemp -d)/example_gpt}
"$PY" -m zeroengine.launcher.main --num_procs 2 examples/gpt/train.py \
  --zeroengine_config examples/gpt/config.json --save_dir "$CKPT" "$@"
# The sharded checkpoint it saved, consolidated into one plain fp32 state_dict.
"$PY" -m zeroengine.checkpoint "$CKPT" "$CKPT/model_fp32.pt"
# The config's monitor section wrote runs/gpt/metrics.csv and a TensorBoard event file; draw the CSV.
# (install.sh brings matplotlib: the project's `example` extra.)
"$PY" -m zeroengine.monitor.plot runs/gpt -o runs/gpt/metrics.png
