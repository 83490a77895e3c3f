"""A plain Lightning script: a small regression model, SGD (which, unlike Adam, shows a wrongly scaled
gradient) with a per-step schedule, 5 batches per rank per epoch (so accumulation 2 ends each epoch on a
half group). ``--strategy`` is "ddp" (the reference) or a zeroengine name. Each rank writes its per-step
losses and learning rates, and the final weights, to ``--report``.rank<R>.json."""
import argparse
import json
import logging
import warnings

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import zeroengine.integrations.lightning  # noqa: F401 (registers the zeroengine strategy names)
from zeroengine.zero import GatheredParameters

warnings.filterwarnings("ignore")
logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.losses, self.lrs = [], []

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def test_step(self, batch, index):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": sgd,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(sgd, 1, 0.9), "interval": "step"}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt_dir", default=None, help="save a checkpoint every 3 optimizer steps here")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    parser.add_argument("--test_only", default=None, help="no fit: trainer.test from this checkpoint")
    parser.add_argument("--report", required=True)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(10 * args.devices, 4, generator=g), torch.randn(10 * args.devices, 1, generator=g))
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=3, save_top_k=-1,
                                         filename="{step}"))
    model = Regression()
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=args.devices, strategy=args.strategy,
                         accumulate_grad_batches=args.accumulate, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, enable_checkpointing=bool(callbacks))
    if args.test_only:
        trainer.test(model, DataLoader(data, batch_size=2), ckpt_path=args.test_only)
    else:
        trainer.fit(model, DataLoader(data, batch_size=2), ckpt_path=args.resume)
    # After a stage-3 fit the parameters stay partitioned (as under DeepSpeed): gather them to read them.
    with torch.no_grad(), GatheredParameters(list(model.parameters())):
        weights = [p.detach().flatten().tolist() for p in model.parameters()]
    report = {"losses": model.losses, "lrs": model.lrs, "global_step": trainer.global_step, "weights": weights,
              "strategy": type(trainer.strategy).__name__}
    with open(f"{args.report}.rank{trainer.global_rank}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
