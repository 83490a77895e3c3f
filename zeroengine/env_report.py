"""``ze_report``: what this machine offers zeroengine, and the state of every JIT op."""
from __future__ import annotations

import argparse
import importlib
import math
import platform
import shutil
import sys

GREEN, RED, YELLOW, END = "\033[92m", "\033[91m", "\033[93m", "\033[0m"


def _ok(flag: bool, color: bool, width: int = 0) -> str:
    """``[OKAY]`` / ``[NO]``, padded to ``width`` before colouring (escape codes take no columns)."""
    word = ("[OKAY]" if flag else "[NO]").ljust(width)
    if not color:
        return word
    return f"{GREEN if flag else RED}{word}{END}"


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:
        return "not installed"


def cpu_simd_flags() -> list[str]:
    """SIMD features zeroengine's CPU kernels can use, as py-cpuinfo reports them."""
    try:
        import cpuinfo

        flags = set(cpuinfo.get_cpu_info().get("flags", []))
    except Exception:
        flags = set()
    wanted = ("avx512f", "avx512bw", "avx512_bf16", "avx2", "fma", "f16c", "sse4_2", "neon", "asimd")
    return [f for f in wanted if f in flags]


def collect() -> dict:
    import psutil
    import torch
    import torch.distributed as dist

    mem = psutil.virtual_memory()
    cuda = torch.cuda.is_available()
    report = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "zeroengine": _version("zeroengine"),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": psutil.cpu_count(logical=False),
        "cpu_threads": psutil.cpu_count(logical=True),
        "simd": cpu_simd_flags(),
        "memory_total_gib": round(mem.total / 2**30, 1),
        "memory_available_gib": round(mem.available / 2**30, 1),
        "ninja": shutil.which("ninja") is not None or _version("ninja") != "not installed",
        "compiler": shutil.which("c++") or shutil.which("g++"),
        "nvcc": shutil.which("nvcc"),
        "pydantic": _version("pydantic"),
        "as_deepspeed": as_deepspeed_status(),
        "ops": op_statuses(),
    }
    return report


def as_deepspeed_status() -> dict:
    """The ZEROENGINE_AS_DEEPSPEED switch: its start-up hook, whether this process asked for it and has it on,
    and the versions of the libraries it serves (docs/integrations.md)."""
    from zeroengine.integrations import as_deepspeed

    return {"hook": as_deepspeed.startup_hook_installed(), "requested": as_deepspeed.requested(),
            "active": as_deepspeed.active(), "reports_version": as_deepspeed.DEEPSPEED_VERSION,
            "transformers": _version("transformers"), "accelerate": _version("accelerate"),
            "pytorch_lightning": _version("pytorch_lightning")}


def op_statuses() -> list[dict]:
    try:
        from zeroengine.ops.registry import all_builders
    except ImportError as exc:
        return [{"name": "<registry>", "compatible": False, "reason": f"op registry unavailable: {exc}",
                 "built": False, "cache_path": None}]
    return [b.status() for b in all_builders()]


def _switch_line(switch: dict, color: bool) -> str:
    if switch["hook"] is None:
        return (f"{_ok(False, color)} start-up hook zeroengine_as_deepspeed.pth missing: ZEROENGINE_AS_DEEPSPEED=1 "
                "switches nothing (reinstall zeroengine)")
    state = "on in this process" if switch["active"] else "off (set ZEROENGINE_AS_DEEPSPEED=1 or zeroengine --as_deepspeed)"
    return f"{_ok(True, color)} {state}; reports deepspeed {switch['reports_version']}"


def render(report: dict, color: bool) -> str:
    lines = ["zeroengine environment report", "-" * 60]
    rows = [
        ("zeroengine", report["zeroengine"]),
        ("python", report["python"]),
        ("platform", report["platform"]),
        ("torch", f"{report['torch']} (cuda {report['torch_cuda'] or 'none'})"),
        ("pydantic", report["pydantic"]),
        ("CUDA devices", ", ".join(report["gpus"]) or "none"),
        ("gloo backend", _ok(report["gloo"], color)),
        ("nccl backend", _ok(report["nccl"], color)),
        ("CPU", f"{report['cpu']} ({report['cpu_cores']} cores, {report['cpu_threads']} threads)"),
        ("CPU SIMD", " ".join(report["simd"]) or "none detected"),
        ("memory", f"{report['memory_total_gib']} GiB total, {report['memory_available_gib']} GiB available"),
        ("ninja", _ok(report["ninja"], color)),
        ("C++ compiler", report["compiler"] or "not found"),
        ("nvcc", report["nvcc"] or "not found"),
        ("as_deepspeed", _switch_line(report["as_deepspeed"], color)),
        ("integrations", ", ".join(f"{name} {report['as_deepspeed'][name]}"
                                   for name in ("transformers", "accelerate", "pytorch_lightning"))),
    ]
    width = max(len(k) for k, _ in rows)
    lines += [f"{k.ljust(width)} : {v}" for k, v in rows]
    lines += ["-" * 60, "JIT ops", "-" * 60]
    ops = report["ops"]
    if not ops:
        lines.append("(no ops registered)")
    name_w = max([len(o["name"]) for o in ops] + [8])
    lines.append(f"{'op'.ljust(name_w)}  {'compatible':<12}{'built':<8}cache / reason")
    for op in ops:
        where = op.get("cache_path") if op.get("built") else op.get("reason") or op.get("cache_path") or ""
        if op.get("detail"):
            where = f"{where} ({op['detail']})" if where else op["detail"]
        lines.append(f"{op['name'].ljust(name_w)}  {_ok(op['compatible'], color, 12)}{_ok(op['built'], color, 8)}{where}")
    return "\n".join(lines)


def render_estimate(params: int, world: int, tp: int = 1, pp: int = 1) -> str:
    """Per-rank model-state memory for every stage and offload mode, in fp32 and 16-bit; ``world`` data-parallel
    ranks, each holding 1/(tp·pp) of the model."""
    import torch

    from zeroengine.estimate import estimate_memory

    gib = 2**30
    split = f", each holding 1/{tp * pp} of the model (tp {tp} × pp {pp})" if tp * pp > 1 else ""
    lines = [f"model states per rank: {params:,} parameters, {world} data-parallel ranks{split} (GiB, device + cpu)",
             f"{'stage':<7}{'offload':<18}{'fp32 device':>12}{'fp32 cpu':>10}{'16-bit device':>15}{'16-bit cpu':>12}"]
    for stage in range(4):
        modes = [("none", False, False)]
        if stage > 0:
            modes.append(("optimizer", True, False))
        if stage == 3:
            modes.append(("optimizer+param", True, True))
        for name, opt, par in modes:
            if (tp * pp > 1) and (stage == 3 or (stage == 2 and pp > 1)):
                continue  # not composed with tensor or pipeline parallelism (docs/parallelism.md)
            row = [estimate_memory(params, world, stage, opt, par, dtype, tensor_parallel_size=tp,
                                   pipeline_parallel_size=pp) for dtype in (torch.float32, torch.bfloat16)]
            lines.append(f"{stage:<7}{name:<18}{row[0]['device'] / gib:>12.2f}{row[0]['cpu'] / gib:>10.2f}"
                         f"{row[1]['device'] / gib:>15.2f}{row[1]['cpu'] / gib:>12.2f}")
    lines.append("activations, communication buckets and the allocator's slack come on top (docs/concepts.md, memory model)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ze_report", description="zeroengine environment check")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-color", action="store_true", help="plain text output")
    parser.add_argument("--estimate", type=float, metavar="MODEL_PARAMS",
                        help="instead of the environment, print per-rank memory for a model of this many "
                             "parameters (e.g. 1.3e9) at every stage and offload mode")
    parser.add_argument("--world", type=int, default=None,
                        help="with --estimate: data-parallel ranks (default 1); with --tp/--pp alone: the world "
                             "size whose process mesh to print")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (tensor_parallel.autotp_size)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel size (sequence_parallel_size)")
    args = parser.parse_args(argv)
    if args.tp < 1 or args.pp < 1 or args.sp < 1:
        parser.error("--tp, --pp and --sp must be positive")
    if args.estimate is None and (args.tp > 1 or args.pp > 1 or args.sp > 1):
        if args.world is None:
            parser.error("--tp/--pp/--sp print the process mesh of a world: give --world (all ranks)")
        from zeroengine.parallel.mesh import describe_layout

        try:
            print(describe_layout(args.world, pp=args.pp, tp=args.tp, sp=args.sp))
        except ValueError as error:
            parser.error(str(error))
        return 0
    if args.estimate is None:
        if args.world is not None:
            parser.error("--world goes with --estimate, or with --tp/--pp")
    else:
        world = 1 if args.world is None else args.world
        if not math.isfinite(args.estimate) or args.estimate < 1 or args.estimate != int(args.estimate) or world < 1:
            parser.error("--estimate needs a whole, positive parameter count (e.g. 1.3e9) and --world a positive "
                         "rank count")
        if args.json:
            parser.error("--json reports the environment; --estimate prints a table")
        print(render_estimate(int(args.estimate), world, tp=args.tp, pp=args.pp))
        return 0
    report = collect()
    if args.json:
        import json

        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report, color=sys.stdout.isatty() and not args.no_color))
    return 0


if __name__ == "__main__":
    sys.exit(main())
