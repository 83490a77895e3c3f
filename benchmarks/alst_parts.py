"""What the long-context benchmarks share (bench_long_context.py on CPU ranks, bench_long_context_gpu.py on one
GPU): ALST's tiled pieces applied to a Hugging Face Llama the tutorial's way, and the search for the longest
sequence that trains."""
from __future__ import annotations

import torch

ALIGN = 256  # sequence lengths are multiples of this


class LengthSearch:
    """Which length to try next: doubling from ``start`` while every trial trains, then bisection between the
    longest success and the shortest failure until they are at most ``granularity`` apart. ``next()`` is None
    when done; ``reason`` says why ("narrowed", "max_seq", or "nothing_fits" when even ``granularity`` fails)."""

    def __init__(self, start: int, granularity: int, max_seq: int, align: int = ALIGN):
        if start % align or granularity % align or start <= 0 or granularity <= 0:
            raise ValueError(f"start and granularity must be positive multiples of {align}")
        self.start, self.granularity, self.align = start, granularity, align
        self.max_seq = max_seq // align * align
        self.longest_ok: int | None = None  # the longest length that trained
        self.first_failed: int | None = None  # the shortest that failed

    def record(self, seq: int, ok: bool) -> None:
        if ok:
            self.longest_ok = max(self.longest_ok or 0, seq)
        else:
            self.first_failed = min(self.first_failed or seq, seq)

    def next(self) -> int | None:
        if self.first_failed is None:
            if self.longest_ok is None:
                return min(self.start, self.max_seq)
            return None if self.longest_ok >= self.max_seq else min(2 * self.longest_ok, self.max_seq)
        lo = self.longest_ok or 0
        if self.first_failed - lo <= self.granularity:
            return None
        mid = (lo + self.first_failed) // 2 // self.align * self.align
        return mid if lo < mid < self.first_failed else None

    @property
    def reason(self) -> str:
        return "max_seq" if self.first_failed is None else "narrowed" if self.longest_ok else "nothing_fits"


def predict_seconds(trials: list[dict], seq: int) -> float | None:
    """A trial's expected time at ``seq``: the longest success's forward+backward scaled by the squared length
    ratio (attention's cost; an over-estimate while the linear terms dominate), plus its optimizer step."""
    last = max((t for t in trials if t["outcome"] == "ok"), key=lambda t: t["seq"], default=None)
    return None if last is None else last["optimizer_s"] + last["forward_backward_s"] * max(1.0, seq / last["seq"]) ** 2


class LossOf(torch.nn.Module):
    """The engine's model: the Llama's mean loss over this rank's scored tokens. With ``tile_logits``, its body,
    then its head and loss in tiles of about that many logits (TiledFusedLogitsLoss: no whole logits tensor);
    with None, the model's own logits and loss."""

    def __init__(self, lm, tile_logits: int | None):
        super().__init__()
        self.lm, self.tile_logits = lm, tile_logits

    def forward(self, input_ids, position_ids, shift_labels):
        from zeroengine.sequence_parallel import TiledFusedLogitsLoss

        if self.tile_logits is None:
            logits = self.lm(input_ids=input_ids, position_ids=position_ids).logits
            return self.lm.loss_function(logits=logits, labels=None, shift_labels=shift_labels,
                                         vocab_size=self.lm.config.vocab_size)
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        shards = -(-hidden.shape[1] // max(1, self.tile_logits // self.lm.config.vocab_size))  # tiles of ~tile_logits
        total = TiledFusedLogitsLoss.apply(_loss_sum, self.lm, hidden, shift_labels, None, shards,
                                           [self.lm.lm_head.weight], "sum")
        return total / (shift_labels != -100).sum().clamp(min=1)


def _loss_sum(lm, hidden, labels):
    logits = lm.lm_head(hidden).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")


def tiled_mlp_forward(mlp, x):
    """``LlamaMLP.forward`` through TiledMLP (the tutorial's patch): ``shards_for`` pieces along the sequence."""
    from zeroengine.sequence_parallel import TiledMLP, shards_for

    def forward(module, piece):
        return module.down_proj(module.act_fn(module.gate_proj(piece)) * module.up_proj(piece))

    return TiledMLP.apply(forward, mlp, x, shards_for(x.shape[-2], x.shape[-1]), list(mlp.parameters()))
