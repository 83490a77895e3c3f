#!/usr/bin/env bash
# Install zeroengine and what it needs into the current Python environment.
# torch is installed only when missing: 2.13.0 is the CPU build this project is
# developed on; any torch in [2.4, 2.15) (e.g. 2.11 on the GPU machines) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install] torch not found: installing torch==2.13.0"
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[test,example]"
# DeepSpeed 0.19.8, the side-by-side anchor of the DeepSpeed-checkpoint tests, in a folder of its own that only
# those tests' DeepSpeed processes put on their path: the package never imports it, and the other tests (and the
# ZEROENGINE_AS_DEEPSPEED alias) never see a real DeepSpeed. --no-deps: its torch is the one installed here.
ANCHOR=.deepspeed_anchor
if [ ! -f "$ANCHOR/deepspeed/__init__.py" ]; then
  echo "[install] DeepSpeed 0.19.8 (test anchor) into $ANCHOR"
  # (its other requirements - pydantic, hjson, py-cpuinfo, psutil, ninja, numpy, tqdm - are zeroengine's or the
  # test extra's already)
  "$PY" -m pip install --quiet --no-deps --target "$ANCHOR" "deepspeed==0.19.8" einops msgpack \
    || echo "[install] the DeepSpeed anchor did not install: its tests will fail, naming it"
fi
# The C++ ops, built now rather than at their first use (a training run's first step, or the test suite's):
# a failed build is reported here and the ops fall back at run time (ze_report says which).
"$PY" -m zeroengine.ops.build_all || echo "[install] some ops did not build; they fall back at run time (see ze_report)"
