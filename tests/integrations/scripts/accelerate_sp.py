"""accelerate's own loop with DeepSpeed's Ulysses sequence parallelism (ALST), written as accelerate documents it:
``Accelerator(deepspeed_plugin=..., parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N, ...))``,
``prepare`` wrapping the DataLoader in DeepSpeed's ``UlyssesSPDataLoaderAdapter``, and the loss of the whole
sequence gathered from the sequence group's pieces (accelerate's ALST test script does the same). Without ``--sp``
(or with ``--sp 1``) it is the same loop without sequence parallelism.

A local Llama (``--model``, sdpa attention), fixed random sequences with ``position_ids`` and a -100 prompt, the
script's torch SGD, accumulation 2 (``--grad_accum``) and clipping 1.0 in the plugin, 3 optimizer steps.
``--dp_shard`` sets the data-parallel ranks beside the sequence groups (world = dp_shard · sp). Rank 0
writes the losses to ``--report`` and the full weights (``get_state_dict``) beside it."""
import argparse
import json

import torch
from accelerate import Accelerator, DeepSpeedPlugin, ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from sp_sequences import LENGTH, Sequences
from transformers import AutoModelForCausalLM

STEPS = 3




def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--dp_shard", type=int, default=1, help="data-parallel ranks beside the sequence groups")
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--report", required=True)
    args = parser.parse_args()

    plugin = DeepSpeedPlugin(zero_stage=args.stage, gradient_accumulation_steps=args.grad_accum, gradient_clipping=1.0,
                             zero3_save_16bit_model=True)
    parallelism = None
    if args.sp > 1:
        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=args.sp, dp_shard_size=args.dp_shard,
                                        sp_handler=DeepSpeedSequenceParallelConfig(
                                            sp_seq_length=LENGTH, sp_seq_length_is_variable=True,
                                            sp_attn_implementation="sdpa"))
    accelerator = Accelerator(deepspeed_plugin=plugin, parallelism_config=parallelism)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(Sequences(16, seed=1), batch_size=2, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    unwrapped = accelerator.unwrap_model(model)
    if args.sp > 1:
        from deepspeed.utils import groups

        sp_group = groups._get_sequence_parallel_group()

    model.train()  # (from_pretrained leaves the model in eval mode, where accelerate's registration turns SP off)
    losses = []
    for step, batch in enumerate(loader):
        if step == STEPS * args.grad_accum:
            break
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with accelerator.accumulate(model):
            if args.sp > 1:
                outputs = model(**batch)
                shift_labels = batch["shift_labels"]
                loss = unwrapped.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                               vocab_size=unwrapped.config.vocab_size)
                # differentiable weighted per-shard-loss aggregation across the sequence group
                losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
                good_tokens = (shift_labels != -100).view(-1).sum()
                good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
                total_loss = sum(losses_per_rank[r] * good_tokens_per_rank[r] for r in range(args.sp)
                                 if good_tokens_per_rank[r] > 0)
                loss = total_loss / max(sum(good_tokens_per_rank), 1)
            else:
                loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())

    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, args.report + ".weights.pt")
        with open(args.report, "w") as f:
            json.dump({"loss": losses, "world": accelerator.num_processes,
                       "engine": f"{type(model).__module__}.{type(model).__name__}",
                       "loader": type(loader).__name__}, f)


if __name__ == "__main__":
    main()
