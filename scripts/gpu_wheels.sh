#!/usr/bin/env bash
# Download the wheels the lent GPU machines' image lacks (it has torch 2.11, ninja, psutil and py-cpuinfo,
# but not pydantic or hjson, and cannot reach a package index) into .gpu_wheels/ (git-ignored), for
# Python 3.12 on x86_64. Carry .gpu_wheels with the device call; benchmarks/gpu_session.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .gpu_wheels "pydantic>=2,<3" hjson
ls .gpu_wheels
