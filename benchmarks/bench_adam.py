"""Throughput of one Adam step over a large flat fp32 parameter, side by side.

    python benchmarks/bench_adam.py [--params 50000000] [--repeats 7] [--device cpu|cuda]
                                    [--simd avx2,avx512] [--threads N] [--lean] [--as-avx2-cpu]

CPU: zeroengine CPUAdam (C++ kernel, and its PyTorch fallback) vs
torch.optim.AdamW(foreach=True) vs AdamW(fused=True) vs DeepSpeedCPUAdam when
deepspeed is importable (e.g. PYTHONPATH=.deepspeed_anchor DS_ACCELERATOR=cpu;
its op JIT-builds during the warm-up, outside the timed repeats); and offload's
real step, CPUAdam writing the bf16 copy in the same pass vs torch's fused step
followed by a separate bf16 copy. CUDA: zeroengine FusedAdam vs the two torch AdamWs.

``--simd`` times the C++ kernel at each listed SIMD level in the same run (one
build per level: the level is part of the build hash, so the builds coexist),
e.g. the AVX2 path on an AVX-512 machine beside the AVX-512 one; levels this
CPU lacks are listed as skipped. Without it, the level the CPU would pick.
``--threads`` sets torch's thread count (the kernel follows it) and
OMP_NUM_THREADS for OpenMP runtimes loaded later (DeepSpeed's op).
``--lean`` adds the bf16-master steps (``bf16_master_weights_and_grads`` with
offload): a bf16 param and bf16 gradient with fp32 moments (22 bytes moved per
parameter) and with bf16 moments (``bf16_optimizer_states``, 14 bytes), beside
torch's fused AdamW on bf16 params (its moments bf16 as well, 14 bytes).
``--as-avx2-cpu`` runs every candidate as a CPU without AVX-512 would: torch's
kernels dispatched at AVX2 (ATEN_CPU_CAPABILITY=avx2, set by re-running this
script), the C++ kernel's AVX2 build, and DeepSpeed's op built with
``-D__AVX256__ -march=haswell`` in its own extensions folder. The instruction
streams are those of an AVX2-only CPU; the cores and memory are this machine's.

One flat parameter is how ZeRO hands an optimizer its partition. Each repeat
times every candidate once, in turn, so machine noise hits all of them alike;
the table shows medians. The same run measures the memory bandwidth the step
is bound by, as an in-place ``a.add_(b)`` (reads a and b, writes a: 12 bytes
per element, and like the Adam step it writes only what it has just read). An
fp32 Adam step moves 28 bytes per parameter (reads p, g, m, v; writes p, m, v),
so its bytes/s over that bandwidth is the fraction of the attainable rate
(it can pass 100%: torch's add_ itself does not quite saturate memory).
Ratios are of medians; ``..._paired`` is the median of the per-repeat ratios.
Results are printed and written to benchmarks/results/adam[_cuda].json.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ADAM_BYTES_PER_PARAM = 28
ADD_BYTES_PER_ELEMENT = 12
COPY_OUT = "zeroengine CPUAdam + bf16 copy-out"
TORCH_PLUS_COPY = "torch AdamW fused, then bf16 copy"
PEERS = ("torch AdamW foreach", "torch AdamW fused", "deepspeed DeepSpeedCPUAdam")  # what the kernel must beat
LEAN_MASTERS, LEAN_STATES, TORCH_BF16 = ("zeroengine CPUAdam bf16 masters", "zeroengine CPUAdam bf16 masters+moments",
                                         "torch AdamW fused, bf16 params+moments")
# Bytes a step moves per parameter, by row (the rest: ADAM_BYTES_PER_PARAM): bf16 param read and written, bf16
# gradient read, and the moments read and written (fp32 or bf16).
LEAN_BYTES = {LEAN_MASTERS: 2 + 2 + 2 + 16, LEAN_STATES: 2 + 2 + 2 + 8, TORCH_BF16: 2 + 2 + 2 + 8}


@contextlib.contextmanager
def forced_simd(level: str | None):
    """ZEROENGINE_SIMD=level while a CPUAdam loads its kernel (None: leave the variable as it is)."""
    from zeroengine.ops.cpu_features import SIMD_ENV

    before = os.environ.get(SIMD_ENV)
    if level is not None:
        os.environ[SIMD_ENV] = level
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SIMD_ENV, None)
        else:
            os.environ[SIMD_ENV] = before


def cpu_has(level: str) -> bool:
    from zeroengine.ops.cpu_features import SimdLevel, cpu_flags

    needs = {SimdLevel.AVX512: {"avx512f"}, SimdLevel.AVX2: {"avx2", "fma"}, SimdLevel.SCALAR: set()}
    return needs[SimdLevel(level)] <= cpu_flags()


def rerun_as_avx2_cpu() -> None:
    """Re-run this script with torch's kernel dispatch capped at AVX2 (read once, when torch loads). The C++
    kernel's level is ``--simd avx2``'s, set where it loads (forced_simd)."""
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"})


def deepspeed_as_avx2_cpu() -> None:
    """Build DeepSpeed's CPU Adam as on a CPU without AVX-512: its AVX256 path, no AVX-512 instructions."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    OpBuilder.simd_width = lambda self: "-D__AVX256__"
    OpBuilder.cpu_arch = lambda self: "-march=haswell"
    # torch's extension loader keys builds by name only: keep this build in a folder beside the native one's.
    native = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch_extensions")
    os.environ["TORCH_EXTENSIONS_DIR"] = native.rstrip("/") + "_avx2"


def lean_candidates(n: int, simd_levels: list[str | None]) -> dict[str, Callable[[], None] | str]:
    """The bf16-master steps (each on its own bf16 param with a bf16 gradient)."""
    from zeroengine.ops.adam import CPUAdam

    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def bf16_param() -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.randn(n).bfloat16())
        p.grad = (torch.randn(n) * 1e-3).bfloat16()
        return p

    found: dict[str, Callable[[], None] | str] = {}
    for level in simd_levels:
        if level is not None and not cpu_has(level):
            continue
        with forced_simd(level):
            masters = CPUAdam([bf16_param()], **hyper)
            states = CPUAdam([bf16_param()], **hyper, state_dtype=torch.bfloat16)
        found[f"{LEAN_MASTERS} ({masters.backend})"] = masters.step
        found[f"{LEAN_STATES} ({states.backend})"] = states.step
    found[TORCH_BF16] = torch.optim.AdamW([bf16_param()], **hyper, fused=True).step
    return found


def bytes_per_param(name: str) -> int:
    matching = [row for row in LEAN_BYTES if name.startswith(row)]  # the longest: one row name begins another
    return LEAN_BYTES[max(matching, key=len)] if matching else ADAM_BYTES_PER_PARAM


def candidates(param: torch.nn.Parameter, device: str, simd_levels: list[str | None],
               as_avx2_cpu: bool = False) -> dict[str, Callable[[], None] | str]:
    """Name -> one step (or, if it cannot run here, the reason why)."""
    from zeroengine.ops.adam import CPUAdam, FusedAdam

    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    found: dict[str, Callable[[], None] | str] = {}
    if device == "cpu":
        # Offload's real step: update the fp32 masters and produce the bf16 copy that goes back to the device.
        out16 = torch.empty(param.shape, dtype=torch.bfloat16)
        for level in simd_levels:
            if level is not None and not cpu_has(level):
                found[f"zeroengine CPUAdam (cpp-{level})"] = f"skipped: this CPU lacks {level}"
                continue
            with forced_simd(level):
                cpp = CPUAdam([param], **hyper)
                copying = CPUAdam([param], **hyper)
            found[f"zeroengine CPUAdam ({cpp.backend})"] = cpp.step
            found[f"{COPY_OUT} ({copying.backend})"] = functools.partial(copying.step_with_copy, {param: out16})
        found["zeroengine CPUAdam (torch fallback)"] = CPUAdam([param], **hyper, impl="torch").step
        torch_fused = torch.optim.AdamW([param], **hyper, fused=True)
        found[TORCH_PLUS_COPY] = lambda: (torch_fused.step(), out16.copy_(param))
    else:
        fused = FusedAdam([param], **hyper)
        found[f"zeroengine FusedAdam ({fused.backend})"] = fused.step
    found["torch AdamW foreach"] = torch.optim.AdamW([param], **hyper, foreach=True).step
    found["torch AdamW fused"] = torch.optim.AdamW([param], **hyper, fused=True).step
    if device == "cpu":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            if as_avx2_cpu:
                deepspeed_as_avx2_cpu()
            found["deepspeed DeepSpeedCPUAdam"] = DeepSpeedCPUAdam([param], **hyper).step
        except Exception as exc:  # not installed, or its op fails to build
            found["deepspeed DeepSpeedCPUAdam"] = f"unavailable: {str(exc).splitlines()[0][:100]}"
    return found


def timed(fn: Callable[[], None], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--simd", default=None,
                        help="comma-separated SIMD levels of the C++ kernel to time side by side, "
                             "e.g. avx2,avx512 (default: the one this CPU picks)")
    parser.add_argument("--threads", type=int, default=None, help="torch (and OpenMP) threads")
    parser.add_argument("--lean", action="store_true", help="add the bf16-master steps (CPU)")
    parser.add_argument("--as-avx2-cpu", action="store_true",
                        help="every candidate at AVX2, as on a CPU without AVX-512 (CPU only)")
    args = parser.parse_args()
    if args.as_avx2_cpu:
        if args.device != "cpu" or (args.simd and args.simd.strip().lower() != "avx2"):
            parser.error("--as-avx2-cpu times the CPU step at AVX2 only: drop --device cuda and --simd")
        rerun_as_avx2_cpu()
        args.simd = "avx2"
    device, n = args.device, args.params
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # DeepSpeed's op brings its own OpenMP pool
    load_before = os.getloadavg()  # other work on the machine skews every candidate, so record it
    simd_levels: list[str | None] = [None]
    if args.simd:
        from zeroengine.ops.cpu_features import SimdLevel

        simd_levels = [SimdLevel(level.strip().lower()).value for level in args.simd.split(",")]

    param = torch.nn.Parameter(torch.randn(n, device=device))
    param.grad = torch.randn(n, device=device) * 1e-3
    steps = candidates(param, device, simd_levels, as_avx2_cpu=args.as_avx2_cpu)
    if args.lean and device == "cpu":
        steps.update(lean_candidates(n, simd_levels))
    runnable = {name: fn for name, fn in steps.items() if callable(fn)}
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    runnable["memory: a.add_(b)"] = lambda: a.add_(b)

    for fn in runnable.values():  # warm-up: state allocation, lazy builds, page faults
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in runnable}
    for _ in range(args.repeats):
        for name, fn in runnable.items():
            times[name].append(timed(fn, device))

    bandwidth = ADD_BYTES_PER_ELEMENT * n / statistics.median(times.pop("memory: a.add_(b)"))
    rows = []
    for name, reason in steps.items():
        if not callable(reason):
            rows.append({"name": name, "skipped": reason})
            continue
        median = statistics.median(times[name])
        rate = bytes_per_param(name) * n / median
        rows.append({"name": name, "median_s": median, "steps_per_s": 1.0 / median, "bytes_per_param": bytes_per_param(name),
                     "params_per_s": n / median, "bytes_per_s": rate,
                     "fraction_of_bandwidth": rate / bandwidth, "times_s": times[name]})
    fastest_torch = min(r["median_s"] for r in rows
                        if r["name"].startswith("torch AdamW f") and r["name"] != TORCH_PLUS_COPY and "median_s" in r)
    median = {r["name"]: r["median_s"] for r in rows if "median_s" in r}
    peers = {name: t for name, t in median.items() if name in PEERS}
    fastest_peer = min(peers, key=peers.get)
    ratios = {}  # > 1: zeroengine's is faster (per-repeat timings interleaved, so noise hits both alike)
    for name in median:
        if not name.startswith("zeroengine CPUAdam (cpp-"):
            continue
        level = name.removeprefix("zeroengine CPUAdam (cpp-").rstrip(")")
        ratios[f"cpuadam_{level}_vs_torch_fused"] = median["torch AdamW fused"] / median[name]
        if "deepspeed DeepSpeedCPUAdam" in median:
            ratios[f"cpuadam_{level}_vs_deepspeed"] = median["deepspeed DeepSpeedCPUAdam"] / median[name]
        ratios[f"cpuadam_{level}_vs_fastest_peer"] = peers[fastest_peer] / median[name]
        # The median of each repeat's own ratio: a load that drifts during the run moves both sides of it alike.
        ratios[f"cpuadam_{level}_vs_fastest_peer_paired"] = statistics.median(
            peer / ours for peer, ours in zip(times[fastest_peer], times[name]))
        copy_name = f"{COPY_OUT} (cpp-{level})"
        if copy_name in median:
            ratios[f"copy_out_{level}_vs_torch_fused_plus_copy"] = median[TORCH_PLUS_COPY] / median[copy_name]
        lean_name = f"{LEAN_STATES} (cpp-{level})"
        if lean_name in median:  # the same bytes moved: bf16 params and moments both sides
            ratios[f"bf16_states_{level}_vs_torch_fused_bf16"] = median[TORCH_BF16] / median[lean_name]
            ratios[f"bf16_states_{level}_vs_fp32_masters"] = median[name] / median[lean_name]

    machine = {"platform": platform.platform(), "processor": platform.processor(),
               "torch": torch.__version__, "threads": torch.get_num_threads(), "device": device,
               "load_average": load_before, "as_avx2_cpu": args.as_avx2_cpu}
    if device == "cpu":
        machine["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        where = f"{machine['threads']} threads, torch kernels at {machine['torch_cpu_capability']}"
    else:
        machine["gpu"] = where = torch.cuda.get_device_name()
    print(f"Adam step over {n / 1e6:.0f}M fp32 params on {device} ({where}), "
          f"median of {args.repeats}; "
          f"memory bandwidth (a.add_(b)) {bandwidth / 1e9:.1f} GB/s")
    print(f"{'optimizer':<50} {'ms/step':>9} {'Mparam/s':>9} {'GB/s':>7} {'of bw':>6} {'vs best torch':>13}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['name']:<50} {r['skipped']}")
            continue
        print(f"{r['name']:<50} {r['median_s'] * 1e3:9.1f} {r['params_per_s'] / 1e6:9.0f} "
              f"{r['bytes_per_s'] / 1e9:7.1f} {r['fraction_of_bandwidth']:6.0%} "
              f"{fastest_torch / r['median_s']:12.2f}x")

    print(f"fastest peer: {fastest_peer}; load average before/after: "
          f"{' '.join(f'{x:.2f}' for x in machine['load_average'])} / "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    out = args.out or Path(__file__).parent / "results" / (
        "adam.json" if device == "cpu" else "adam_cuda.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    machine["load_average_after"] = os.getloadavg()
    out.write_text(json.dumps({"machine": machine, "params": n, "repeats": args.repeats,
                               "fastest_peer": fastest_peer,
                               "bytes_per_param": ADAM_BYTES_PER_PARAM,
                               "bandwidth_bytes_per_s": bandwidth, "ratios": ratios, "results": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
