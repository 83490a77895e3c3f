"""Shared pieces of the parity tests: a tiny GPT, its data, and the single-process torch reference."""
from __future__ import annotations

import torch
from model import GPT, GPTConfig

# The attention key bias has a mathematically zero gradient (softmax ignores a
# constant added to every logit of a row), so its computed gradient is pure
# rounding noise (~1e-9) that depends on summation order. With Adam's default
# eps=1e-8, g/(sqrt(v)+eps) turns that noise into full lr-sized steps of random
# sign; eps=1e-6 keeps such noise from being amplified while leaving real
# gradients (1e-3..1e-1) unaffected, so parity measures the engine, not the noise.
ADAM_EPS = 1e-6

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def global_batches(steps: int, gas: int, world: int, micro: int, seed: int = 1):
    """batches[step][micro_step][rank] = (x, y); the same on every process."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        per_step = []
        for _ in range(gas):
            x = torch.randint(TINY.vocab_size, (world, micro, TINY.block_size), generator=g)
            y = torch.randint(TINY.vocab_size, (world, micro, TINY.block_size), generator=g)
            per_step.append([(x[r], y[r]) for r in range(world)])
        out.append(per_step)
    return out


def base_config(micro: int, gas: int, world: int, clip: float, lr: float = 1e-2, dtype: str = "fp32",
                stage: int = 0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * world,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "eps": ADAM_EPS}},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        "bf16": {"enabled": dtype == "bf16"},
        # small buckets, so even the tiny model spans several (and parameters straddle chunk edges); no
        # stage-3 persistence, so every parameter of the tiny model is partitioned
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0},
    }


def engine_losses(engine, batches, rank: int, world: int, device=None) -> list[float]:
    """Train ``engine`` on ``batches`` (global_batches' layout): forward, backward and step per micro-step.

    Returns each global step's loss, averaged over its micro-steps and over the ranks (a world of 1 is
    not reduced). ``device``: where to move the batch first (CUDA tests)."""
    from zeroengine import comm

    losses = []
    for step in batches:
        total = 0.0
        for micro_step in step:
            x, y = micro_step[rank] if device is None else (t.to(device) for t in micro_step[rank])
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / len(step)
        losses.append(comm.all_reduce_scalar(total) / world if world > 1 else total)
    return losses


def delayed_update_step(model, master, opt, sched, delayed: bool) -> None:
    """One optimizer step of offload's delayed update in plain torch: ``model`` (the weights forward runs on)
    holds this step's gradients, ``master`` is what ``opt`` steps. Delayed, the last update lands in the model
    before this one starts (so this gradient was taken one update late); undelayed, this update lands at once."""
    if delayed:
        copy_weights(model, master)
    for p, m in zip(model.parameters(), master.parameters()):
        m.grad = p.grad.clone()
    opt.step()
    sched.step()
    opt.zero_grad()
    model.zero_grad()
    if not delayed:
        copy_weights(model, master)


def copy_weights(dst, src) -> None:
    with torch.no_grad():
        for d, s in zip(dst.parameters(), src.parameters()):
            d.copy_(s)


def reference_run(steps: int, gas: int, world: int, micro: int, clip: float, lr: float = 1e-2, make_optimizer=None):
    """Plain single-process training on the same global batches; returns (losses, final params).
    ``make_optimizer(params)``: the optimizer (default: the configs' AdamW)."""
    model = make_model()
    opt = make_optimizer(model.parameters()) if make_optimizer is not None else torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=0.01, eps=ADAM_EPS)
    losses = []
    for step in global_batches(steps, gas, world, micro):
        x = torch.cat([xr for micro_step in step for xr, _ in micro_step])
        y = torch.cat([yr for micro_step in step for _, yr in micro_step])
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
