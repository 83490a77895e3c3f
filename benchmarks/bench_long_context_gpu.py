"""The longest sequence one GPU trains: a Llama-3-8B-shaped model, ZeRO-3 with optimizer offload and ALST's
single-GPU pieces (issue 33; ALST: 500K tokens on one H100, 1.2M on an H200).

    python benchmarks/bench_long_context_gpu.py [--preset llama3-8b] [--layers N|auto] [--start 16384]
        [--granularity 8192] [--time-limit 480] [--offload-param] [--out benchmarks/results/long_context_gpu.json]
    python benchmarks/bench_long_context_gpu.py --device cpu --preset tiny --cpu-budget-mib 4 ...   # dry run

Method
------
One process (a world of 1, which ``zeroengine.initialize`` makes when no launcher set RANK/WORLD_SIZE) builds the
preset's Llama from its config (random weights, sdpa attention, bf16, materialized on the GPU: 16 GB at 32
layers, so no zero.Init) and trains it at ZeRO 3, the optimizer offloaded to host memory (zeroengine's CPU Adam;
``--offload-param``: the parameters too), micro batch 1, gradient clipping 1.0, with ALST's single-GPU pieces:
``LlamaMLP`` tiled along the sequence (``TiledMLP``, ``shards_for`` pieces), head and loss tiled
(``TiledFusedLogitsLoss`` in ``LossOf``, the module the engine trains), every decoder layer checkpointed, and the
checkpointed hidden states offloaded to pinned host memory (one offload context pooling no idle buffers: a pool
would keep one length's pinned buffers, useless at the next, beside that one's).

A trial is one training step on one random sequence. Lengths (multiples of 256) double from ``--start`` until a
trial fails for memory, then bisect between the longest success and the shortest failure down to
``--granularity`` (``LengthSearch``). No trial starts whose predicted time (``predict_seconds``) would pass
``--time-limit`` seconds since start, or whose offloaded hidden states (``layers - 1`` pinned buffers of
``seq x hidden`` bf16, rounded up to a power of 2) exceed 90% of the host's available memory (a host out-of-memory
kills instead of raising: recorded as a failure for host memory, not run). A failure's leftovers are freed (stage
3's gathered parameters, gradients); every trial starts with the device and pinned host caches empty. Per trial:
outcome (ok / oom / error, the message's first line), peak device bytes (``torch.cuda.max_memory_allocated``,
reset before each), seconds, tokens/s, host RSS; the JSON is rewritten after each: a killed run keeps them.

Host memory sizes the model: ~16 host bytes per offloaded parameter (fp32 master, Adam's moments, fp32 gradient;
18 with ``--offload-param``), ~128 GB for 8B, more than a 128 GiB host spares beside the hidden states.
``--layers auto`` takes the most layers whose state (``host_need``: with embeddings and head, plus 20%) fits in
70% of the host's memory. With hidden states offloaded, device memory per token hardly depends on the depth
(backward recomputes one layer at a time); the summary extrapolates what the full depth would add.

Dry run (``--device cpu --preset tiny``): the same code, fp32, on the CPU, out-of-memory simulated: a
``LiveTensorBytes`` probe raises ``torch.OutOfMemoryError`` from the operator that takes the step's live tensor
bytes past ``--cpu-budget-mib`` (mid-forward or mid-backward, as a real failure: recovery runs too).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

try:
    import psutil
except ImportError:  # (the GPU image has it; /proc says the same)
    psutil = None

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from alst_parts import LengthSearch, LossOf, predict_seconds, tiled_mlp_forward  # noqa: E402

PRESETS = {
    "llama3-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                      rope_theta=500000.0, max_positions=1 << 22, loss_tile_logits=1 << 28),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=256, rope_theta=500000.0,
                 max_positions=1 << 22, loss_tile_logits=1 << 14),
}
ALST_REFERENCE = {"H100 (80 GB)": 500_000, "H200 (141 GB)": 1_200_000}
KEEP_LAST = 1  # hidden states the offload context leaves on the device (its default)


def params_of(p: dict, layers: int) -> int:
    """Parameters of the preset's Llama with ``layers`` layers: attention, MLP and two norms per layer; embeddings,
    the untied head and the final norm."""
    d, head_dim = p["hidden"], p["hidden"] // p["heads"]
    per_layer = 2 * d * head_dim * (p["heads"] + p["kv_heads"]) + 3 * d * p["intermediate"] + 2 * d
    return layers * per_layer + 2 * p["vocab"] * d + d


def host_need(p: dict, layers: int, offload_param: bool) -> float:
    """Host bytes of the offloaded training state plus 20%: 16 per parameter (18 with the parameters offloaded)."""
    return 1.2 * (18 if offload_param else 16) * params_of(p, layers)


def auto_layers(p: dict, host_bytes: int, offload_param: bool) -> int:
    """The most layers (at least 1, at most the preset's) whose ``host_need`` is within 70% of the host's memory."""
    fits = [n for n in range(1, p["layers"] + 1) if host_need(p, n, offload_param) <= 0.7 * host_bytes]
    return max(fits, default=1)


def proc_bytes(key: str, path: str = "/proc/meminfo") -> int:
    """A ``kB`` line of /proc/meminfo (MemTotal, MemAvailable) or /proc/self/status (VmRSS), in bytes."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _budgeted_probe(budget: int):
    from zeroengine.activation_checkpointing.memory_probe import LiveTensorBytes

    class BudgetedLiveBytes(LiveTensorBytes):
        """Live tensor bytes, raising a simulated out-of-memory error from the operator that passes ``budget``."""

        tripped = False

        def _track(self, t, inputs):
            super()._track(t, inputs)
            if self.live[t.device.type] > budget:
                self.tripped = True
                raise torch.OutOfMemoryError(f"simulated out of memory: {self.live[t.device.type]} live bytes "
                                             f"> budget {budget}")

    return BudgetedLiveBytes()


def build(p: dict, layers: int, device: torch.device, offload_param: bool):
    """(engine, facts for the report): the model on ``device`` (bf16 on a GPU, fp32 on the CPU), every layer
    checkpointed, its MLPs tiled, the loss wrapped."""
    import transformers
    from transformers.models.llama import modeling_llama

    import zeroengine

    on_gpu = device.type == "cuda"
    config = transformers.LlamaConfig(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"], num_hidden_layers=layers,
        num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"], max_position_embeddings=p["max_positions"],
        rope_parameters={"rope_type": "default", "rope_theta": p["rope_theta"]}, tie_word_embeddings=False,
        attn_implementation="sdpa", use_cache=False)
    modeling_llama.LlamaMLP.forward = tiled_mlp_forward  # (this process only ever builds this one model)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if on_gpu else torch.float32)
    try:
        torch.manual_seed(0)
        with device:
            lm = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    params = sum(t.numel() for t in lm.parameters())
    # transformers 5.24 names it activation_checkpointing_enable; older 5.x (the GPU image's) only the other
    enable = getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable
    enable()
    lm.train()
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "steps_per_print": 10**6, "optimizer": {"type": "Adam", "params": {"lr": 1e-5}},
           "bf16": {"enabled": on_gpu}, "zero_optimization": zero}
    engine, *_ = zeroengine.initialize(model=LossOf(lm, p["loss_tile_logits"]), config=cfg)
    return engine, {"params": params, "engine_config": cfg, "transformers": transformers.__version__}


def trial(engine, offload, p: dict, seq: int, device: torch.device, budget: int | None) -> dict:
    """One training step at ``seq`` tokens, forward and backward inside the hidden-state ``offload`` context:
    its outcome, peak memory and times. Failures are caught and everything they left behind is freed."""
    from zeroengine.sequence_parallel import shift_labels

    on_gpu = device.type == "cuda"
    row, sync = {"seq": seq}, (torch.cuda.synchronize if on_gpu else lambda: None)
    probe = _budgeted_probe(budget) if budget is not None else None
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    start, offloaded, failure = time.perf_counter(), offload.stats.offloaded_bytes, None
    try:
        ids = torch.randint(p["vocab"], (1, seq), device=device, generator=torch.Generator(device).manual_seed(seq))
        labels, positions = shift_labels(ids), torch.arange(seq, device=device).unsqueeze(0)
        with probe if probe is not None else contextlib.nullcontext():
            with offload:
                loss = engine(ids, positions, labels)
                engine.backward(loss)
            sync()
            middle = time.perf_counter()
            engine.step()
            sync()
        end = time.perf_counter()
        row.update(outcome="ok", loss=float(loss.detach()), step_s=end - start, forward_backward_s=middle - start,
                   optimizer_s=end - middle, tokens_per_s=seq / (end - start),
                   offloaded_hidden_bytes=offload.stats.offloaded_bytes - offloaded)
    except Exception as err:  # out of memory comes as several types; anything else is recorded as an error
        message = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        simulated = probe is not None and probe.tripped
        oom = simulated or isinstance(err, torch.OutOfMemoryError) or "out of memory" in message.lower() \
            or "ALLOC_FAILED" in message
        failure = dict(outcome="oom" if oom else "error", message=message, step_s=time.perf_counter() - start,
                       memory="simulated" if simulated else ("device" if oom else None))
    if failure is not None:  # (outside the except block: its traceback no longer holds the step's tensors)
        row.update(failure)
        ids = labels = positions = loss = None  # noqa: F841
        engine.optimizer.hooks.release_all()  # stage 3: parameters a failed forward left gathered
        engine.zero_grad()
    gc.collect()
    if on_gpu:  # the next trial starts from empty caches, device and pinned host (what a run at its length sees)
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # (else the freed hidden-state buffers stay pinned)
    row["peak_device_bytes"] = int(torch.cuda.max_memory_allocated() if on_gpu else probe.peak["cpu"])
    row["host_rss_bytes"] = psutil.Process().memory_info().rss if psutil else proc_bytes("VmRSS", "/proc/self/status")
    return row


def search(engine, p: dict, layers: int, args, report: dict, t0: float) -> None:
    """Trials until the search ends, the time limit or the host's memory stops it; the report is rewritten
    after each."""
    from zeroengine.activation_checkpointing import get_checkpoint_hidden_states_offloading_ctx_manager

    device = torch.device(args.device)
    budget = int(args.cpu_budget_mib * 2**20) if device.type == "cpu" else None
    finder = LengthSearch(args.start, args.granularity, p["max_positions"])
    offload = get_checkpoint_hidden_states_offloading_ctx_manager(max_cpu_buffer_pool_count=0,
                                                                  keep_last_count=KEEP_LAST)
    trials, stopped = report["trials"], None
    while (seq := finder.next()) is not None:
        predicted = predict_seconds(trials, seq)
        left = args.time_limit - (time.perf_counter() - t0)
        if left <= 0 or (predicted is not None and predicted > left):
            stopped = {"reason": "time_limit", "next_seq": seq, "predicted_s": predicted, "left_s": left}
            break
        # each offloaded hidden state is one pinned buffer, which torch's host allocator rounds up to a power of 2
        hidden_bytes = max(0, layers - KEEP_LAST) * (1 << (seq * p["hidden"] * 2 - 1).bit_length())
        available = proc_bytes("MemAvailable")
        if device.type == "cuda" and hidden_bytes > 0.9 * available:
            row = {"seq": seq, "outcome": "oom", "memory": "host (predicted)", "offloaded_hidden_bytes": hidden_bytes,
                   "message": f"the offloaded hidden states ({hidden_bytes / 2**30:.1f} GiB) would not fit in 90% of "
                              f"the host's available {available / 2**30:.1f} GiB; not run"}
        else:
            row = trial(engine, offload, p, seq, device, budget)
        row["elapsed_s"] = time.perf_counter() - t0
        trials.append(row)
        print(_line(row), flush=True)
        if row["outcome"] == "error":
            stopped = {"reason": "error", "seq": seq, "message": row["message"]}
            break
        finder.record(seq, row["outcome"] == "ok")
        report["summary"] = _summary(finder, stopped, p, layers)
        _write(args.out, report)
    report["summary"] = _summary(finder, stopped or {"reason": finder.reason}, p, layers)
    report["partial"] = False


def _summary(finder: LengthSearch, stopped: dict | None, p: dict, layers: int) -> dict:
    summary = {"longest_trained": finder.longest_ok, "first_failed": finder.first_failed,
               "gap": None if finder.first_failed is None else finder.first_failed - (finder.longest_ok or 0),
               "stopped": stopped, "alst_reference_tokens": ALST_REFERENCE}
    if layers < p["layers"] and finder.longest_ok:
        hidden = (p["layers"] - KEEP_LAST) * finder.longest_ok * p["hidden"] * 2
        full, device = params_of(p, p["layers"]), 4 * (params_of(p, p["layers"]) - params_of(p, layers))
        summary["extrapolation"] = {
            "full_layers": p["layers"], "host_hidden_state_bytes_at_longest": hidden,
            "host_model_state_bytes": 16 * full, "device_extra_bytes_estimate": device,
            "note": f"measured with {layers} of {p['layers']} layers; the full depth at {finder.longest_ok} tokens "
                    f"needs {hidden / 2**30:.1f} GiB of offloaded hidden states ((layers - 1) x seq x hidden x 2 "
                    f"bytes) and {16 * full / 2**30:.0f} GiB of optimizer state on the host, and about "
                    f"{device / 2**30:.1f} GiB more on the device (its {p['layers'] - layers} more layers' bf16 "
                    f"weights and gradients; the per-token working set, one layer's recompute, stays)"}
    return summary


def _line(row: dict) -> str:
    peak = row.get("peak_device_bytes")
    text = f"seq {row['seq']:>8} | {row['outcome']:>5}"
    if peak is not None:
        text += f" | peak {peak / 2**20:9.1f} MiB | rss {row['host_rss_bytes'] / 2**30:6.1f} GiB"
    if row["outcome"] == "ok":
        return text + f" | {row['step_s']:7.2f} s | {row['tokens_per_s']:9.0f} tok/s | loss {row['loss']:.3f}"
    return text + f" | {row.get('memory') or ''} {row['message'][:120]}"


def _write(path: str, report: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")  # whole files only, even when the run is killed mid-write
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--layers", default=None, help="decoder layers: N, or auto (what the host holds)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--start", type=int, default=16384)
    parser.add_argument("--granularity", type=int, default=8192)
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds since start for the whole search")
    parser.add_argument("--offload-param", action="store_true")
    parser.add_argument("--cpu-budget-mib", type=float, default=4.0, help="--device cpu: the simulated memory")
    parser.add_argument("--out", default=str(HERE / "results" / "long_context_gpu.json"))
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the dry run stays on the CPU even on a GPU machine
    elif not torch.cuda.is_available():
        print("bench_long_context_gpu: no CUDA device here (--device cpu runs the dry run)", file=sys.stderr)
        return 1
    p, host = PRESETS[args.preset], proc_bytes("MemTotal")
    auto = args.layers == "auto"
    layers = auto_layers(p, host, args.offload_param) if auto else int(args.layers or p["layers"])
    if auto:
        print(f"--layers auto: {layers} of {p['layers']} layers (host state ~"
              f"{host_need(p, layers, args.offload_param) / 2**30:.0f} GiB with the 20% margin, within 70% of "
              f"{host / 2**30:.0f} GiB)", flush=True)
    device = torch.device(args.device)
    engine, built = build(p, layers, device, args.offload_param)
    report = {"benchmark": "long_context_gpu", "partial": True, "host": platform.node(),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "host_ram_bytes": host, "preset": args.preset,
              "model": {**p, "layers": layers, "preset_layers": p["layers"]}, "layers_choice": args.layers or "preset",
              **built,
              "search": {"start": args.start, "granularity": args.granularity, "time_limit_s": args.time_limit},
              "cpu_budget_bytes": int(args.cpu_budget_mib * 2**20) if device.type == "cpu" else None,
              "build_s": time.perf_counter() - t0, "trials": [], "summary": {}}
    print(f"{report['device']}: {built['params'] / 1e6:,.1f}M params, {layers} layers, built in "
          f"{report['build_s']:.0f} s", flush=True)
    _write(args.out, report)
    search(engine, p, layers, args, report, t0)
    _write(args.out, report)
    s = report["summary"]
    print(f"longest trained: {s['longest_trained']} tokens; first failed: {s['first_failed']}; stopped: "
          f"{s['stopped']['reason']} (ALST: 500K on one H100, 1.2M on an H200)")
    if "extrapolation" in s:
        print(s["extrapolation"]["note"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
