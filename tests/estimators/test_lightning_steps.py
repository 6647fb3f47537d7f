"""Where ``LightningEstimator`` takes step checkpoints inside Lightning's own loop (``lightning_steps.py``), in one
process on a real ``lightning.Trainer``: every batch but the epoch's last, a batch a validation run follows
(``val_check_interval=0.5``) and a batch inside a gradient accumulation."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402

from spark_hvd.estimators.lightning.steps import StepCheckpoints  # noqa: E402

STEPS = 8


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.lin(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        return self.lin(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Checkpoints(pl.Callback):
    """Calls ``StepCheckpoints.batch_end`` as the bridge does, with a run that records where ``step_end`` ran."""

    def __init__(self) -> None:
        self.taken: list[int] = []
        run = SimpleNamespace(start_step=0, resume_progress={}, checkpoints_inside_epochs=True,
                              readers=SimpleNamespace(steps=lambda split: STEPS),
                              step_end=lambda epoch, step, progress: self.taken.append(step))
        owner = SimpleNamespace(recorder=SimpleNamespace(train={}, train_rows=0, outside={}, lr=None, val={},
                                                         val_rows=0, val_returned=None))
        self.steps = StepCheckpoints(owner, run)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.batch_end(trainer, batch_idx)


@pytest.mark.parametrize("accumulate,taken", [(1, [0, 1, 2, 4, 5, 6]), (2, [1, 5])])
def test_no_step_checkpoint_before_a_validation_at_the_epoch_end_or_inside_an_accumulation(accumulate, taken):
    data = torch.utils.data.DataLoader(torch.randn(STEPS * 2, 2), batch_size=2)
    callback = _Checkpoints()
    trainer = pl.Trainer(max_epochs=1, val_check_interval=0.5, accumulate_grad_batches=accumulate,
                         callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Tiny(), data, data)
    assert callback.taken == taken  # validation runs after batches 3 and 7 (8 batches, half an epoch each)
