"""Compressed saved activations side by side: memory held for backward, the loss effect, step time.

    python benchmarks/bench_compressed_activations.py [--quick] [--steps N] [--threads N] [--out FILE.json]

Method
------
A small Llama (transformers' ``LlamaForCausalLM``: ``--layers`` decoder layers of width ``--hidden``, MLP width
``--intermediate``, ``--vocab`` tokens, sdpa attention, fp32) is trained with torch AdamW (lr 1e-3) for
``--steps`` steps on a learnable synthetic task: token sequences drawn from a fixed random Markov chain (each
token followed by one of 4 successors with probabilities 0.55 / 0.25 / 0.15 / 0.05, so the loss can fall from
ln(vocab) towards ~1.1 nats). Every variant starts from the same weights and sees the same batches:

* model ``llama`` (SiLU-gated MLP): ``none``; ``bf16``, ``fp8``: the forward and backward inside
  ``compress_saved_activations(dtype)`` (saved tensors kept in that dtype, fp8 e4m3 with a per-tensor scale);
  ``none+noise``, the control: no compression, every gradient element multiplied by (1 + 2^-8 N(0, 1)), noise
  of bf16's size without its structure or any bias. Short training runs are chaotic (when the loss leaves its
  plateau moves with any perturbation), so a variant's loss trajectory is to be read against the control's;
* model ``llama-relu`` (the same with ``hidden_act="relu"``, i.e. ``down(relu(gate(x)) * up(x))``): ``none``;
  ``bitmask`` (``use_bit_mask_relu``: the ReLU keeps a 1-bit mask instead of its output); ``fp8``;
  ``fp8+bitmask``.

Memory, in one untimed step per variant from the common initial weights (after a warm-up step, so gradients
exist and are not counted): ``held_for_backward_bytes`` is what is alive at the end of the forward that was
created by it, i.e. what autograd keeps for backward (plus the scalar loss), and ``peak_bytes`` the most alive at
once during forward + backward, both from ``zeroengine.activation_checkpointing.memory_probe.LiveTensorBytes``
(every storage an operator creates, followed until freed: what ``torch.cuda.max_memory_allocated`` would say on
a GPU). The context's own statistics (tensors compressed, bytes before and after) are reported beside them.

Loss effect, two ways. Directly: the gradient on one batch against none's (``grad_rel_error`` = ||g - g_none|| /
||g_none||, free of chaos), at the common initial weights and again at none's trained weights
(``grad_rel_error_trained``). Over training: per step, ``|loss - none's
loss|`` on the same batch, its maximum and mean over the steps, and the final loss (mean of the last 5 steps)
against none's, to be read against the control's. Step time (forward + backward + optimizer step):
variants are stepped in turn within each step, the starting variant rotated, so machine drift hits all alike; the
ratio to ``none`` is taken per step and its median reported (the first 2 steps are warm-up, not timed).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zeroengine.activation_checkpointing import compress_saved_activations, use_bit_mask_relu  # noqa: E402
from zeroengine.activation_checkpointing.memory_probe import LiveTensorBytes  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "compressed_activations.json"
BF16_UNIT = 2.0 ** -8  # bf16's relative rounding error, at most
# variant -> (dtype of the saved tensors or None, bit-mask ReLU, relative gradient noise of the control)
VARIANTS = {
    "llama": {"none": (None, False, 0.0), "none+noise": (None, False, BF16_UNIT),
              "bf16": (torch.bfloat16, False, 0.0), "fp8": (torch.float8_e4m3fn, False, 0.0)},
    "llama-relu": {"none": (None, False, 0.0), "bitmask": (None, True, 0.0),
                   "fp8": (torch.float8_e4m3fn, False, 0.0), "fp8+bitmask": (torch.float8_e4m3fn, True, 0.0)},
}
WARMUP_STEPS = 2
FINAL_WINDOW = 5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 8 steps (a smoke test)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 60; quick 8)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; quick 2)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 256; quick 64)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 688; quick 172)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 4; quick 2)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 512; quick 128)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: leaves the other core alone)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    defaults = dict(steps=8 if args.quick else 60, layers=2 if args.quick else 4, hidden=64 if args.quick else 256,
                    intermediate=172 if args.quick else 688, heads=2 if args.quick else 4,
                    seq=128 if args.quick else 512)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    return args


def markov_batches(args) -> list[torch.Tensor]:
    """``steps`` batches of [batch, seq + 1] tokens from one fixed random chain (4 successors per token)."""
    g = torch.Generator().manual_seed(1234)
    successors = torch.stack([torch.randperm(args.vocab, generator=g)[:4] for _ in range(args.vocab)])
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    batches = []
    for _ in range(args.steps + 1):  # +1: the memory step's batch
        tokens = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(args.vocab, (args.batch,), generator=g)
        for t in range(1, args.seq + 1):
            pick = torch.multinomial(probs, args.batch, replacement=True, generator=g)
            tokens[:, t] = successors[tokens[:, t - 1], pick]
        batches.append(tokens)
    return batches


def build_model(args, act: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq, hidden_act=act,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Run:
    """One variant: its own copy of the model and optimizer, its context, its losses and times."""

    def __init__(self, name, base_model, spec):
        dtype, bitmask, self.noise = spec
        self.name = name
        self.model = copy.deepcopy(base_model)
        self.swapped = use_bit_mask_relu(self.model) if bitmask else 0
        if bitmask and not self.swapped:
            raise RuntimeError(f"{name}: no nn.ReLU module to swap")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.ctx = compress_saved_activations(dtype) if dtype is not None else None
        self.noise_gen = torch.Generator().manual_seed(7)
        self.losses, self.times = [], []

    def _context(self):
        return self.ctx if self.ctx is not None else nullcontext()

    def forward(self, tokens):
        with self._context():
            return self.model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss

    def backward(self, loss) -> None:
        with self._context():  # the context's statistics then describe forward and backward alike
            loss.backward()
        if self.noise:  # the control: every gradient element off by a relative N(0, noise)
            for p in self.model.parameters():
                p.grad.mul_(1 + self.noise * torch.randn(p.shape, generator=self.noise_gen))

    def step(self, tokens) -> float:
        t0 = time.perf_counter()
        loss = self.forward(tokens)
        self.backward(loss)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        self.times.append(time.perf_counter() - t0)
        self.losses.append(loss.item())
        return self.losses[-1]

    def gradient(self, tokens) -> torch.Tensor:
        """The gradient of the current weights on ``tokens``, flattened (weights unchanged, gradients left zero)."""
        self.backward(self.forward(tokens))
        grad = torch.cat([p.grad.flatten() for p in self.model.parameters()])
        self.model.zero_grad(set_to_none=False)
        return grad

    def memory(self, tokens) -> dict:
        """Bytes alive at the end of forward and at the peak, above the pre-step baseline (weights unchanged)."""
        self.gradient(tokens)  # warm-up: gradients allocated here are model state, not activations
        with LiveTensorBytes() as probe:
            loss = self.forward(tokens)
            held = probe.live.get("cpu", 0)
            loss.backward()
        self.model.zero_grad(set_to_none=False)
        out = {"held_for_backward_bytes": held, "peak_bytes": probe.peak.get("cpu", 0)}
        if self.ctx is not None:
            s = self.ctx.stats
            out["compressed"] = {"count": s.count, "original_bytes": s.original_bytes,
                                 "stored_bytes": s.stored_bytes, "shared_saves": s.shared}
        return out


def _rel_error(grad, exact) -> float:
    return ((grad - exact).norm() / exact.norm()).item()


def run_model(model_name, args, batches) -> dict:
    base = build_model(args, "silu" if model_name == "llama" else "relu")
    specs = VARIANTS[model_name]
    runs = [Run(name, base, spec) for name, spec in specs.items()]
    rows = {r.name: {"variant": r.name, **r.memory(batches[-1])} for r in runs}
    grads = {r.name: r.gradient(batches[-1]) for r in runs}
    for step in range(args.steps):
        for r in runs[step % len(runs):] + runs[:step % len(runs)]:
            r.step(batches[step])
        if step % 10 == 0 or step == args.steps - 1:
            print(f"  {model_name} step {step:>3}: " + "  ".join(f"{r.name} {r.losses[-1]:.4f}" for r in runs),
                  flush=True)
    ref = runs[0]
    # The gradient error again at none's trained weights: each variant's setting applied to a copy of them.
    trained = {name: Run(name, ref.model, spec).gradient(batches[-1]) for name, spec in specs.items()}
    for r in runs:
        row = rows[r.name]
        diffs = [abs(a - b) for a, b in zip(r.losses, ref.losses)]
        final, ref_final = (statistics.fmean(x.losses[-FINAL_WINDOW:]) for x in (r, ref))
        ratios = [a / b for a, b in zip(r.times[WARMUP_STEPS:], ref.times[WARMUP_STEPS:])]
        row.update(grad_rel_error=_rel_error(grads[r.name], grads[ref.name]),
                   grad_rel_error_trained=_rel_error(trained[r.name], trained[ref.name]),
                   held_ratio=row["held_for_backward_bytes"] / rows[ref.name]["held_for_backward_bytes"],
                   peak_ratio=row["peak_bytes"] / rows[ref.name]["peak_bytes"],
                   first_loss=r.losses[0], final_loss=final, final_loss_minus_none=final - ref_final,
                   max_abs_loss_diff=max(diffs), max_abs_loss_diff_step=diffs.index(max(diffs)),
                   mean_abs_loss_diff=statistics.fmean(diffs),
                   median_step_s=statistics.median(r.times[WARMUP_STEPS:]), step_time_ratio=statistics.median(ratios),
                   relu_modules_swapped=r.swapped, losses=r.losses)
    return {"model": model_name, "num_params": sum(p.numel() for p in base.parameters()),
            "variants": [rows[r.name] for r in runs]}


def print_table(results) -> None:
    print(f"\n{'model':<11} {'variant':<12} {'held MiB':>9} {'x none':>7} {'peak MiB':>9} {'x none':>7} "
          f"{'grad err':>8} {'trained':>8} {'final loss':>10} {'- none':>8} {'max|dloss|':>10} {'mean|dloss|':>11} "
          f"{'step ms':>8} {'x none':>7}")
    for res in results:
        for row in res["variants"]:
            print(f"{res['model']:<11} {row['variant']:<12} {row['held_for_backward_bytes'] / 2**20:>9.2f} "
                  f"{row['held_ratio']:>7.3f} {row['peak_bytes'] / 2**20:>9.2f} {row['peak_ratio']:>7.3f} "
                  f"{row['grad_rel_error']:>8.1e} {row['grad_rel_error_trained']:>8.1e} "
                  f"{row['final_loss']:>10.4f} {row['final_loss_minus_none']:>+8.4f} "
                  f"{row['max_abs_loss_diff']:>10.4f} {row['mean_abs_loss_diff']:>11.4f} "
                  f"{1e3 * row['median_step_s']:>8.1f} {row['step_time_ratio']:>7.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    batches = markov_batches(args)
    results = [run_model(name, args, batches) for name in VARIANTS]
    print_table(results)
    for res in results:  # the numbers the smoke test and the docs rely on must exist
        for row in res["variants"]:
            keys = ("held_ratio", "final_loss", "step_time_ratio", "grad_rel_error", "grad_rel_error_trained")
            assert all(math.isfinite(row[k]) for k in keys), row
    machine = {"device": "cpu", "torch": torch.__version__, "python": platform.python_version(),
               "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "load_average_start": load_start, "load_average_end": os.getloadavg()}
    settings = {k: getattr(args, k) for k in ("quick", "steps", "layers", "hidden", "intermediate", "heads",
                                              "vocab", "seq", "batch", "threads")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "settings": settings, "results": results}, indent=1))
    print(f"load average (1, 5, 15 min) at start {load_start}, at end {machine['load_average_end']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
