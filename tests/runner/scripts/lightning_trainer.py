"""A user's own Lightning script (``Trainer(strategy="ddp")``), unmodified: under ``run()`` Lightning finds
torchrun's environment (its TorchElasticEnvironment) and its ``init_process_group`` meets over the job's store.
Rank 0 writes what a callback saw to ``--dir``/hooks.json; the CSVLogger writes under ``--dir``."""

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
args = parser.parse_args()


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Hooks(L.Callback):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_fit_start(self, trainer, module):
        self.seen.append(f"fit_start world={trainer.world_size} rank={trainer.global_rank} "
                         f"env={type(trainer.strategy.cluster_environment).__name__}")

    def on_train_epoch_end(self, trainer, module):
        self.seen.append(f"epoch_end {trainer.current_epoch}")

    def on_fit_end(self, trainer, module):
        self.seen.append("fit_end")


torch.manual_seed(0)
x = torch.randn(64, 4)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
hooks = Hooks()
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                    num_nodes=int(os.environ["GROUP_WORLD_SIZE"]), strategy="ddp", max_epochs=2,
                    gradient_clip_val=1.0, callbacks=[hooks], logger=CSVLogger(args.dir, name="csv", version=0),
                    log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False)
trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=8))
if trainer.global_rank == 0:
    with open(os.path.join(args.dir, "hooks.json"), "w") as f:
        json.dump(hooks.seen, f)
