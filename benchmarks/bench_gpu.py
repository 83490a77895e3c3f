"""One GPU: GPT throughput (tokens/s, model TFLOP/s) per ZeRO stage, precision and offload, and the largest
GPT that trains.

    python benchmarks/bench_gpu.py [--models 350m,1.3b] [--quick] [--largest] [--out FILE]

Each run is a fresh single-rank process (RANK=0, WORLD_SIZE=1, NCCL) running
benchmarks/gpu_worker.py: GPT from examples/gpt/model.py built on the GPU,
sequence 2048, vocabulary 50304, AdamW, gradient clipping 1.0; ``--warmup``
untimed steps, then the median of ``--steps`` timed steps (forward, backward,
optimizer step, synchronised). Model TFLOP/s counts 6 FLOPs per weight per
token plus causal attention (see gpu_worker.flops_per_token); the ratio to the
GPU's dense bf16 peak (989 TFLOP/s for an H100 SXM, from its datasheet) and to
a measured 8192³ bf16 matmul in the same run are both reported.

``--largest`` grows the model (depth at width 4096, sequence 1024, micro batch 1)
under stage 3 with and without optimizer offload through the depths given until
a run fails, and reports the largest that trained a few steps with a finite loss.
Offloaded runs build the model under zero.Init on the GPU with the slices in CPU
memory (the fp32 model never sits on the GPU whole) and offload the share of the
optimizer state the host can hold (``--offload_ratio auto``; the rest steps on
the GPU: partial offload, offload_optimizer.ratio).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {  # GPT-3 paper shapes (heads of 64/128 dims, as flash attention likes)
    "tiny": dict(n_layer=2, n_embd=256, n_head=4, block_size=256, vocab_size=50304),
    "350m": dict(n_layer=24, n_embd=1024, n_head=16, block_size=2048, vocab_size=50304),
    "1.3b": dict(n_layer=24, n_embd=2048, n_head=16, block_size=2048, vocab_size=50304),
}
PEAK_BF16 = {"H100": 989.0, "H200": 989.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, os.path.join(HERE, "gpu_worker.py"), json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout:.0f}s"}
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {**spec, "error": f"exit {done.returncode}: " + " | ".join(tail)}
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def matmul_tflops() -> float:
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - start) / 1e12


def throughput_runs(models: list[str], micro: int) -> list[dict]:
    runs = []
    for name in models:
        for stage in (0, 1, 2, 3):
            runs.append({"name": name, "stage": stage, "dtype": "bf16"})
        runs.append({"name": name, "stage": 2, "dtype": "fp16"})
        for stage in (1, 2, 3):
            runs.append({"name": name, "stage": stage, "dtype": "bf16", "offload_optimizer": True})
        # partial optimizer offload (half the Adam state on the GPU), and parameters offloaded too
        runs.append({"name": name, "stage": 3, "dtype": "bf16", "offload_optimizer": True, "ratio": 0.5})
        runs.append({"name": name, "stage": 3, "dtype": "bf16", "offload_optimizer": True, "offload_param": True})
        for stage in (0, 3):  # engine.compile(): each block's forward under torch.compile
            runs.append({"name": name, "stage": stage, "dtype": "bf16", "compile": True})
        # stage 3 eager, each block's parameters gathered as one fetch (compile's grouping, without compiling)
        runs.append({"name": name, "stage": 3, "dtype": "bf16", "fetch_blocks": True})
        for stage in (0, 3):  # DeepSpeed 0.19.8 beside (gpu_worker: ZEROENGINE_DEEPSPEED_PATH), same model and config
            runs.append({"name": name, "stage": stage, "dtype": "bf16", "engine": "deepspeed"})
        runs.append({"name": name, "stage": 3, "dtype": "bf16", "offload_optimizer": True, "engine": "deepspeed"})
    for r in runs:
        r.update(model=MODELS[r["name"]], micro=micro)
    return runs


def run_label(spec: dict) -> str:
    """``name/s<stage>/<dtype>[/offload[@<ratio>]][/params][/compile][/blocks][/deepspeed]``, e.g. ``1.3b/s3/bf16/offload@0.5``: what
    ``--only`` matches against."""
    label = f"{spec['name']}/s{spec['stage']}/{spec['dtype']}"
    if spec.get("offload_optimizer"):
        ratio = spec.get("ratio", 1.0)
        label += "/offload" + ("" if ratio == 1.0 else f"@{ratio}")
    if spec.get("offload_param"):
        label += "/params"
    if spec.get("compile"):
        label += "/compile"
    if spec.get("fetch_blocks"):
        label += "/blocks"
    if spec.get("engine") == "deepspeed":
        label += "/deepspeed"
    return label


def select(runs: list[dict], only: str) -> list[dict]:
    """The runs whose label matches one of the comma-separated shell patterns in ``only`` (all when empty), in
    the patterns' order: a lease that ends early keeps the runs named first."""
    patterns = [p for p in only.split(",") if p]
    if not patterns:
        return runs
    chosen = [r for p in patterns for r in runs if fnmatch.fnmatchcase(run_label(r), p)]
    chosen = [r for i, r in enumerate(chosen) if all(r is not c for c in chosen[:i])]  # once, at its first pattern
    if not chosen:
        raise SystemExit(f"bench_gpu: --only {only!r} matches none of: " + ", ".join(run_label(r) for r in runs))
    return chosen


def largest_runs(layers: dict[bool, list[int]], offload_ratio="auto") -> list[dict]:
    runs = []
    for offload in (False, True):
        for n_layer in layers[offload]:
            run = {"name": f"w4096-L{n_layer}", "stage": 3, "dtype": "bf16", "offload_optimizer": offload,
                   "micro": 1, "model": dict(n_layer=n_layer, n_embd=4096, n_head=32, block_size=1024,
                                             vocab_size=50304)}
            if offload:
                run.update(init=True, ratio=offload_ratio)
            runs.append(run)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="350m,1.3b")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the tiny model only (smoke test)")
    parser.add_argument("--largest", action="store_true", help="search the largest trainable GPT instead")
    parser.add_argument("--layers", default="8,16,20,24", help="--largest: depths tried without offload")
    parser.add_argument("--offload_layers", default="16,32,40,44,48,52",
                        help="--largest: depths tried with offload")
    parser.add_argument("--offload_ratio", default="auto",
                        help="--largest: offload_optimizer.ratio of the offloaded runs (a number, or auto)")
    parser.add_argument("--only", default="", help="comma list of shell patterns over run labels "
                        "(name/s<stage>/<dtype>[/offload[ratio]][/params], e.g. '1.3b/s0/*,*/s3/bf16/offload'); "
                        "default: every run")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu.json"))
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here", file=sys.stderr)
        return 1
    gpu = torch.cuda.get_device_name()
    measured_peak = matmul_tflops()
    torch.cuda.empty_cache()
    datasheet = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    if args.largest:
        ratio = args.offload_ratio if args.offload_ratio == "auto" else float(args.offload_ratio)
        runs = largest_runs({False: [int(n) for n in args.layers.split(",")],
                             True: [int(n) for n in args.offload_layers.split(",")]}, ratio)
    else:
        runs = throughput_runs(["tiny"] if args.quick else args.models.split(","), 2 if args.quick else args.micro)
    runs = select(runs, args.only)
    results, failed_at = [], {}
    for spec in runs:
        spec.update(warmup=args.warmup, steps=args.steps)
        key = (spec.get("offload_optimizer", False),)
        if args.largest and key in failed_at:
            continue  # a smaller model of this kind already failed
        result = run_one(spec, args.timeout)
        if "model_tflops" in result:
            result["mfu_datasheet"] = result["model_tflops"] / datasheet if datasheet else None
            result["mfu_measured_matmul"] = result["model_tflops"] / measured_peak
        results.append(result)
        _print_row(result)
        _write(args.out, {"gpu": gpu, "partial": True, "runs": results})
        if args.largest and ("error" in result or not result.get("finite")):
            failed_at[key] = spec["name"]
    report = {"gpu": gpu, "torch": torch.__version__, "matmul_bf16_tflops": measured_peak,
              "datasheet_bf16_tflops": datasheet, "runs": results}
    if args.largest:
        report["largest"] = {
            ("offload" if off else "no_offload"): max((r for r in results if r.get("finite") and
                                                       r.get("offload_optimizer", False) == off),
                                                      key=lambda r: r["params"], default=None)
            for off in (False, True)}
        for kind, best in report["largest"].items():
            print(f"largest trained ({kind}): " + (f"{best['params'] / 1e9:.2f}B params ({best['name']})"
                                                   if best else "none"))
    _write(args.out, report)
    print(f"{gpu}: measured bf16 matmul {measured_peak:.0f} TFLOP/s; wrote {args.out}")
    return 0


def _write(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _print_row(r: dict) -> None:
    what = f"{run_label(r):>28}" + (f" (ratio {r['ratio_used']})" if "ratio_used" in r else "")
    if "error" in r:
        print(f"{what} | {r['error'][:150]}", flush=True)
        return
    mfu = f"{100 * r['mfu_datasheet']:.1f}%" if r.get("mfu_datasheet") else "-"
    print(f"{what} | {r['params'] / 1e6:8.0f}M | {r['tokens_per_s']:9.0f} tok/s | {r['model_tflops']:6.1f} TFLOP/s "
          f"| MFU {mfu} | peak {r['peak_gpu_gib']:.1f} GiB | loss {r['losses'][0]:.3f}->{r['losses'][-1]:.3f}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
