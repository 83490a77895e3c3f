"""The async I/O op's read and write bandwidth on one file, against fio (when installed) and dd, same block size.

    python benchmarks/bench_aio.py [--size_mb 1024] [--block_size 1048576] [--queue_depth 8] [--threads 1]
                                   [--dir PATH] [--out benchmarks/results/aio.json]

Rows (each the best of ``--repeats``, GB/s):

- ``op``: zeroengine.ops.aio.AsyncIOHandle on the C++ op, one request of the whole buffer (an O_DIRECT-aligned
  one: the file's pages never enter the page cache where the file system allows O_DIRECT);
- ``reference``: the same handle on the Python thread-pool reference (through the page cache);
- ``fio``: ``fio --ioengine=psync --direct=1 --bs=B --numjobs=queue_depth x threads`` on the same file, when fio is
  on PATH (the issue's yardstick: the op should reach 90% of it);
- ``dd``: ``dd bs=B oflag=direct`` / ``iflag=direct``: one request at a time, a floor.

Before every read the file's cached pages are dropped (fsync, then posix_fadvise DONTNEED), so a buffered read
measures the drive, not memory. Writes include the fsync. The file system under ``--dir`` decides what is
measured: on tmpfs O_DIRECT is refused and everything is a memory copy (the JSON says which file system).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fs_type(path: str) -> str:
    try:
        return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def _handle_rates(impl: str, args, path: str, repeats: int) -> dict:
    import torch

    from zeroengine.ops.aio import AsyncIOHandle, aligned_empty

    handle = AsyncIOHandle(args.block_size, args.queue_depth, False, False, args.threads, impl=impl)
    data = aligned_empty(args.size_mb << 20, torch.uint8)
    data.copy_(torch.randint(0, 256, (data.numel(),), dtype=torch.uint8))
    nbytes = data.numel()
    writes, reads = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        handle.sync_pwrite(data, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        writes.append(nbytes / (time.perf_counter() - start) / 1e9)
        _drop_cache(path)
        start = time.perf_counter()
        handle.sync_pread(data, path)
        reads.append(nbytes / (time.perf_counter() - start) / 1e9)
    return {"write_GBps": max(writes), "read_GBps": max(reads), "backend": handle.backend}


def _dd_rates(args, path: str, repeats: int) -> dict | None:
    if shutil.which("dd") is None:
        return None
    count = (args.size_mb << 20) // args.block_size
    out = {}
    for mode, flags in (("write", ["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"]),
                        ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):
        best = 0.0
        for _ in range(repeats):
            if mode == "read":
                _drop_cache(path)
            start = time.perf_counter()
            done = subprocess.run(["dd", f"bs={args.block_size}", f"count={count}", *flags], capture_output=True,
                                  text=True)
            seconds = time.perf_counter() - start
            if done.returncode != 0:  # e.g. O_DIRECT refused by the file system
                return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "dd failed"}
            best = max(best, count * args.block_size / seconds / 1e9)
        out[f"{mode}_GBps"] = best
    return out


def _fio_rates(args, path: str) -> dict | None:
    if shutil.which("fio") is None:
        return None
    out = {}
    jobs = max(1, args.queue_depth * args.threads)
    for mode in ("write", "read"):
        done = subprocess.run(["fio", "--name=ze", f"--filename={path}", f"--rw={mode}", f"--bs={args.block_size}",
                               f"--size={args.size_mb}m", "--ioengine=psync", "--direct=1", f"--numjobs={jobs}",
                               "--group_reporting", "--output-format=json"], capture_output=True, text=True)
        if done.returncode != 0:
            return {"error": done.stderr.strip()[-300:]}
        report = json.loads(done.stdout[done.stdout.index("{"):])
        out[f"{mode}_GBps"] = report["jobs"][0][mode]["bw_bytes"] / 1e9
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size_mb", type=int, default=1024)
    parser.add_argument("--block_size", type=int, default=1 << 20)
    parser.add_argument("--queue_depth", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the test file goes (default: a temporary folder)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "aio.json"))
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="ze_aio_bench_", dir=args.dir)
    path = os.path.join(folder, "file.bin")
    try:
        result = {"size_mb": args.size_mb, "block_size": args.block_size, "queue_depth": args.queue_depth,
                  "threads": args.threads, "file_system": _fs_type(folder),
                  "op": _handle_rates("cpp", args, path, args.repeats),
                  "reference": _handle_rates("python", args, path, args.repeats),
                  "dd": _dd_rates(args, path, args.repeats), "fio": _fio_rates(args, path)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{args.size_mb} MiB file on {result['file_system']}, block {args.block_size} B, "
          f"{args.queue_depth} x {args.threads} in flight")
    print(f"{'':<10} {'write GB/s':>11} {'read GB/s':>10}")
    for row in ("op", "reference", "fio", "dd"):
        rates = result[row]
        if rates is None:
            print(f"{row:<10} {'(not installed)':>22}")
        elif "error" in rates:
            error = " ".join(rates["error"].split())
            print(f"{row:<10} {error[:60]}")
        else:
            print(f"{row:<10} {rates['write_GBps']:>11.2f} {rates['read_GBps']:>10.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
