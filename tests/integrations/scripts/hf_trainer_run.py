"""A Hugging Face Trainer script, unchanged from what a user runs with DeepSpeed: a tiny random GPT-2
trained on fixed random tokens. With ``--deepspeed CONFIG`` the Trainer goes through ``import deepspeed``
(zeroengine under ZEROENGINE_AS_DEEPSPEED=1). Writes the per-step loss and grad norm, and what it saw
of the wrapped model, to ``--report`` (rank 0)."""
import argparse
import json
import math
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, length, vocab, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


WARMUP = 3


def deepspeed_warmup_lr(optimizer):
    """The reference for the templates' WarmupLR as the Trainer fills it (min 0, max the lr, WARMUP steps, log
    warmup), from DeepSpeed 0.19.8's schedule: its i-th optimizer step (from 0) applies lr * log(i) / log(WARMUP)
    up to step WARMUP (so the first two apply 0), then lr."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: 0.0 if i == 0 else min(1.0, math.log(i) / math.log(WARMUP)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--save_steps", type=int, default=3)
    parser.add_argument("--resume", default=None, help="a checkpoint-N folder to resume from")
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--trainer_optimizer", action="store_true",
                        help="the plain run uses the Trainer's own AdamW and linear schedule (the reference for a "
                             "config without optimizer and scheduler sections)")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    model = tiny_gpt2()
    # weight_decay 0: the plain Trainer exempts biases and norms from decay, a config's AdamW does not.
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.max_steps, learning_rate=1e-2,
        warmup_steps=WARMUP, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_steps=args.save_steps,
        save_strategy="steps", report_to=[], seed=0, data_seed=0, deepspeed=args.deepspeed,
        dataloader_drop_last=True, disable_tqdm=True, use_cpu=not torch.cuda.is_available() and args.deepspeed is None,
    )
    data = Tokens(n=64, length=16, vocab=64)
    optimizers = (None, None)
    if args.deepspeed is None and not args.trainer_optimizer:  # the reference for the templates' AdamW and WarmupLR
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        optimizers = (adamw, deepspeed_warmup_lr(adamw))
    trainer = Trainer(model=model, args=training, train_dataset=data, optimizers=optimizers)
    trainer.train(resume_from_checkpoint=args.resume)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    wrapped = trainer.model_wrapped
    if trainer.args.process_index == 0:
        with open(args.report, "w") as f:
            json.dump({
                "steps": [e["step"] for e in logs], "loss": [e["loss"] for e in logs],
                "grad_norm": [e.get("grad_norm") for e in logs],
                "wrapped": f"{type(wrapped).__module__}.{type(wrapped).__name__}",
                "world": world,
            }, f)


if __name__ == "__main__":
    main()
