"""Train the example GPT with zeroengine, byte by byte on real text every machine has (the Python standard
library's own source), and print a sample from it at the end. Run it through the launcher:

    zeroengine --num_procs 2 examples/gpt/train.py --zeroengine_config examples/gpt/config.json

With Mixture-of-Experts layers (every other MLP; experts spread over --ep_size ranks):

    zeroengine --num_procs 2 examples/gpt/train.py --zeroengine_config examples/gpt/config_moe.json \
        --moe --num_experts 4 --ep_size 2
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import GPT, GPTConfig, SyntheticTokens  # noqa: E402
from text_data import PythonSourceBytes, sample  # noqa: E402

import zeroengine  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description="zeroengine example: a small byte-level GPT on Python source")
    parser.add_argument("--steps", type=int, default=300,
                        help="train until this many optimizer steps in all (with --resume: counting the resumed ones)")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--vocab_size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--data", choices=("python-source", "synthetic"), default="python-source",
                        help="the standard library's .py files as bytes, or tokens from a random bigram chain")
    parser.add_argument("--sample_bytes", type=int, default=200, help="bytes to sample from the model at the end")
    parser.add_argument("--moe", action="store_true", help="MoE variant (examples/gpt/moe_model.py)")
    parser.add_argument("--num_experts", type=int, default=4)
    parser.add_argument("--ep_size", type=int, default=1, help="ranks the experts of one MoE layer spread over")
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end")
    parser.add_argument("--resume", action="store_true", help="first load the latest checkpoint in --save_dir")
    zeroengine.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)
    if args.moe:
        from moe_model import MoEConfig, MoEGPT

        zeroengine.init_distributed()  # the MoE layers create their process groups when built
        model = MoEGPT(cfg, MoEConfig(num_experts=args.num_experts, ep_size=args.ep_size, k=args.top_k))
    else:
        model = GPT(cfg)
    if args.data == "python-source":
        if args.vocab_size != 256:
            raise SystemExit("--data python-source is byte-level: --vocab_size must be 256")
        data = PythonSourceBytes(args.block_size)
    else:
        data = SyntheticTokens(num_samples=8192, block_size=args.block_size, vocab_size=args.vocab_size,
                               seed=args.seed)
    engine, _, loader, _ = zeroengine.initialize(args=args, model=model, training_data=data)
    rank0 = engine.global_rank == 0
    if rank0:
        kind = (f"MoE GPT ({args.num_experts} experts, top-{args.top_k}, ep_size {args.ep_size})" if args.moe
                else "GPT")
        print(f"{kind} {model.num_params() / 1e6:.2f}M params | world {engine.world_size} | stage {engine.zero_stage} | "
              f"micro batch {engine.train_micro_batch_size_per_gpu()} x accumulation "
              f"{engine.gradient_accumulation_steps()} x ranks {engine.world_size} = {engine.train_batch_size()} "
              f"| loss at start should be about ln({cfg.vocab_size}) = {math.log(cfg.vocab_size):.2f}", flush=True)

    epoch = 0
    if args.resume and args.save_dir:
        path, client_state = engine.load_checkpoint(args.save_dir)
        if path is not None:
            epoch = client_state["epoch"]
            if rank0:
                print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    if engine.global_steps >= args.steps:
        if rank0:
            print(f"nothing to do: already at step {engine.global_steps}; pass --steps N with N > "
                  f"{engine.global_steps} to train further", flush=True)
        zeroengine.comm.shutdown()
        return

    engine.train()
    losses, start, first_step = [], time.perf_counter(), engine.global_steps
    while engine.global_steps < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(engine.device), y.to(engine.device)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary() or engine.gradient_accumulation_steps() == 1:
                losses.append(loss.item())
            if engine.global_steps >= args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch})

    tokens = (engine.global_steps - first_step) * engine.train_batch_size() * args.block_size
    mem = engine.memory_breakdown()
    if rank0:
        first, last = sum(losses[:5]) / len(losses[:5]), sum(losses[-5:]) / len(losses[-5:])
        print(f"done: {engine.global_steps - first_step} steps in {elapsed:.1f}s | {tokens / elapsed:,.0f} tokens/s | "
              f"loss {first:.3f} -> {last:.3f}", flush=True)
        print("memory per rank: " + ", ".join(f"{k} {v / 2**20:.1f}MiB" for k, v in mem.items()), flush=True)
    if args.data == "python-source" and args.sample_bytes > 0:
        engine.eval()  # every rank samples the same bytes (at stage 3 they run the same forwards); rank 0 prints
        text = sample(engine, b"def ", args.sample_bytes, args.block_size, engine.device, seed=args.seed)
        if rank0:
            print("sample:\n" + text.decode("utf-8", errors="replace"), flush=True)
    zeroengine.comm.shutdown()
    # The run's own check that it learned: only over 10 steps or more (with fewer, the first and last five
    # overlap), and not on a resume, whose learning rate may already be at its end (WarmupDecayLR reaches
    # 0 at total_num_steps).
    if rank0 and len(losses) >= 10 and not args.resume and not last < first:
        print("loss did not fall", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
