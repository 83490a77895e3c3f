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
"$PY" -m zeroengine.checkpoint "$CKPT" "$CKPT/model_fp32.pt"
# The config's monitor section wrote runs/gpt/metrics.csv and a TensorBoard event file; draw the CSV.
if "$PY" -c "import matplotlib" 2>/dev/null; then
  "$PY" -m zeroengine.monitor.plot runs/gpt -o runs/gpt/metrics.png
else
  echo "runs/gpt/: metrics.csv and TensorBoard events written; pip install matplotlib, then ze_plot runs/gpt, to draw them"
fi
