"""Tensor parallelism on CPU ranks: bytes per block against Megatron's analysis, dp=2 vs tp=2, DeepSpeed's AutoTP.

    python benchmarks/bench_tensor_parallel.py [--tp 2,4] [--steps 5] [--no-deepspeed] [--quick] [--out FILE.json]

1. Bytes (counted, exact): GPT-2 and Llama at L = 2 and 4, split by ``autotp.convert`` over
   ``build_mesh(pp=1, tp=N).tensor_group``; one forward + backward outside the engine, ``zeroengine.comm.counters``
   reset around each, against Megatron's (Shoeybi et al. 2019) 2 all-reduces of b·s·h forward and 2 backward per
   block, plus the embedding's 1 forward, the LM head input's 1 backward and the logits' all-gather (b·s·V); per
   block = (L=4 minus L=2) / 2. A count that differs names the layers causing it.
2. zeroengine on 2 ranks, ZeRO 1, a wider GPT-2 as dp=2 and as tp=2: step time (engines take turns in one world,
   one step per round; slower rank, median), ``engine.memory_breakdown()``, collectives of one untimed step.
3. DeepSpeed 0.19.8 AutoTP (``tensor_parallel.autotp_size`` 2, ZeRO 1; imported in the ranks only, with
   ``DS_ACCELERATOR=cpu``) on the GPT-2 (its error recorded) and on a Llama beside zeroengine tp=2 on it; its
   collectives counted by wrapping ``torch.distributed``. Details: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
OPTIMIZER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
DS_OPS = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
          "reduce_scatter_tensor", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_base",
          "all_gather_coalesced", "all_to_all_single", "all_to_all")
PHASES = ("forward", "backward", "step")
BYTE_KEYS = ("ar_fwd", "ar_bwd", "ar_bytes", "ag_calls", "ag_bytes", "wire_bytes")  # AR all-reduce, AG all-gather


def build(name: str, m: dict, layers: int):
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=m["vocab"], n_positions=m["seq"], n_embd=m["hidden"], n_layer=layers, n_head=m["heads"],
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            attn_implementation="eager"))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["ffn"], num_hidden_layers=layers,
        num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], max_position_embeddings=m["seq"],
        attention_dropout=0.0, attn_implementation="eager"))


def tokens(m: dict, seed: int) -> torch.Tensor:
    return torch.randint(m["vocab"], (m["batch"], m["seq"]), generator=torch.Generator().manual_seed(seed))


def _error(exc: BaseException) -> str:  # one line of it
    return f"{type(exc).__name__}: {(str(exc) or '-').splitlines()[0][:300]}"


# -- 1. bytes of one forward + backward ------------------------------------------------------------------------
def count_bytes(c: dict, world: int) -> list[dict]:
    from zeroengine.comm import counters
    from zeroengine.parallel import build_mesh
    from zeroengine.tensor_parallel import ParallelLinear, autotp

    tg = build_mesh(pp=1, tp=world).tensor_group
    rows = []
    for name in c["models"]:
        for layers in c["layers"]:
            model = build(name, c, layers)
            autotp.convert(model, tg)
            block0 = {n: m.style for n, m in model.named_modules()
                      if isinstance(m, ParallelLinear) and re.search(r"\.0\.", n)}
            counters.reset()
            loss = model(input_ids=tokens(c, 1), labels=tokens(c, 1)).loss
            forward = counters.snapshot()
            counters.reset()
            loss.backward()
            rows.append({"model": name, "tp": world, "layers": layers, "forward": forward,
                         "backward": counters.snapshot(), "block0": block0})
    return rows


def summarise_bytes(c: dict, rows: list[dict]) -> dict:
    act, logits = c["batch"] * c["seq"] * c["hidden"] * 4, c["batch"] * c["seq"] * c["vocab"] * 4
    out, per_block = [], []
    for r in rows:
        f, b, n, share = r["forward"], r["backward"], 2 * r["layers"] + 1, (r["tp"] - 1) / r["tp"]
        both = lambda op, k: sum(d.get(op, {}).get(k, 0) for d in (f, b))  # noqa: E731
        m = {"ar_fwd": f.get("all_reduce", {}).get("calls", 0), "ar_bwd": b.get("all_reduce", {}).get("calls", 0),
             "ar_bytes": both("all_reduce", "payload_bytes"), "ag_calls": both("all_gather", "calls"),
             "ag_bytes": both("all_gather", "payload_bytes"), "wire_bytes": sum(both(op, "wire_bytes") for op in f | b)}
        e = {"ar_fwd": n, "ar_bwd": n, "ar_bytes": 2 * n * act, "ag_calls": 1, "ag_bytes": logits,
             "wire_bytes": 2 * n * 2 * act * share + logits * share}
        out.append({k: r[k] for k in ("model", "tp", "layers")} | {
            "measured": m, "expected": e, "other_ops": sorted((set(f) | set(b)) - {"all_reduce", "all_gather"}),
            "matches": m == e})
    for model, tp in dict.fromkeys((r["model"], r["tp"]) for r in out):
        lo, hi = (next(r for r in out if (r["model"], r["tp"], r["layers"]) == (model, tp, n)) for n in c["layers"])
        d = {k: (hi["measured"][k] - lo["measured"][k]) / (hi["layers"] - lo["layers"])
             for k in ("ar_fwd", "ar_bwd", "ar_bytes", "wire_bytes")}
        block = next(r["block0"] for r in rows if (r["model"], r["tp"]) == (model, tp))
        col, row = ([n.split(".")[-1] for n, s in block.items() if s == style] for style in ("column", "row"))
        ok = d["ar_fwd"] == 2 and d["ar_bwd"] == 2 and d["ar_bytes"] == 4 * act
        note = "" if ok else "not what the layers predict (one forward per row-, one backward per column-parallel " \
            "layer): unexplained" if (d["ar_fwd"], d["ar_bwd"]) != (len(row), len(col)) else (
            f"{d['ar_fwd']:g} forward all-reduces per block = one per row-parallel layer ({', '.join(row)}); "
            f"{d['ar_bwd']:g} backward = one per column-parallel layer ({', '.join(col)}): each applies copy_to to "
            "the same block input itself, so each all-reduces its own share of that input's gradient (Megatron's "
            "fused QKV and fused gate/up GEMMs: 1 each, 2 backward per block)")
        per_block.append({"model": model, "tp": tp, "act_bytes": act, **d, "expected": {
            "ar_fwd": 2, "ar_bwd": 2, "ar_bytes": 4 * act, "wire_bytes": 8 * act * (tp - 1) / tp},
            "column_layers": col, "row_layers": row, "matches": ok, "explanation": note})
    return {"act_bytes": act, "logits_bytes": logits, "rows": out, "per_block": per_block}


# -- 2 and 3. engines side by side -----------------------------------------------------------------------------
def config(t: dict, tp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": t["batch"] // (2 // tp), "gradient_accumulation_steps": 1,
            "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp}}


def ze_variant(t: dict, name: str, tp: int) -> dict:
    import zeroengine

    cfg = config(t, tp) | {"optimizer": {"type": "AdamW", "params": {**OPTIMIZER, "torch_adam": True}}}
    engine, *_ = zeroengine.initialize(model=build(name, t, t["layers"]), config=cfg)
    return {"engine": engine, "dp": 2 // tp, "kind": "zeroengine"}


def ds_variant(t: dict, name: str) -> tuple[dict, str]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")  # wraps the world run_distributed made
        model = build(name, t, t["layers"])
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **OPTIMIZER),
                                          config=config(t, 2) | {"zero_allow_untested_optimizer": True},
                                          dist_init_required=False)
    torch.set_num_threads(1)
    return {"engine": engine, "dp": 1, "kind": "deepspeed"}, deepspeed.__version__


@contextlib.contextmanager
def ds_log(log: list):
    """Log every collective DeepSpeed issues inside (all go through deepspeed.comm's backend object, ``cdb``): op,
    bytes of its first tensor (or list: an all-gather's output), ring wire bytes over its group."""
    import torch.distributed as dist
    from deepspeed.comm import comm as ds_comm

    from zeroengine.comm.counters import ring_wire_bytes

    def wrap(op, fn):
        def counted(*args, **kwargs):
            values = (*args, *kwargs.values())
            t = next(a for a in values if isinstance(a, (torch.Tensor, list)))
            size = sum(x.numel() * x.element_size() for x in (t if isinstance(t, list) else [t]))
            group = next((a for a in values if isinstance(a, dist.ProcessGroup)), None)
            ring = "all_reduce" if "all_reduce" in op else re.sub(r"_(into_tensor|tensor|base|coalesced|single)$", "", op)
            log.append((op, size, ring_wire_bytes(ring, size, dist.get_world_size(group))))
            return fn(*args, **kwargs)
        return counted

    cdb = ds_comm.cdb
    try:
        for op in DS_OPS:
            setattr(cdb, op, wrap(op, getattr(cdb, op)))
        yield
    finally:
        for op in DS_OPS:
            cdb.__dict__.pop(op, None)


def train_step(v: dict, ids: torch.Tensor, rank: int, phases: dict | None = None) -> float:
    """Forward, backward, step; with ``phases``, each phase's collectives: {phase: {op: [calls, bytes, wire]}}."""
    from zeroengine.comm import counters

    engine, micro, out = v["engine"], ids.shape[0] // v["dp"], {}
    ids = ids[(rank % v["dp"]) * micro:(rank % v["dp"] + 1) * micro]
    calls = {"forward": lambda: engine(input_ids=ids, labels=ids).loss,
             "backward": lambda: engine.backward(out["forward"]), "step": engine.step}
    for phase in PHASES:
        log = []
        counters.reset()
        with ds_log(log) if phases is not None and v["kind"] == "deepspeed" else contextlib.nullcontext():
            out[phase] = calls[phase]()
        if phases is not None:
            ops = {op: [c["calls"], c["payload_bytes"], c["wire_bytes"]] for op, c in counters.snapshot().items()}
            for op, size, wire in log:
                ops[op] = [a + b for a, b in zip(ops.get(op, [0, 0, 0.0]), (1, size, wire))]
            phases[phase] = ops | ({"all_reduce_sizes": [s for op, s, _ in log if op == "all_reduce"]} if log else {})
    return float(out["forward"].detach())


def train(t: dict, with_ds: bool, rank: int) -> dict:
    import torch.distributed as dist

    from zeroengine.tensor_parallel import split_of

    variants = {"ze-dp2": ze_variant(t, "gpt2", 1), "ze-tp2": ze_variant(t, "gpt2", 2)}
    ds = {} if with_ds else {"skipped": "--no-deepspeed"}
    if with_ds:
        variants["ze-tp2-llama"] = ze_variant(t, "llama", 2)
        for name in ("gpt2", "llama"):
            try:
                variants[f"ds-tp2-{name}"], version = ds_variant(t, name)
                ds[name] = {"version": version}
            except Exception as exc:  # GPT-2 is on its AutoTP's unsupported list; a CPU failure lands here too
                ds[name] = {"error": _error(exc)}
    names = list(variants)
    runs = {n: {"step_s": [], "losses": [], "collectives": {}} for n in names}
    for round_ in range(t["steps"] + 1):  # round 0 warms up
        ids = tokens(t, 100 + round_)
        for n in names[round_ % len(names):] + names[:round_ % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            try:
                runs[n]["losses"].append(train_step(variants[n], ids, rank))
            except Exception as exc:
                if not n.startswith("ds-"):
                    raise
                ds[n.split("-")[-1]] = {"error": _error(exc)}
                names.remove(n)  # a failing rank may leave its peer blocked: the world's timeout then reports it
                continue
            if round_:
                runs[n]["step_s"].append(time.perf_counter() - start)
    for n in names:
        dist.barrier()
        train_step(variants[n], tokens(t, 99), rank, runs[n]["collectives"])
        params = dict(variants[n]["engine"].module.named_parameters())
        runs[n]["memory"] = {"local_param_elements": sum(p.numel() for p in params.values()),
                             "split_elements": sum(p.numel() for p in params.values() if split_of(p) is not None)}
        if variants[n]["kind"] == "zeroengine":
            runs[n]["memory"]["breakdown"] = variants[n]["engine"].memory_breakdown()
    return {"runs": {n: runs[n] for n in names}, "deepspeed": ds}


def tp_worker(rank: int, world: int, spec: dict) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    bytes_ = count_bytes(spec["comm"], world)
    return {"bytes": bytes_, "train": train(spec["train"], spec["deepspeed"], rank) if world == 2 else None}


# -- aggregation and report ------------------------------------------------------------------------------------
def summarise_train(t: dict, per_rank: list[dict]) -> dict:
    runs = {}
    for n in per_rank[0]["runs"]:
        steps = [max(s) for s in zip(*(r["runs"][n]["step_s"] for r in per_rank))]
        runs[n] = {"step_s": statistics.median(steps), "steps_per_s": 1 / statistics.median(steps),
                   "step_s_runs": steps, "losses": [statistics.mean(x) for x in zip(*(r["runs"][n]["losses"]
                                                                                      for r in per_rank))],
                   "collectives": per_rank[0]["runs"][n]["collectives"], "memory": per_rank[0]["runs"][n]["memory"]}
    dp, tp = runs["ze-dp2"]["memory"], runs["ze-tp2"]["memory"]
    kinds = [k for k in ("params", "grads", "optimizer_states", "master_params") if dp["breakdown"].get(k)]
    ratio = {k: tp["breakdown"].get(k, 0) / dp["breakdown"][k] for k in kinds}
    total = {v: sum(m["breakdown"].get(k, 0) for k in kinds) for v, m in (("dp", dp), ("tp", tp))}
    ratio["total"] = total["tp"] / total["dp"]
    full, local = dp["local_param_elements"], tp["local_param_elements"]
    memory = {"kinds": kinds, "tp_over_dp": ratio, "full_param_elements": full, "tp_local_param_elements": local,
              "expected_params_ratio": local / full, "replicated_fraction": (full - 2 * tp["split_elements"]) / full,
              # at ZeRO 0, dp=2 keeps every optimizer state (twice ZeRO 1's half); tp=2 (dp=1) what it keeps now
              "tp_over_dp_zero0_analytic": total["tp"] / (total["dp"] + dp["breakdown"]["optimizer_states"])}
    pairs = [(a, b) for a, b in (("ze-tp2", "ze-dp2"), ("ze-tp2-llama", "ds-tp2-llama")) if a in runs and b in runs]
    compare = {f"{a}/{b}": {  # paired: the median over rounds of the ratio within a round, so drift cancels
        "step_ratio": runs[a]["step_s"] / runs[b]["step_s"], "step_ratio_paired": statistics.median(
            x / y for x, y in zip(runs[a]["step_s_runs"], runs[b]["step_s_runs"])),
        "max_abs_loss_diff": max(abs(x - y) for x, y in zip(runs[a]["losses"], runs[b]["losses"]))} for a, b in pairs}
    return {"model": t, "runs": runs, "memory": memory, "compare": compare}


def _ops(phase: dict) -> str:
    return ", ".join(f"{op} {c[0]}×/{c[2] / 1e6:.2f}" for op, c in phase.items() if op != "all_reduce_sizes") or "-"


def print_tables(result: dict) -> None:
    b, c, mb = result["bytes"], result["comm_model"], 1e6
    print(f"\n1. all-reduces (AR) and all-gathers (AG) of one forward + backward (autotp.convert, no engine); b={c['batch']}"
          f" s={c['seq']} h={c['hidden']} V={c['vocab']}: act = b·s·h·4 = {b['act_bytes']} B, logits = b·s·V·4 = "
          f"{b['logits_bytes']} B\nexpected: AR 2L+1 forward and 2L+1 backward, of act bytes each; AG 1 of logits; "
          "wire: one rank's ring sends, 2S(N-1)/N per AR, S(N-1)/N per AG")
    print(f"{'model':>6} {'tp':>2} {'L':>2} " + " ".join(f"{k:>17}" for k in BYTE_KEYS) + "  =   (measured/expected)")
    for r in b["rows"]:
        m, e = r["measured"], r["expected"]
        cells = " ".join(f"{f'{m[k]:.0f}/{e[k]:.0f}':>17}" for k in BYTE_KEYS)
        print(f"{r['model']:>6} {r['tp']:>2} {r['layers']:>2} {cells}  {'yes' if r['matches'] else 'NO'}")
    print("\nper block = (L=4 minus L=2) / 2; Megatron: 2 forward + 2 backward all-reduces of act bytes")
    print(f"{'model':>6} {'tp':>2} {'AR fwd':>6} {'AR bwd':>6} {'AR bytes':>9} {'/ act':>5} {'wire/rank':>9} Megatron")
    for p in b["per_block"]:
        print(f"{p['model']:>6} {p['tp']:>2} {p['ar_fwd']:6g} {p['ar_bwd']:6g} {p['ar_bytes']:9.0f} "
              f"{p['ar_bytes'] / p['act_bytes']:5g} {p['wire_bytes']:9.0f} {'yes' if p['matches'] else 'NO'}"
              + (f"\n    {p['explanation']}" if p["explanation"] else ""))
    tr = result["train"]
    t, mem = tr["model"], tr["memory"]
    print(f"\n2. zeroengine on 2 ranks, ZeRO 1, GPT-2 h={t['hidden']} L={t['layers']} s={t['seq']} V={t['vocab']}, "
          f"global batch {t['batch']}; step = slower rank, median of {t['steps']} after 1 warm-up; 1 thread per rank")
    print(f"{'variant':>13} {'step ms':>8} {'steps/s':>8} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} "
          f"{'last loss':>10}  collectives, calls×/wire MB per rank (forward | backward | step)")
    for n, r in tr["runs"].items():
        bd = r["memory"].get("breakdown", {})
        cols = [f"{bd[k] / mb:.2f}" if k in bd else "-" for k in ("params", "grads", "optimizer_states")]
        print(f"{n:>13} {r['step_s'] * 1e3:8.0f} {r['steps_per_s']:8.2f} {cols[0]:>10} {cols[1]:>9} {cols[2]:>9} "
              f"{r['losses'][-1]:10.5f}  " + " | ".join(_ops(r["collectives"].get(p, {})) for p in PHASES))
    print("tp/dp per rank: " + ", ".join(f"{k} {v:.4f}" for k, v in mem["tp_over_dp"].items())
          + f"; expected for params and grads: (split/2 + replicated) / all = {mem['expected_params_ratio']:.4f}, the "
          f"replicated (norms, position embedding, row-parallel biases) being {mem['replicated_fraction']:.2%}.\n  tp=2"
          " halves each rank's weights and gradients; the optimizer states stay: ZeRO 1 splits them over dp=2, while "
          f"tp=2 (dp=1) keeps all states of its half. At ZeRO 0 tp/dp would be {mem['tp_over_dp_zero0_analytic']:.4f} "
          "(analytic).\n  " + "; ".join(f"{k}: step time {v['step_ratio']:.3f} (paired {v['step_ratio_paired']:.3f}), "
                                         f"max |loss diff| {v['max_abs_loss_diff']:.2e}" for k, v in tr["compare"].items()))
    ds = result["deepspeed"]
    print("\n3. DeepSpeed AutoTP (tp=2, ZeRO 1): " + (f"skipped ({ds['skipped']})" if "skipped" in ds else "; ".join(
        f"{k}: " + (f"not run ({v['error']})" if "error" in v else f"{v['version']} ran") for k, v in ds.items())))
    if "ds-tp2-llama" in tr["runs"]:
        z, d = tr["runs"]["ze-tp2-llama"], tr["runs"]["ds-tp2-llama"]
        cmp = tr["compare"]["ze-tp2-llama/ds-tp2-llama"]
        print(f"  Llama (GPT-2's width and depth, ffn {t['ffn']}, {t['kv_heads']} kv heads): zeroengine "
              f"{z['step_s'] * 1e3:.0f} ms, DeepSpeed {d['step_s'] * 1e3:.0f} ms per step, zeroengine/DeepSpeed "
              f"{cmp['step_ratio']:.3f} (paired {cmp['step_ratio_paired']:.3f}); max |loss diff| "
              f"{cmp['max_abs_loss_diff']:.2e}")
        sizes = {p: d["collectives"][p].get("all_reduce_sizes", []) for p in PHASES}
        print("  DeepSpeed's all-reduces {bytes: count} per phase (its collectives are in table 2): " + "; ".join(
            f"{p} {({s: v.count(s) for s in sorted(set(v))})}" for p, v in sizes.items()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="2,4", help="tensor-parallel sizes for the byte counts (one world each)")
    parser.add_argument("--steps", type=int, default=8, help="timed rounds after one warm-up round")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tp = 2, tiny models, 2 steps, no DeepSpeed (smoke)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    tiny = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256} if args.quick else {}
    comm = {"models": ["gpt2", "llama"], "layers": [2, 4], "hidden": 256, "heads": 8, "kv_heads": 4, "ffn": 704,
            "vocab": 1024, "seq": 16 if args.quick else 64, "batch": 2} | tiny
    model = {"hidden": 512, "heads": 8, "kv_heads": 4, "ffn": 1408, "layers": 4, "seq": 128, "vocab": 4096,
             "batch": 8, "steps": args.steps} | tiny | ({"layers": 2, "seq": 32, "batch": 4, "steps": 2} if args.quick
                                                          else {})
    args.tp, args.no_deepspeed = ("2", True) if args.quick else (args.tp, args.no_deepspeed)
    import transformers
    from bench_tensor_parallel import tp_worker as worker  # importable by name, as run_distributed needs

    from zeroengine.testing import run_distributed

    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "transformers": transformers.__version__, "cpus": os.cpu_count(), "threads_per_rank": 1,
              "quick": args.quick, "comm_model": comm, "load_average_start": os.getloadavg()}
    rows, sizes = [], [int(x) for x in args.tp.split(",")]
    spec = {"comm": comm, "train": model, "deepspeed": not args.no_deepspeed}
    for tp in sizes + ([] if 2 in sizes else [2]):  # the engines run in the tp = 2 world
        start = time.perf_counter()
        per_rank = run_distributed(worker, tp, spec, timeout_s=1800)
        if any(r["bytes"] != per_rank[0]["bytes"] for r in per_rank):
            raise AssertionError(f"tp = {tp}: the ranks counted different collectives")
        rows += per_rank[0]["bytes"]
        if tp == 2:
            result["train"] = summarise_train(model, [r["train"] for r in per_rank])
            result["deepspeed"] = per_rank[0]["train"]["deepspeed"]
        print(f"tp = {tp}: one world, {time.perf_counter() - start:.0f} s", flush=True)
    result["bytes"] = summarise_bytes(comm, rows)
    result["load_average_end"] = os.getloadavg()
    print_tables(result)
    print(f"\nload average (1, 5, 15 min) at start {result['load_average_start']}, at end {result['load_average_end']}")
    out = Path(args.out) if args.out else HERE / "results" / "tensor_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
