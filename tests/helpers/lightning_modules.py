"""The small LightningModule the Lightning fit tests that lose a rank share: a linear regression trained with SGD
and momentum (so a resume must restore the optimizer's state), its loss on one batch of tensors.

The training ranks cannot import the test modules, so this module travels by value (cloudpickle) with the module.
"""

from __future__ import annotations

import sys

import cloudpickle
import lightning.pytorch as pl
import torch

cloudpickle.register_pickle_by_value(sys.modules[__name__])

LR = 0.05


def mse(module: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The regression's mean squared error on a batch of tensors keyed by column (``features``, ``y``)."""
    return torch.nn.functional.mse_loss(module(batch["features"]).squeeze(1), batch["y"].float())


def numpy_mse(module: torch.nn.Module, batch: dict) -> torch.Tensor:
    """``mse`` on a reader's batch of numpy arrays (what ``helpers.torch_replay.replay`` trains on)."""
    return mse(module, {k: torch.from_numpy(v) for k, v in batch.items()})


class Reg(pl.LightningModule):
    """``Linear(3, 1)`` trained on ``mse`` by SGD (``LR``, momentum 0.9)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x)

    def training_step(self, batch, batch_idx):
        return mse(self, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
