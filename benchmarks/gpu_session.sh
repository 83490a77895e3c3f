#!/usr/bin/env bash
# Everything the open GPU work needs, in phases that each fit one 10-minute command on a lent
# GPU machine (no network there; torch 2.11 preinstalled). Run from the repository root:
#
#     bash benchmarks/gpu_session.sh PHASE        # PHASE: tests | kernels | throughput | largest | smoke | ...
#     DRY_RUN=1 bash benchmarks/gpu_session.sh long_context   # no GPU: the phase's tiny CPU dry run (~15 s)
#
# Results (JSON, logs, junit) go to $OUT when it is set, else benchmarks/results/gpu_session/.
# Before the first call, on a machine with network: `bash scripts/gpu_wheels.sh` puts the wheels
# the GPU image lacks (pydantic, hjson) in .gpu_wheels/ (git-ignored); carry that folder along.
# Each phase installs them and the package (offline, seconds) because a machine starts bare.
#
# Phases, in the order to run them (a session has 30 minutes of device time in all; times estimated):
#   tests       GPU tests and the CUDA kernel tests (JIT builds the CUDA ops first)      ~5 min
#   kernels     FusedAdam vs torch's fused AdamW; one MoE layer at FastMoE's shape, fp32 and bf16   ~4 min
#   throughput  the 1.3B GPT at stages 0-3 (bf16), stage 2 fp16, stage 3 with optimizer offload    ~7 min
#   largest     3.43B (24 layers at width 4096) without offload, 10.7B (52 layers) with offload    ~9 min
#   smoke       the tiny model through bench_gpu (checks the setup in ~1 min)
#   compile     issue 23 in one call: the no-sync test, then 350m and 1.3b (bf16) at stage 3 eager, compiled
#               (engine.compile) and with per-block fetches, and 1.3b stage 0 eager and compiled      ~8 min
#   moe         issue 24: the MoE layers at FastMoE's shape (4096 tokens, d 1024, ffn 4096, 64 experts, top-2),
#               fp32 and bf16: naive loop, zeroengine.MoE (modules, stacked), AutoEP's layer and its
#               grouped-GEMM bound (autoep-bound/autoep >= 0.5 in bf16 is the target; fp32 naive/ours >= 5);
#               then the AutoEP and MoE tests on the GPU's one rank                                ~5 min
#   parallel    issue 25: tensor and pipeline parallelism over NCCL: the one-rank paths on one GPU (a one-stage
#               PipelineModule through train_batch, GPT-2 through AutoTP's engine path, the vocabulary-parallel
#               loss), and tp=2 / pp=2 / interleaved pp=2 against the CPU reference on 2 GPUs, also with
#               messages above NCCL's 4 MiB buffer (issue 32: every schedule's order completes)   ~2 min
#   lease       one 15-minute lease in issue 38's priority order, each part bounded so the next still runs: the
#               ops built (timed), tests/gpu + the FusedAdam tests (correctness: no-sync, parallel one-rank paths,
#               offloads incl. NVMe, MoE kernels), then bench_gpu rows most wanted first: 1.3b stage 3 and 0, the
#               same with DeepSpeed 0.19.8 beside (carry .gpu_deepspeed: scripts/gpu_wheels.sh), 1.3b optimizer
#               offload, compiled, 350m compiled, DeepSpeed offloaded                                  ~9.5 min
#   long_context  issues 33/38: the longest sequence one GPU trains, Llama-3-8B-shaped (as many layers as the
#               host's memory holds the offloaded optimizer state for: --layers auto), ZeRO-3 + optimizer offload,
#               tiled MLP and loss, every layer checkpointed, hidden states offloaded to the host; lengths double
#               from 16K until out of memory, then bisect to 8K (ALST: 500K on an H100, 1.2M on an H200)   ~9 min
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:?usage: bash benchmarks/gpu_session.sh tests|kernels|throughput|largest|smoke|compile|moe|parallel|lease|long_context}
RESULTS=${OUT:-benchmarks/results/gpu_session}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
LIMIT=${PHASE_LIMIT_S:-560}  # stop a phase before the device's 600 s so what it wrote still comes back
DRY_RUN=${DRY_RUN:-0}  # 1: no GPU (long_context only): setup skips its GPU parts, the phase runs on the CPU
if [ "$DRY_RUN" = 1 ] && [ "$PHASE" != long_context ]; then
  echo "gpu_session: DRY_RUN=1 is for the long_context phase only" >&2
  exit 2
fi

setup() {
  if ! "$PY" -c "import pydantic, hjson" >/dev/null 2>&1; then
    if [ -d .gpu_wheels ]; then
      "$PY" -m pip install --quiet --no-index --find-links .gpu_wheels "pydantic>=2,<3" hjson
    else
      echo "gpu_session: pydantic/hjson missing and no .gpu_wheels/ (run scripts/gpu_wheels.sh and carry it)" >&2
      exit 2
    fi
  fi
  if [ "$DRY_RUN" = 1 ]; then  # the package runs from the checkout (the benchmark puts it on sys.path)
    echo "gpu_session: dry run: no package install, no nvidia-smi"
  else
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . >/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RESULTS/gpu.txt"
  fi
  "$PY" -c "import torch, zeroengine; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  if [ -d .gpu_deepspeed ]; then  # DeepSpeed 0.19.8 for the side-by-side rows (gpu_worker imports it from here)
    export ZEROENGINE_DEEPSPEED_PATH="$PWD/.gpu_deepspeed"
  fi
}

left() {  # seconds left of the phase's budget
  echo $((LIMIT - SECONDS))
}

setup
case "$PHASE" in
  tests)
    timeout "$(left)" "$PY" -m pytest -q -rs tests/gpu tests/unit/test_fused_adam.py tests/unit/test_moe_ops.py \
      tests/unit/test_op_builder.py tests/unit/test_activation_checkpointing_gpu.py tests/unit/test_cpu_adam.py --junitxml="$RESULTS/gpu_tests.xml" 2>&1 | tee "$RESULTS/gpu_tests.log" | tail -25
    ;;
  kernels)
    timeout 150 "$PY" benchmarks/bench_adam.py --device cuda --out "$RESULTS/adam_cuda.json" 2>&1 | tail -12
    for dtype in fp32 bf16; do
      timeout $(( $(left) / 2 )) "$PY" benchmarks/bench_moe.py --device cuda --dtype "$dtype" --tokens 4096 \
        --hidden 1024 --ffn 4096 --experts 64 --k 2 --a2a-worlds "" --out "$RESULTS/moe_cuda_$dtype.json" 2>&1 | tail -16
    done
    ;;
  throughput)
    timeout "$(left)" "$PY" benchmarks/bench_gpu.py --models 1.3b --timeout 150 \
      --only '1.3b/s0/bf16,1.3b/s1/bf16,1.3b/s2/bf16,1.3b/s3/bf16,1.3b/s2/fp16,1.3b/s3/bf16/offload' \
      --out "$RESULTS/gpu_throughput.json" 2>&1 | tail -12
    ;;
  largest)
    timeout "$(left)" "$PY" benchmarks/bench_gpu.py --largest --layers 24 --offload_layers 52 --timeout 420 \
      --out "$RESULTS/gpu_largest.json" 2>&1 | tail -8
    ;;
  compile)
    timeout 150 "$PY" -m pytest -q -rs tests/gpu/test_no_sync.py --junitxml="$RESULTS/no_sync.xml" 2>&1 \
      | tee "$RESULTS/no_sync.log" | tail -8
    timeout "$(left)" "$PY" benchmarks/bench_gpu.py --models 1.3b,350m --timeout 170 --warmup 3 --steps 5 \
      --only '1.3b/s3/bf16,1.3b/s0/bf16,1.3b/s3/bf16/compile,1.3b/s0/bf16/compile,350m/s3/bf16,350m/s3/bf16/blocks,350m/s3/bf16/compile' \
      --out "$RESULTS/gpu_compile.json" 2>&1 | tail -14
    ;;
  smoke)
    timeout "$(left)" "$PY" benchmarks/bench_gpu.py --quick --out "$RESULTS/gpu_quick.json" 2>&1 | tail -14
    ;;
  moe)
    for dtype in bf16 fp32; do
      timeout $(( $(left) / 3 )) "$PY" benchmarks/bench_moe.py --device cuda --dtype "$dtype" --tokens 4096 \
        --hidden 1024 --ffn 4096 --experts 64 --k 2 --a2a-worlds "" --skip-overhead \
        --candidates naive,zeroengine,ze-stacked,autoep,autoep-bound --out "$RESULTS/moe_issue24_$dtype.json" 2>&1 | tail -12
    done
    timeout "$(left)" "$PY" -m pytest -q -rs tests/unit/test_moe_ops.py tests/gpu -k "moe" \
      --junitxml="$RESULTS/moe_tests.xml" 2>&1 | tee "$RESULTS/moe_tests.log" | tail -8
    ;;
  parallel)
    timeout "$(left)" "$PY" -m pytest -q -rs tests/gpu/test_parallel_gpu.py --junitxml="$RESULTS/parallel.xml" 2>&1 \
      | tee "$RESULTS/parallel.log" | tail -10
    ;;
  lease)
    started=$SECONDS
    MAX_JOBS=16 timeout 200 "$PY" -m zeroengine.ops.build_all 2>&1 | tee "$RESULTS/ops.log" | tail -8
    echo "gpu_session: ops built in $((SECONDS - started))s"
    budget=$(( $(left) - 220 )); budget=$(( budget < 170 ? budget : 170 ))
    timeout "$budget" "$PY" -m pytest -q -rs --durations=12 tests/gpu tests/unit/test_fused_adam.py -k "not test_cuda_source_compiles" \
      --junitxml="$RESULTS/gpu_tests.xml" 2>&1 | tee "$RESULTS/gpu_tests.log" | tail -30
    timeout $(( $(left) - 5 )) "$PY" benchmarks/bench_gpu.py --models 1.3b,350m --warmup 2 --steps 4 --timeout 120 \
      --only '1.3b/s3/bf16,1.3b/s0/bf16,1.3b/s3/bf16/deepspeed,1.3b/s0/bf16/deepspeed,1.3b/s3/bf16/offload,1.3b/s3/bf16/compile,350m/s3/bf16/compile,1.3b/s3/bf16/offload/deepspeed' \
      --out "$RESULTS/gpu_lease.json" 2>&1 | tail -14
    ;;
  long_context)
    if [ "$DRY_RUN" = 1 ]; then
      timeout "$(left)" "$PY" benchmarks/bench_long_context_gpu.py --device cpu --preset tiny --start 256 \
        --granularity 256 --cpu-budget-mib 4 --time-limit 60 --out "$RESULTS/long_context_gpu.json" 2>&1 \
        | tee "$RESULTS/long_context_gpu.log" | tail -14
    else
      timeout "$(left)" "$PY" benchmarks/bench_long_context_gpu.py --preset llama3-8b --layers auto \
        --time-limit $(( $(left) - 30 )) --out "$RESULTS/long_context_gpu.json" 2>&1 \
        | tee "$RESULTS/long_context_gpu.log" | tail -24
    fi
    ;;
  *)
    echo "gpu_session: unknown phase $PHASE (tests|kernels|throughput|largest|smoke|compile|moe|parallel|lease|long_context)" >&2
    exit 2
    ;;
esac
status=${PIPESTATUS[0]}
echo "gpu_session: phase $PHASE ended with status $status after ${SECONDS}s; results in $RESULTS"
exit "$status"
