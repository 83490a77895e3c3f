"""A Hugging Face Trainer script with DeepSpeed's Ulysses sequence parallelism (ALST), as transformers documents
it: ``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N, ...))`` beside
``deepspeed=CONFIG``. Without ``--sp`` (or with ``--sp 1``) it is the same run without sequence parallelism.

A local Llama (``--model``, sdpa attention) trains on fixed random token sequences that carry ``position_ids``
(the sequence-parallel attention needs them) and mask their first tokens with -100 (a prompt, so that the pieces
of a sequence hold different numbers of scored tokens). The Trainer's own SGD at a constant rate, gradient
clipping 1.0, micro-batch 2, accumulation 2. Afterwards it evaluates (without sequence parallelism: the eval
loader is not adapted, the attention falls back to the model's) and saves the model. Rank 0 writes a report."""
import argparse
import json
import os

import torch
from accelerate import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from sp_sequences import LENGTH, Sequences
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--report", required=True)
    args = parser.parse_args()

    parallelism = None
    if args.sp > 1:
        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=args.sp, sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length=LENGTH, sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=2, per_device_eval_batch_size=1,
        gradient_accumulation_steps=2, max_steps=3, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        data_seed=0, deepspeed=args.deepspeed, parallelism_config=parallelism, dataloader_drop_last=True,
        disable_tqdm=True, use_cpu=not torch.cuda.is_available() and args.deepspeed is None)
    model = AutoModelForCausalLM.from_pretrained(args.model)  # (after TrainingArguments: zero.Init at stage 3)
    trainer = Trainer(model=model, args=training, train_dataset=Sequences(16, seed=1),
                      eval_dataset=Sequences(4, seed=2))
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(args.output_dir)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    if trainer.args.process_index == 0:
        with open(args.report, "w") as f:
            json.dump({"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs],
                       "eval_loss": metrics["eval_loss"], "world": int(os.environ.get("WORLD_SIZE", 1)),
                       "wrapped": f"{type(trainer.model_wrapped).__module__}.{type(trainer.model_wrapped).__name__}",
                       "train_loader": type(trainer.callback_handler.train_dataloader).__name__}, f)


if __name__ == "__main__":
    main()
