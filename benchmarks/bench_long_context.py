"""Long context on CPU ranks: peak memory per rank against sequence length, up the ALST ladder.

    python benchmarks/bench_long_context.py [--seqs 1024,2048,4096] [--budget-mib 1024] [--quick]
                                            [--out benchmarks/results/long_context.json] [--plot PATH]

Method
------
A small Llama (``--layers`` decoder layers of width ``--hidden``, ``--vocab`` tokens, sdpa attention, fp32)
trains (forward, backward, optimizer step: ZeRO 3, SGD) on one random sequence per step, on the rungs of Arctic
Long Sequence Training's ablation ladder:

* ``sp1``: one rank, no sequence parallelism;
* ``sp2``: Ulysses over 2 ranks (each holds half the sequence; attention all-to-alls to half the heads; ZeRO 3
  partitions the model states over both);
* ``sp2+tiled``: and the MLP computed in tiles along the sequence (``TiledMLP``: its 4x-wide intermediate
  activations exist for one tile at a time) and the LM head + loss in tiles (``TiledFusedLogitsLoss``: the
  ``seq x vocab`` logits never exist whole);
* ``sp2+tiled+ckpt``: and every decoder layer checkpointed (each keeps only its input until backward).

Hidden-state offload to host memory, ALST's last rung, moves nothing on a CPU (it is the host already); the GPU
session's ``long_context`` phase (bench_long_context_gpu.py) measures it.

Memory is the peak of live tensor bytes per rank during a step (``zeroengine.activation_checkpointing
.memory_probe.LiveTensorBytes``: every storage an operator creates, followed until it is freed, what
``torch.cuda.max_memory_allocated`` would report on a GPU), plus what the rank holds before the step
(``engine.memory_breakdown()``: model states, and the buffers kept between steps); the larger rank counts.

Each rung is one launch. Two warm-up steps at the shortest length (what is allocated once and kept, gradient
partitions and stage 3's spare gather buckets, is then the same before every measured step); one step at each of
``--seqs``, through which a least-squares line gives the memory per token; then the longest sequence whose step
stays within ``--budget-mib``, searched by steps (doubling past the last length that fits, then bisecting to
``--granularity``: ``alst_parts.LengthSearch``), as long as the next step's predicted time keeps the rung within
``--rung-seconds``. ALST's claims to reproduce: sequence parallelism divides the per-token slope by about sp
(``sp2/sp1 <= 0.55``), and each rung lengthens the sequence that fits.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from alst_parts import LengthSearch, LossOf, predict_seconds, tiled_mlp_forward  # noqa: E402

RUNGS = {"sp1": (1, False, False), "sp2": (2, False, False), "sp2+tiled": (2, True, False),
         "sp2+tiled+ckpt": (2, True, True)}  # name -> (sp, tiled, checkpointed)
ALIGN = 128  # lengths the search tries are multiples of this (and so divide by sp)
TILE_LOGITS = 1 << 22  # logits per tile of the tiled loss (16 MiB in fp32)


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=4 * args["hidden"],
                         num_hidden_layers=args["layers"], num_attention_heads=args["heads"],
                         num_key_value_heads=args["heads"], max_position_embeddings=1 << 20,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _step(engine, args, sp: int, seq: int) -> dict:
    """One training step on one sequence of ``seq`` tokens (this rank's piece of it): its memory and time."""
    from zeroengine.activation_checkpointing.memory_probe import LiveTensorBytes
    from zeroengine.comm.scratch import scratch
    from zeroengine.sequence_parallel import parallel_state, sequence_parallel_loss, shift_labels

    # Collective staging buffers are kept between steps for reuse and sized by the largest message so far;
    # emptied here, a step's own are counted by the probe as it allocates them.
    scratch.clear()
    breakdown = engine.memory_breakdown()
    states = sum(breakdown[k] for k in ("params", "grads", "optimizer_states", "master_params"))
    kept = breakdown["buffers"]  # the model's buffers and stage 3's spare gather buckets, held between steps
    ids = torch.randint(args["vocab"], (1, seq), generator=torch.Generator().manual_seed(seq))
    labels = shift_labels(ids)
    rank_in_sp = parallel_state.get_sequence_parallel_rank() if sp > 1 else 0
    piece = slice(rank_in_sp * seq // sp, (rank_in_sp + 1) * seq // sp)
    positions = torch.arange(seq).unsqueeze(0)[:, piece]
    with LiveTensorBytes() as probe:
        start = time.perf_counter()
        loss = engine(ids[:, piece], positions, labels[:, piece])
        if sp > 1:
            loss = sequence_parallel_loss(loss, labels[:, piece], parallel_state.get_sequence_parallel_group())
        engine.backward(loss)
        middle = time.perf_counter()
        engine.step()
        end = time.perf_counter()
    return {"seq": seq, "peak_activation_bytes": int(probe.peak["cpu"]), "model_state_bytes": int(states),
            "kept_buffer_bytes": int(kept), "loss": float(loss.detach()), "forward_backward_s": middle - start,
            "optimizer_s": end - middle, "seconds": end - start, "outcome": "ok"}


def _larger_rank(row: dict) -> dict:
    """The row of the rank whose total is larger (every rank gets the same row, so all decide alike)."""
    from zeroengine import comm

    total = row["peak_activation_bytes"] + row["model_state_bytes"] + row["kept_buffer_bytes"]
    rows = comm.all_gather_object({**row, "peak_bytes": total, "rank": comm.get_rank()})
    return max(rows, key=lambda r: r["peak_bytes"])


def _rung(rank, world, args, rung):
    """One rung, on its ranks: warm-up, the measured lengths, the search for the longest within the budget."""
    from transformers.models.llama import modeling_llama

    import zeroengine
    from zeroengine.sequence_parallel import UlyssesSPAttentionHF

    sp, tiled, checkpointed = RUNGS[rung]
    seqs, budget = args["seqs"], args["budget"]
    model = _model(args)
    if checkpointed:
        model.activation_checkpointing_enable()
    model.train()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, max(seqs), True) if sp > 1 else None
    original_mlp = modeling_llama.LlamaMLP.forward
    if tiled:
        modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    try:
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
               "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        engine, *_ = zeroengine.initialize(model=LossOf(model, TILE_LOGITS if tiled else None), config=cfg, mpu=mpu)
        started = time.perf_counter()
        for _ in range(2):
            _step(engine, args, sp, min(seqs))
        rows = [_larger_rank(_step(engine, args, sp, seq)) for seq in seqs]
        search = LengthSearch(min(seqs), args["granularity"], args["max_seq"], align=ALIGN)
        for row in rows:
            search.record(row["seq"], row["peak_bytes"] <= budget)
        stopped = None
        while (seq := search.next()) is not None:
            predicted = predict_seconds(rows, seq)
            if predicted is not None and time.perf_counter() - started + predicted > args["rung_seconds"]:
                stopped = f"time: a step at {seq} tokens would take about {predicted:.0f} s more"
                break
            row = _larger_rank(_step(engine, args, sp, seq))
            rows.append({**row, "search": True})
            search.record(seq, row["peak_bytes"] <= budget)
        return {"rows": rows, "longest_in_budget": search.longest_ok, "first_over_budget": search.first_failed,
                "stopped": stopped or search.reason}
    finally:
        modeling_llama.LlamaMLP.forward = original_mlp
        if sp > 1:
            UlyssesSPAttentionHF.unregister_from_transformers("sdpa")


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of peak bytes against sequence length."""
    xs, ys = [r["seq"] for r in rows], [r["peak_bytes"] for r in rows]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    if n < 2:
        return float(ys[0]), 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main(argv=None) -> int:
    from zeroengine.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="1024,2048,4096", help="lengths measured for the slope")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--budget-mib", type=float, default=1024.0, help="memory per rank for the longest-length search")
    parser.add_argument("--granularity", type=int, default=512, help="the search stops this close (tokens)")
    parser.add_argument("--max-seq", type=int, default=1 << 17)
    parser.add_argument("--rung-seconds", type=float, default=420.0, help="a rung stops searching past this")
    parser.add_argument("--rungs", default=",".join(RUNGS))
    parser.add_argument("--quick", action="store_true", help="a tiny model and short sequences (smoke test)")
    parser.add_argument("--out", default=str(HERE / "results" / "long_context.json"))
    parser.add_argument("--plot", default=None, help="draw peak memory against length to this PNG (matplotlib)")
    ns = parser.parse_args(argv)
    if ns.quick:
        ns.seqs, ns.layers, ns.hidden, ns.heads, ns.vocab = "128,256", 2, 64, 4, 512
        ns.budget_mib, ns.granularity, ns.max_seq, ns.rung_seconds = 6.0, 128, 4096, 60.0
    args = {"layers": ns.layers, "hidden": ns.hidden, "heads": ns.heads, "vocab": ns.vocab,
            "seqs": [int(s) for s in ns.seqs.split(",")], "budget": int(ns.budget_mib * 2**20),
            "granularity": ns.granularity, "max_seq": ns.max_seq, "rung_seconds": ns.rung_seconds}
    rows, summary = [], {}
    for rung in ns.rungs.split(","):
        result = run_distributed(_rung, RUNGS[rung][0], args, rung, timeout_s=ns.rung_seconds + 300)[0]
        rows += [{"rung": rung, "ranks": RUNGS[rung][0], **r} for r in result["rows"]]
        measured = [r for r in result["rows"] if not r.get("search")]
        intercept, slope = fit(measured)
        summary[rung] = {"bytes_per_token": slope, "intercept_bytes": intercept,
                         **{k: result[k] for k in ("longest_in_budget", "first_over_budget", "stopped")}}
        print(f"{rung:>15}: {slope / 1024:8.1f} KiB/token; longest within {ns.budget_mib:.0f} MiB: "
              f"{result['longest_in_budget']} ({result['stopped']})", flush=True)
    if "sp1" in summary and "sp2" in summary and summary["sp1"]["bytes_per_token"]:
        summary["slope_sp2_over_sp1"] = summary["sp2"]["bytes_per_token"] / summary["sp1"]["bytes_per_token"]
        print(f"slope sp2/sp1: {summary['slope_sp2_over_sp1']:.3f} (ALST: about 1/sp; target <= 0.55)")
    summary["offload"] = "hidden-state offload moves nothing on a CPU (host memory already); see the GPU session"
    report = {"benchmark": "long_context", "host": platform.node(), "torch": torch.__version__,
              "cpus": os.cpu_count(), "settings": args, "rows": rows, "summary": summary}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {ns.out}")
    if ns.plot:
        _plot(rows, ns.plot, args["budget"])
    return 0


def _plot(rows: list[dict], path: str, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rung in dict.fromkeys(r["rung"] for r in rows):
        points = sorted((r["seq"], r["peak_bytes"] / 2**20) for r in rows if r["rung"] == rung)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=rung)
    ax.axhline(budget / 2**20, color="grey", linestyle="--", label="budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"drew {path}")


if __name__ == "__main__":
    sys.exit(main())
