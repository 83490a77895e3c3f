#!/usr/bin/env bash
# Download the wheels the lent GPU machines' image lacks (it has torch 2.11, ninja, psutil and py-cpuinfo,
# but not pydantic or hjson, and cannot reach a package index) into .gpu_wheels/ (git-ignored), for
# Python 3.12 on x86_64, and DeepSpeed 0.19.8 into .gpu_deepspeed/. Carry both with the device call;
# benchmarks/gpu_session.sh installs the wheels and puts DeepSpeed where gpu_worker.py finds it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .gpu_wheels "pydantic>=2,<3" hjson
ls .gpu_wheels
# DeepSpeed 0.19.8 for bench_gpu's side-by-side rows (pure Python; its ops JIT-build there), without __pycache__
if [ ! -d .gpu_deepspeed ]; then
  DS_BUILD_OPS=0 "$PY" -m pip install --quiet --no-deps --no-compile --target .gpu_deepspeed deepspeed==0.19.8
  rm -rf .gpu_deepspeed/bin
fi
