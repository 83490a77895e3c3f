"""NVMe offload: the host memory it saves, the time the swap costs, and the I/O op against fio.

    python benchmarks/bench_nvme.py [--dir PATH] [--layers 12] [--hidden 1024] [--steps 2]
                                    [--skip_io] [--quick] [--out benchmarks/results/nvme.json]

Parts (one JSON):

- ``memory``: a GPT (``--layers`` x ``--hidden``, vocabulary ``--vocab``: 24 x 768 x 2048 is 172M parameters)
  built under ``zero.Init`` and trained ``--steps`` steps on one rank at ZeRO stage 3 in bf16, in a fresh
  process per mode: ``cpu`` (both offloads to host memory) and ``nvme`` (both to swap files under ``--dir``),
  with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB in both (freed transients leave the heap). Per mode: the
  peak resident memory growth of the process from before the model is built (getrusage's ru_maxrss against
  the resident size then), per parameter; ``memory_breakdown()`` after the last step; step times.
- ``swap``: from the NVMe run, the seconds the step spent waiting for the drive (reads the next bucket did not
  have ready, writes a slot had to finish) and the bytes moved, against the step time.
- ``io``: the async I/O op's read and write bandwidth on one file (``--io_mb``) against fio at the same block
  size and queue depth on the same file system (``--ioengine=libaio --iodepth=Q``, and ``psync`` with Q jobs),
  when fio is installed (``apt-get install fio``); the op's share of the better fio figure.

``--quick``: a 2-layer, hidden-64 model, one step, a 16 MiB file measured once (the smoke test's shape; numbers
meaningless).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _config(mode: str, swap_dir: str, bucket: int) -> dict:
    offload = {"device": "cpu"} if mode == "cpu" else {"device": "nvme", "nvme_path": swap_dir}
    optimizer = dict(offload, **({"buffer_count": 2, "pipeline_read": True, "pipeline_write": True}
                                 if mode == "nvme" else {}))
    param = dict(offload, **({"max_in_cpu": 0, "buffer_count": 4} if mode == "nvme" else {}))
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": bucket, "stage3_prefetch_bucket_size": bucket,
                              "stage3_max_live_parameters": 4 * bucket, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": optimizer, "offload_param": param},
    }


def worker(args) -> dict:
    """One mode in this process: build, train, measure (printed as JSON on the last line)."""
    import torch
    from model import GPT, GPTConfig

    import zeroengine

    torch.manual_seed(0)
    cfg = _config(args.worker, args.dir, args.bucket)
    shape = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=max(1, args.hidden // 64),
                      n_embd=args.hidden)
    before = _rss_bytes()
    with zeroengine.zero.Init(config=cfg, remote_device=args.worker):
        model = GPT(shape)
    built = _rss_bytes()
    params = sum(info_numel(p) for p in model.parameters())
    engine, _, _, _ = zeroengine.initialize(model=model, config=cfg)
    initialized = _rss_bytes()
    swappers = _swappers(engine)
    times = []
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        x = torch.randint(args.vocab, (1, args.seq), generator=g)
        start = time.perf_counter()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    breakdown = engine.memory_breakdown()
    swap = {name: dict(s.stats) for name, s in swappers.items()}
    engine.destroy()
    return {"mode": args.worker, "params": params, "rss_before": before, "rss_built": built,
            "rss_initialized": initialized, "peak_rss": peak, "growth_per_param": (peak - before) / params,
            "step_s": times, "loss": float(loss), "memory_breakdown": breakdown, "swap": swap}


def info_numel(p) -> int:
    from zeroengine.zero.param_guard import full_shape

    return full_shape(p).numel()


def _swappers(engine) -> dict:
    zero = engine.optimizer
    found = {}
    if getattr(zero, "swapper", None) is not None:
        found["optimizer"] = zero.swapper
    for name in ("flat_params", "frozen_params"):
        buffer = getattr(zero, name, None)
        if getattr(buffer, "swap", None) is not None:
            found[f"params ({name})"] = buffer.swap
    return found


def _run_mode(mode: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--dir", args.dir, "--layers",
           str(args.layers), "--hidden", str(args.hidden), "--steps", str(args.steps), "--seq", str(args.seq),
           "--vocab", str(args.vocab), "--bucket", str(args.bucket)]
    # glibc's mmap threshold fixed from the start (both modes): large transients go back to the OS when freed
    # instead of staying in the heap, so the peak measures what is held, not what the heap kept (docs/offload.md)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", MALLOC_MMAP_THRESHOLD_=str(args.mmap_threshold))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _io(args, folder: str) -> dict:
    import bench_aio

    io_args = argparse.Namespace(size_mb=args.io_mb, block_size=args.block_size, queue_depth=args.queue_depth,
                                 threads=1)
    path = os.path.join(folder, "io.bin")
    result = {"size_mb": args.io_mb, "block_size": args.block_size, "queue_depth": args.queue_depth,
              "file_system": bench_aio._fs_type(folder),
              "op": bench_aio._handle_rates("cpp", io_args, path, args.repeats)}
    fio = {}
    if shutil.which("fio") is not None:
        for engine in ("libaio", "psync"):
            fio[engine] = _fio(engine, args, path)
    result["fio"] = fio or None
    best = {}
    for mode in ("write", "read"):
        rates = [r[f"{mode}_GBps"] for r in fio.values() if r and f"{mode}_GBps" in r]
        if rates:
            best[mode] = result["op"][f"{mode}_GBps"] / max(rates)
    result["op_share_of_fio"] = best
    return result


def _fio(engine: str, args, path: str) -> dict:
    depth = ["--iodepth=%d" % args.queue_depth] if engine == "libaio" else ["--numjobs=%d" % args.queue_depth]
    out = {}
    for mode in ("write", "read"):
        best = 0.0
        for _ in range(args.repeats):
            done = subprocess.run(["fio", "--name=ze", f"--filename={path}", f"--rw={mode}", f"--bs={args.block_size}",
                                   f"--size={args.io_mb}m", f"--ioengine={engine}", "--direct=1", *depth,
                                   "--group_reporting", "--output-format=json"], capture_output=True, text=True)
            if done.returncode != 0:
                return {"error": done.stderr.strip()[-300:]}
            report = json.loads(done.stdout[done.stdout.index("{"):])
            best = max(best, report["jobs"][0][mode]["bw_bytes"] / 1e9)
        out[f"{mode}_GBps"] = best
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="the drive to swap to (default: a temporary folder)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=2_000_000, help="reduce_bucket_size: the swap's unit")
    parser.add_argument("--io_mb", type=int, default=1024)
    parser.add_argument("--block_size", type=int, default=1 << 20)
    parser.add_argument("--queue_depth", type=int, default=8)
    parser.add_argument("--mmap_threshold", type=int, default=1 << 20, help="MALLOC_MMAP_THRESHOLD_ of the runs")
    parser.add_argument("--repeats", type=int, default=3, help="I/O measurements per row (the best is kept)")
    parser.add_argument("--skip_io", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=["cpu", "nvme"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "nvme.json"))
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args)))
        return 0
    if args.quick:
        args.layers, args.hidden, args.vocab, args.steps, args.io_mb, args.bucket = 2, 64, 64, 1, 16, 4096
        args.repeats = 1
    folder = tempfile.mkdtemp(prefix="ze_nvme_bench_", dir=args.dir)
    args.dir = folder
    try:
        runs = {mode: _run_mode(mode, args) for mode in ("cpu", "nvme")}
        nvme = runs["nvme"]
        waited = sum(s.get("wait_s", 0.0) for s in nvme["swap"].values())
        moved = sum(s["read_bytes"] + s["written_bytes"] for s in nvme["swap"].values())
        result = {
            "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "params": nvme["params"],
                      "bucket": args.bucket, "steps": args.steps, "dtype": "bf16", "stage": 3, "world": 1},
            "memory": runs,
            "growth_per_param": {mode: runs[mode]["growth_per_param"] for mode in runs},
            "swap": {"wait_s": waited, "bytes_moved": moved, "step_s": sum(nvme["step_s"]),
                     "wait_share_of_step": waited / sum(nvme["step_s"]),
                     "nvme_over_cpu_step_time": sum(nvme["step_s"]) / sum(runs["cpu"]["step_s"])},
            "io": None if args.skip_io else _io(args, folder),
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _print(result)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


def _print(result: dict) -> None:
    m = result["model"]
    print(f"GPT {m['layers']} x {m['hidden']}: {m['params'] / 1e6:.1f}M parameters, bf16, ZeRO 3, one rank, "
          f"{m['steps']} steps")
    print(f"{'mode':<6} {'peak growth':>12} {'per param':>10} {'step s':>8}")
    for mode, run in result["memory"].items():
        print(f"{mode:<6} {(run['peak_rss'] - run['rss_before']) / 2**20:>9.0f}MiB {run['growth_per_param']:>9.2f}B "
              f"{sum(run['step_s']) / len(run['step_s']):>8.2f}")
    s = result["swap"]
    print(f"swap: {s['bytes_moved'] / 1e9:.2f} GB moved, {s['wait_s']:.2f} s waited of {s['step_s']:.2f} s "
          f"({100 * s['wait_share_of_step']:.0f}%); NVMe/CPU step time {s['nvme_over_cpu_step_time']:.2f}")
    io = result["io"]
    if io is not None:
        print(f"I/O on {io['file_system']} ({io['size_mb']} MiB, block {io['block_size']}, depth {io['queue_depth']}): "
              f"op write {io['op']['write_GBps']:.2f} read {io['op']['read_GBps']:.2f} GB/s")
        for engine, rates in (io["fio"] or {}).items():
            if rates and "error" not in rates:
                print(f"  fio {engine}: write {rates['write_GBps']:.2f} read {rates['read_GBps']:.2f} GB/s")
        print(f"  op / best fio: {io['op_share_of_fio']}")


if __name__ == "__main__":
    sys.exit(main())
