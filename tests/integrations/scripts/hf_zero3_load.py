"""ZeRO-3 loading and saving through Hugging Face, as a user's script does it.

1. ``from_pretrained`` under ``HfDeepSpeedConfig`` (zero.Init, then transformers' per-module
   GatheredParameters load) must give exactly the weights in ``--model_dir``;
2. a Trainer trains it a few steps at stage 3 and ``save_model()`` writes the weights;
3. the saved file must hold every weight at its full shape (none empty) and equal the trained weights;
4. ``from_pretrained`` of the saved folder under ZeRO-3 must give exactly the saved weights.
Rank 0 writes a JSON report of what it found."""
import argparse
import json
import os

import torch
from hf_trainer_run import Tokens
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.integrations import HfDeepSpeedConfig


def gathered(model):
    import deepspeed  # zeroengine, under ZEROENGINE_AS_DEEPSPEED=1

    out = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def differences(got, want):
    return sorted(n for n in want if n not in got or got[n].shape != want[n].shape or not torch.equal(got[n], want[n]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True, help="a save_pretrained folder (model.safetensors)")
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--deepspeed", required=True)
    args = parser.parse_args()

    training = TrainingArguments(output_dir=args.out_dir, per_device_train_batch_size=2, max_steps=4,
                                 learning_rate=1e-2, report_to=[], deepspeed=args.deepspeed, disable_tqdm=True,
                                 save_strategy="no", seed=0)
    keep = HfDeepSpeedConfig(training.hf_deepspeed_config.config)  # noqa: F841 (zero.Init while it lives)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    report = {"partitioned": sum(getattr(p, "_ze", None) is not None for p in model.parameters()),
              "params": sum(1 for _ in model.parameters())}
    initial = load_file(os.path.join(args.model_dir, "model.safetensors"))
    report["load_differs"] = differences(gathered(model), initial)

    trainer = Trainer(model=model, args=training, train_dataset=Tokens(n=16, length=16, vocab=64))
    trainer.train()
    trained = gathered(model)
    trainer.save_model(args.out_dir)
    rank0 = trainer.args.process_index == 0
    if rank0:
        saved = load_file(os.path.join(args.out_dir, "model.safetensors"))
        shapes = {n: list(t.shape) for n, t in trained.items()}
        report["saved_empty"] = sorted(n for n, t in saved.items() if t.numel() == 0)
        report["saved_wrong_shape"] = sorted(n for n, t in saved.items() if n in shapes and list(t.shape) != shapes[n])
        report["saved_differs_from_trained"] = differences(saved, {n: t for n, t in trained.items() if n in saved})
        report["trained_moved"] = any(not torch.equal(trained[n], initial[n]) for n in initial if n in trained)
        report["saved_names"] = sorted(saved)
    torch.distributed.barrier()
    reloaded = AutoModelForCausalLM.from_pretrained(args.out_dir)
    back = gathered(reloaded)
    if rank0:
        report["reload_differs"] = differences(back, saved)
        report["reloaded_params"] = sorted(back)
        with open(args.report, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
