"""One MoE layer, forward + backward, side by side; plus the dispatch/combine overhead alone and the
all-to-all dispatch on 2 and 4 ranks.

    python benchmarks/bench_moe.py [--tokens 4096] [--hidden 512] [--ffn 2048] [--experts 8,64] [--k 1,2]
                                   [--repeats 3] [--no-deepspeed] [--device cpu|cuda] [--quick]

Candidates, all dropless, all with the same expert MLP (hidden -> ffn -> hidden, GELU):

* ``floor``: one dense MLP over k x tokens rows (the expert FLOPs with no routing at all);
* ``naive``: a per-expert masking loop (for each expert: select its tokens with a boolean
  mask, run it, index-add the weighted result back);
* ``sort``: sort-based dispatch in plain PyTorch (argsort by expert, index_select, split,
  run, index_add with weights);
* ``zeroengine``: ``zeroengine.moe.MoE`` (fused permutation kernels, C++ on CPU / CUDA on GPU), default
  settings: per-expert modules, standard-MLP experts run as grouped GEMMs over weights stacked on
  the fly (``grouped="auto"``);
* ``ze-loop``: the same layer with ``grouped="off"`` (one call per expert, as before grouped GEMMs);
* ``ze-serial`` (overhead rows): the layer with ``local_experts.serial_below = 2 ** 16``, the small
  experts run with one intra-op thread (opt-in, for oversubscribed hosts; see zeroengine/moe/expert_group.py);
* ``ze-stacked``: ``expert_layout="stacked"`` (expert weights are stacked ``[E, ...]`` parameters:
  grouped GEMMs with no stacking copy); MLP rows only;
* ``deepspeed``: DeepSpeed's ``deepspeed.moe.layer.MoE`` (CPU accelerator), when importable;
* ``autoep`` (MLP rows): a Hugging Face-style MoE block (a Mixtral router: softmax, top-k, renormalised)
  around AutoEP's ``ShardedExperts`` at ``ep_size`` 1, over fused SwiGLU experts ``gate_up_proj
  [E, 2 ffn, hidden]``, ``down_proj [E, hidden, ffn]`` (3 GEMMs per expert, so compare it with
  ``autoep-bound``, not with the MLP rows); ``autoep-bound``: the same experts' grouped GEMMs on rows
  already sorted by expert, with the same per-expert counts and no routing, permutation or combine
  (``swiglu_rows``: ``torch._grouped_mm`` on CUDA), the grouped-GEMM bound issue 24 measures against.

Every candidate routes with the same gate weights (so the same tokens go to the same experts).
``traffic``: streaming the expert weights once forward and once backward plus writing their
gradients (see :class:`WeightTraffic`); ``bound`` = floor + traffic, what a layer costs at least
unless that traffic overlaps GEMM arithmetic (at 64 experts the weights are 512 MiB, far from
cache, and this is more than 5% of the floor).

``overhead`` rows repeat the same shapes with a near-zero-cost expert (one elementwise
scale), so what remains is routing, dispatch and combine, plus the router's GEMMs and the expert
calls themselves; the ``gate+experts`` row (:class:`GateAndExperts`) times just those two, and
``beyond gate+experts`` ratios subtract it. Every repeat times each
candidate once, in turn (machine noise hits all alike); tables show the median and
the best, and the JSON records the load average at start and end. ``a2a`` rows: ``zeroengine.moe.MoE`` with ``ep_size`` = world on 2 and 4 gloo
ranks (tokens per rank as above, the cheap expert), against the same layer with every
expert local on each rank. Results go to benchmarks/results/moe[_cuda].json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class Scale(nn.Module):
    """The near-zero-cost expert: one elementwise multiply (it still has a parameter and a gradient)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * self.w


def make_expert(kind: str, hidden: int, ffn: int) -> nn.Module:
    if kind == "cheap":
        return Scale(hidden)
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


class NaiveMoE(nn.Module):
    """Per-expert masking loop over the same gate."""

    def __init__(self, gate, experts):
        super().__init__()
        self.gate, self.experts = gate, experts

    def forward(self, x):
        r = self.gate(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, j = torch.nonzero(r.expert_index == e, as_tuple=True)
            y = expert(x[token]) * r.weights[token, j].unsqueeze(1).to(x.dtype)
            out = out.index_add(0, token, y)
        return out


class GateAndExperts(nn.Module):
    """The ``gate+experts`` row (overhead rows): what every candidate computes besides routing, dispatch
    and combine, forward and backward. The router's logits GEMM on the tokens, and each expert on as many
    rows as the routing gives it. Those rows are the expert's own leaf inputs (no gather, no combine), so
    the row also counts their input gradients. ``candidate - gate+experts`` is then what the candidate
    spends on softmax and top-k, moving rows to the experts and back, combining, and assembling x's
    gradient."""

    def __init__(self, gate, experts, counts: list[int], hidden: int):
        super().__init__()
        self.wg, self.experts = nn.Linear(hidden, gate.wg.weight.shape[0], bias=False), experts
        self.wg.weight.data.copy_(gate.wg.weight.data)
        self.rows = nn.ParameterList(nn.Parameter(torch.randn(c, hidden)) for c in counts)
        self.output_grads = None  # made on first use, then reused (as fwd_bwd reuses its gradient)

    def forward(self, x):
        return [_router_logits(x, self.wg.weight), *(expert(r) for expert, r in zip(self.experts, self.rows))]


def _router_logits(x, wg):
    """``x @ wg.T`` with the GEMMs zeroengine's layer uses for its router where it has them (the CPU small-row
    kernels: faster than MKL's at these skinny shapes), so the gate+experts row is no slower than what the
    layer itself spends there; ATen's elsewhere."""
    from zeroengine.ops.moe_dispatch import cpu_kernel

    kernel = cpu_kernel(x, "auto") if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if kernel is None or not kernel.small_gemm_enabled():
        return torch.nn.functional.linear(x, wg)
    return _KernelLogits.apply(x, wg, kernel)


class _KernelLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wg, kernel):
        ctx.save_for_backward(x, wg)
        ctx.kernel = kernel
        return kernel.router_logits(x.contiguous(), wg.contiguous())

    @staticmethod
    def backward(ctx, grad):
        x, wg = ctx.saved_tensors
        grad = grad.contiguous()
        return torch.mm(grad, wg), ctx.kernel.router_weight_grad(grad, x.contiguous()), None


class FusedSwiGLUExperts(nn.Module):
    """Experts in transformers 5's fused layout (what AutoEP converts)."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) * hidden ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn) * ffn ** -0.5)
        self.act_fn = nn.SiLU()


class HFStyleBlock(nn.Module):
    """A Mixtral-style sparse block: router (softmax, top-k, renormalised), then the experts module."""

    def __init__(self, gate, experts_module, k: int):
        super().__init__()
        self.weight = nn.Parameter(gate.wg.weight.detach().clone())
        self.experts, self.k = experts_module, k

    def forward(self, x):
        probs = torch.softmax(torch.nn.functional.linear(x, self.weight).float(), dim=-1)
        weights, index = torch.topk(probs, self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, index, weights)


class SwiGLUBound(nn.Module):
    """The same experts' grouped GEMMs on rows already sorted by expert (the per-expert counts the router
    gives): no routing, permutation or combine."""

    def __init__(self, experts_module, counts: list[int]):
        super().__init__()
        self.experts, self.counts = experts_module, counts

    def forward(self, x):
        from zeroengine.moe.autoep import swiglu_rows

        return swiglu_rows(x, self.counts, self.experts.gate_up_proj, self.experts.down_proj, self.experts.act_fn)


def autoep_rows(gate, x, experts: int, hidden: int, ffn: int, k: int) -> dict:
    from zeroengine.moe.autoep import ShardedExperts

    block = HFStyleBlock(gate, ShardedExperts(FusedSwiGLUExperts(experts, hidden, ffn), ep_size=1), k)
    with torch.no_grad():
        index = torch.topk(torch.nn.functional.linear(x, block.weight), k, dim=-1).indices
    counts = torch.bincount(index.reshape(-1), minlength=experts).tolist()
    bound = SwiGLUBound(FusedSwiGLUExperts(experts, hidden, ffn), counts)
    return {"autoep": (block, x), "autoep-bound": (bound, torch.randn(sum(counts), hidden))}


class SortMoE(nn.Module):
    """Sort-based dispatch in plain PyTorch over the same gate."""

    def __init__(self, gate, experts):
        super().__init__()
        self.gate, self.experts = gate, experts

    def forward(self, x):
        r = self.gate(x)
        tokens, k = r.expert_index.shape
        flat = r.expert_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        chunks = x.index_select(0, token).split(counts)
        y = torch.cat([expert(c) for expert, c in zip(self.experts, chunks)])
        y = y * r.weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)
        return torch.zeros_like(x).index_add(0, token, y)


def candidates(kind, tokens, hidden, ffn, experts, k, device, dtype, with_deepspeed, only=None):
    """name -> (module, input); the module maps [tokens, hidden] (the floor: [k*tokens, hidden])."""
    from zeroengine.moe import MoE, TopKGate

    torch.manual_seed(0)
    expert = make_expert(kind, hidden, ffn)
    x = torch.randn(tokens, hidden)
    gate = TopKGate(hidden, experts, k, drop_tokens=False)
    local = nn.ModuleList(make_expert(kind, hidden, ffn) for _ in range(experts))
    found = {}
    if kind == "mlp":
        found["floor"] = (make_expert(kind, hidden, ffn), torch.randn(k * tokens, hidden))
    found["naive"] = (NaiveMoE(gate, local), x)
    found["sort"] = (SortMoE(gate, local), x)
    found["zeroengine"] = (MoE(hidden, expert, num_experts=experts, k=k, drop_tokens=False), x)
    if kind == "cheap":
        counts = gate(x).exp_counts.tolist()  # the rows each expert gets (dropless: every assignment)
        found["gate+experts"] = (GateAndExperts(gate, nn.ModuleList(make_expert(kind, hidden, ffn)
                                                                    for _ in range(experts)), counts, hidden), x)
    if kind == "cheap":  # the same layer with the small experts single-threaded (serial_below, opt-in)
        serial = MoE(hidden, expert, num_experts=experts, k=k, drop_tokens=False)
        serial.local_experts.serial_below = 1 << 16
        found["ze-serial"] = (serial, x)
    if kind == "mlp":
        found["ze-loop"] = (MoE(hidden, expert, num_experts=experts, k=k, drop_tokens=False, grouped="off"), x)
        found["ze-stacked"] = (MoE(hidden, expert, num_experts=experts, k=k, drop_tokens=False,
                                   expert_layout="stacked"), x)
        found.update(autoep_rows(gate, x, experts, hidden, ffn, k))
    if with_deepspeed:
        try:
            from deepspeed.moe.layer import MoE as DSMoE

            ds = DSMoE(hidden, expert, num_experts=experts, ep_size=1, k=k, drop_tokens=False, use_rts=False)
            ds.set_deepspeed_parallelism()
            found["deepspeed"] = (ds, x)
        except Exception as exc:  # not installed, or it cannot run here
            found["deepspeed"] = f"unavailable: {type(exc).__name__}: {(str(exc) or '-').splitlines()[0][:100]}"
    # Same routing everywhere: every gate gets the shared gate's weights (a dropless layer's cost
    # depends on how evenly the tokens spread, DeepSpeed's on the fullest expert).
    for name, entry in found.items():
        module = entry[0] if isinstance(entry, tuple) else None
        router = getattr(module, "gate", None) or getattr(getattr(module, "deepspeed_moe", None), "gate", None)
        if router is not None and router is not gate:
            router.wg.weight.data.copy_(gate.wg.weight.data)
    out = {}
    for name, entry in found.items():
        if only and name not in only and name != "floor":
            continue
        if isinstance(entry, str):
            out[name] = entry
            continue
        module, inp = entry
        out[name] = (module.to(device=device, dtype=dtype), inp.to(device=device, dtype=dtype))
    return out


def fwd_bwd(module, x, grad):
    x = x.detach().requires_grad_()
    out = module(x)
    if isinstance(out, list):  # the gate+experts row: several outputs, each with its own gradient
        if module.output_grads is None:
            module.output_grads = [torch.randn_like(o) for o in out]
        torch.autograd.backward(out, module.output_grads)
        return
    if isinstance(out, tuple):  # zeroengine and DeepSpeed return (output, l_aux, exp_counts)
        out = out[0]
    out.backward(grad)


def timed(fn, device) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


class WeightTraffic:
    """What streaming the experts' weights costs on this machine: read every expert weight twice (forward,
    input gradient) and write a same-sized gradient once (into memory already mapped). A layer pays this
    on top of the floor (whose 2 weights stay in cache) unless the traffic overlaps GEMM arithmetic;
    ``floor + traffic`` is the ``bound`` column."""

    def __init__(self, experts, hidden, ffn, device, dtype):
        self.weights = [torch.ones(experts, ffn, hidden, device=device, dtype=dtype),
                        torch.ones(experts, hidden, ffn, device=device, dtype=dtype)]
        self.grads = [torch.zeros_like(w) for w in self.weights]

    def __call__(self):
        for w, g in zip(self.weights, self.grads):
            w.sum()
            w.sum()
            g.fill_(0.5)


def run_shape(kind, tokens, hidden, ffn, experts, k, repeats, device, dtype, with_deepspeed, only=None):
    cands = candidates(kind, tokens, hidden, ffn, experts, k, device, dtype, with_deepspeed, only)
    runnable = {n: c for n, c in cands.items() if not isinstance(c, str)}
    grads = {n: torch.randn(x.shape, device=device, dtype=dtype) for n, (_, x) in runnable.items()}
    jobs = {n: (lambda m=module, x=x, g=grads[n]: fwd_bwd(m, x, g), module) for n, (module, x) in runnable.items()}
    if kind == "mlp":
        jobs["traffic"] = (WeightTraffic(experts, hidden, ffn, device, dtype), None)
    times = {n: [] for n in jobs}
    for rep in range(repeats + 1):  # the first round warms up (allocator, kernel builds)
        for name, (fn, module) in jobs.items():
            t = timed(fn, device)
            if module is not None:
                module.zero_grad(set_to_none=True)
            if rep:
                times[name].append(t)
    rows = {n: {"median_s": statistics.median(t), "best_s": min(t), "runs": t} for n, t in times.items()}
    if "traffic" in rows and "floor" in rows:
        # per repeat, so the bound sees the same machine state as the floor it extends
        runs = [f + t for f, t in zip(times["floor"], times["traffic"])]
        rows["bound"] = {"median_s": statistics.median(runs), "best_s": min(runs), "runs": runs}
    rows.update({n: {"skipped": c} for n, c in cands.items() if isinstance(c, str)})
    return rows


# -- all-to-all on several ranks -------------------------------------------------------------------
def a2a_worker(rank, world, tokens, hidden, experts, k, repeats):
    from zeroengine import comm
    from zeroengine.moe import MoE

    torch.manual_seed(0)
    x = torch.randn(tokens, hidden)
    grad = torch.randn(tokens, hidden)
    layers = {"local": MoE(hidden, Scale(hidden), num_experts=experts, k=k, drop_tokens=False),
              "all-to-all": MoE(hidden, Scale(hidden), num_experts=experts, ep_size=world, k=k, drop_tokens=False)}
    result = {n: [] for n in layers}
    for rep in range(repeats + 1):
        for name, layer in layers.items():
            comm.barrier()  # start together: the slowest rank's time is the layer's time
            t = timed(lambda: fwd_bwd(layer, x, grad), "cpu")
            if rep:
                result[name].append(t)
    # bytes of one forward + backward's token all-to-alls: the rows this rank sends (both ways)
    routing = layers["all-to-all"].gate(x)
    sent = 2 * 2 * int(routing.kept_counts.sum()) * hidden * 4
    return {n: statistics.median(t) for n, t in result.items()} | {"bytes_sent": sent}


def run_a2a(worlds, tokens, hidden, experts, k, repeats):
    from bench_moe import a2a_worker as worker  # importable by name, as run_distributed needs

    from zeroengine.testing import run_distributed

    out = {}
    for world in worlds:
        per_rank = run_distributed(worker, world, tokens, hidden, experts, k, repeats, timeout_s=600)
        out[str(world)] = {"local_s": max(r["local"] for r in per_rank),
                           "all_to_all_s": max(r["all-to-all"] for r in per_rank),
                           "bytes_sent_per_rank": per_rank[0]["bytes_sent"]}
    return out


# -- report ----------------------------------------------------------------------------------------
COLUMNS = ["floor", "traffic", "bound", "gate+experts", "naive", "sort", "deepspeed", "ze-loop", "ze-serial", "zeroengine",
           "ze-stacked", "autoep-bound", "autoep"]


def print_table(title, shapes):
    print(f"\n{title}")
    names = sorted({n for s in shapes for n in s["rows"]}, key=COLUMNS.index)
    print(f"{'experts':>7} {'k':>2}  " + "  ".join(f"{n:>18}" for n in names))
    for s in shapes:
        cells = []
        for n in names:
            row = s["rows"].get(n, {})
            cells.append(f"{'-':>18}" if "median_s" not in row
                         else f"{row['median_s'] * 1e3:9.1f} ({row['best_s'] * 1e3:6.1f})")
        print(f"{s['experts']:>7} {s['k']:>2}  " + "  ".join(cells))
    print("(ms: median (best) of the repeats)")


def ratios(shapes, baseline_of, ours_of=("zeroengine", "ze-stacked"), shared="gate+experts"):
    """``other/ours`` by median and by best time (> 1: ours is faster; the floor's ratio is <= 1), and
    ``(paired)``: the median over repeats of the ratio within a repeat (the two ran back to back, so
    load from other processes that changes between repeats cancels out). Where the ``shared`` row ran
    (overhead rows), ``other/ours beyond gate+experts`` is the same ratio, median and paired, of each time
    minus that row's: the routing, dispatch and combine alone."""
    out = []
    for s in shapes:
        rows = s["rows"]
        entry = {"experts": s["experts"], "k": s["k"]}
        for ours in ours_of:
            if "median_s" not in rows.get(ours, {}):
                continue
            for other in baseline_of:
                if "median_s" in rows.get(other, {}):
                    entry[f"{other}/{ours}"] = rows[other]["median_s"] / rows[ours]["median_s"]
                    entry[f"{other}/{ours} (best)"] = rows[other]["best_s"] / rows[ours]["best_s"]
                    entry[f"{other}/{ours} (paired)"] = statistics.median(
                        a / b for a, b in zip(rows[other]["runs"], rows[ours]["runs"]))
                    if "median_s" in rows.get(shared, {}) and other not in ("floor", "bound"):
                        entry.update(_beyond(rows[other], rows[ours], rows[shared], f"{other}/{ours} beyond {shared}"))
        out.append(entry)
    return out


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _beyond(other: dict, ours: dict, base: dict, key: str, least: float = 0.1) -> dict:
    """``(other - base) / (ours - base)`` by median and paired (over the repeats where it is defined, if
    they are most); None ("n/a") where ours is within ``least`` of the base's time: a ratio over a
    difference that small is noise, and may flip sign."""
    def ratio(a, b, f):
        return (a - f) / (b - f) if b - f > least * f else None

    paired = [r for r in (ratio(a, b, f) for a, b, f in zip(other["runs"], ours["runs"], base["runs"]))
              if r is not None]
    return {key: ratio(other["median_s"], ours["median_s"], base["median_s"]),
            key + " (paired)": statistics.median(paired) if 2 * len(paired) > len(ours["runs"]) else None}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", default="8,64")
    parser.add_argument("--k", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--overhead-repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--a2a-worlds", default="2,4", help="comma list; empty to skip")
    parser.add_argument("--skip-mlp", action="store_true", help="only the overhead and all-to-all rows")
    parser.add_argument("--skip-overhead", action="store_true", help="no near-zero-cost-expert rows")
    parser.add_argument("--candidates", default="", help="comma list to run (default: all; the floor always runs)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repeat (smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.ffn, args.experts = 256, 32, 64, "4,8"
        args.repeats = args.overhead_repeats = 1
        args.a2a_worlds = "2"
    device, dtype = args.device, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    with_ds = not args.no_deepspeed and device == "cpu"
    if with_ds:
        _init_single_rank_world()
    experts = [int(e) for e in args.experts.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "device": device, "dtype": args.dtype,
              "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    from zeroengine.ops.moe_dispatch import backend

    result["zeroengine_kernels"] = backend(device, dtype)
    result["load_average_start"] = os.getloadavg()  # other processes on the same cores (see the README)
    for kind, reps in (("mlp", args.repeats), ("cheap", args.overhead_repeats)):
        if (kind == "mlp" and args.skip_mlp) or (kind == "cheap" and args.skip_overhead):
            continue
        only = {c for c in args.candidates.split(",") if c}
        shapes = [{"experts": e, "k": k, "rows": run_shape(kind, args.tokens, args.hidden, args.ffn, e, k, reps,
                                                           device, dtype, with_ds, only)}
                  for e in experts for k in ks]
        result[kind] = shapes
        result[f"{kind}_ratios"] = ratios(shapes, ["floor", "bound", "naive", "sort", "deepspeed", "ze-loop",
                                                         "ze-serial"])
        print_table("forward+backward, expert MLP" if kind == "mlp" else "dispatch/combine overhead "
                    "(near-zero-cost expert)", shapes)
        if kind == "mlp":  # AutoEP's layer against its grouped-GEMM bound (> 0.5: issue 24's GPU target)
            result["autoep_ratios"] = ratios(shapes, ["autoep-bound"], ours_of=("autoep",))
            for r in result["autoep_ratios"]:
                if "autoep-bound/autoep" in r:
                    print(f"  autoep at {r['experts']} experts, k {r['k']}: {r['autoep-bound/autoep']:.3f} of the "
                          f"grouped-GEMM bound (paired {r['autoep-bound/autoep (paired)']:.3f})")
        for r in result[f"{kind}_ratios"]:
            print("  " + ", ".join(f"{key} {v:.3f}" if isinstance(v, float) else f"{key} {v}"
                                   for key, v in r.items() if "(best)" not in key and "(paired)" not in key
                                   and "beyond" not in key))
            print("    paired: " + ", ".join(f"{key[:-9]} {v:.3f}" for key, v in r.items()
                                         if "(paired)" in key and "beyond" not in key))
            beyond = {key: v for key, v in r.items() if "beyond" in key}
            if beyond:
                print("    beyond gate+experts (median; paired): " + ", ".join(
                    f"{key.split(' beyond')[0]} {_fmt(v)}; {_fmt(beyond[key + ' (paired)'])}"
                    for key, v in beyond.items() if "(paired)" not in key))
    worlds = [int(w) for w in args.a2a_worlds.split(",") if w] if device == "cpu" else []
    if worlds:
        result["a2a"] = run_a2a(worlds, args.tokens, args.hidden, min(experts), max(ks), args.overhead_repeats)
        print("\nall-to-all dispatch (cheap expert, ep_size = world, slowest rank):")
        for world, row in result["a2a"].items():
            print(f"  {world} ranks: local {row['local_s'] * 1e3:.1f} ms, "
                  f"all-to-all {row['all_to_all_s'] * 1e3:.1f} ms, "
                  f"{row['bytes_sent_per_rank'] / 2**20:.1f} MiB of token rows per rank")
    result["load_average_end"] = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start {result['load_average_start']}, at end {result['load_average_end']}")
    out = Path(args.out) if args.out else HERE / "results" / f"moe{'_cuda' if device == 'cuda' else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")


def _init_single_rank_world():
    """DeepSpeed's layer needs torch.distributed (a world of one) and its CPU accelerator."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    from zeroengine.testing import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # deepspeed.comm wraps the group made above
    except ImportError:
        pass


if __name__ == "__main__":
    main()
