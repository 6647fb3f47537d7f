"""The rank half of ``LightningEstimator``: ``LightningTrainer``, the torch loop driving a LightningModule's hooks.

Why our own loop and not ``lightning.Trainer`` with a strategy of ours: the Trainer brings its own process launch,
device placement, checkpointing, loggers and progress bars, each of which spark_hvd already does (the runner,
``RankRun`` with the store, ``report``); a strategy would have to switch most of them off again, and the Trainer's
internals change between Lightning releases. The loop here is ``TorchTrainer``'s (resume, checkpoints, best epoch,
LR scheduler, callbacks, ``terminate_on_nan``, gradients averaged by ``spark_hvd.torch.DistributedOptimizer``)
and calls the module's own hooks: ``configure_optimizers``, ``on_train_epoch_start``, ``training_step(batch,
batch_idx)``, ``on_train_epoch_end``, ``on_validation_epoch_start``, ``validation_step``,
``on_validation_epoch_end``. ``batch`` is a dict of tensors keyed by column name (features, labels, sample
weight), Horovod's contract. ``self.log(name, value)`` / ``self.log_dict`` are recorded per batch and averaged
over every rank's rows into the history. The module is not attached to a ``Trainer``: ``self.trainer`` is
unavailable, and Lightning callbacks and loggers are not run (spark_hvd's torch-loop callbacks are).
"""

from __future__ import annotations

from typing import Any

from spark_hvd.estimators.errors import param_error, param_type_error
from spark_hvd.estimators.rank_run import RankRun
from spark_hvd.estimators.torch_rank import TorchTrainer

__all__ = ["LightningTrainer", "split_optimizers"]


def split_optimizers(configured: Any) -> tuple[Any, Any, str]:
    """``configure_optimizers()``'s result -> (optimizer, scheduler or None, "epoch" | "batch").

    Accepted: an optimizer; a list/tuple of one; ``([optimizer], [scheduler])``; a dict ``{"optimizer": ...,
    "lr_scheduler": scheduler | {"scheduler": ..., "interval": "epoch" | "step"}}``. Several optimizers are an error.
    """
    import torch

    scheduler, interval = None, "epoch"
    if isinstance(configured, dict):
        optimizer, scheduler = configured.get("optimizer"), configured.get("lr_scheduler")
    elif isinstance(configured, list | tuple) and len(configured) == 2 and isinstance(configured[0], list | tuple):
        optimizers, schedulers = configured
        if len(optimizers) != 1 or len(schedulers) > 1:
            raise param_error("LightningEstimator", "configure_optimizers must give one optimizer and at most one "
                              f"scheduler, got {len(optimizers)} and {len(schedulers)}")
        optimizer, scheduler = optimizers[0], (schedulers[0] if schedulers else None)
    elif isinstance(configured, list | tuple):
        if len(configured) != 1:
            raise param_error("LightningEstimator", f"configure_optimizers gave {len(configured)} optimizers; one is "
                              "supported")
        optimizer = configured[0]
    else:
        optimizer = configured
    if isinstance(scheduler, dict):
        interval = "batch" if scheduler.get("interval", "epoch") == "step" else "epoch"
        scheduler = scheduler.get("scheduler")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise param_type_error("LightningEstimator", f"configure_optimizers must give a torch.optim.Optimizer, got "
                               f"{type(optimizer).__name__}")
    return optimizer, scheduler, interval


def _scalar(value: Any) -> float:
    return float(value.detach()) if hasattr(value, "detach") else float(value)


class LightningTrainer(TorchTrainer):
    """``TorchTrainer`` whose optimizer, step and metrics come from the LightningModule (see the module docstring)."""

    def _build_training(self, spec: Any) -> tuple[Any, str]:
        import torch

        self._bool = torch.bool
        self._acc: dict[str, float] = {}
        self._rows = 0
        module = self.model

        def log(name: str, value: Any, *args: Any, batch_size: int | None = None, **kwargs: Any) -> None:
            n = batch_size or self._rows
            self._acc[name] = self._acc.get(name, 0.0) + _scalar(value) * n

        def log_dict(dictionary: dict, *args: Any, batch_size: int | None = None, **kwargs: Any) -> None:
            for name, value in dictionary.items():
                log(name, value, batch_size=batch_size)

        # instance attributes shadow LightningModule.log/log_dict (which need a Trainer) on this rank's copy only
        object.__setattr__(module, "log", log)
        object.__setattr__(module, "log_dict", log_dict)
        optimizer, self._user_scheduler, interval = split_optimizers(module.configure_optimizers())
        return optimizer, interval

    def _build_scheduler(self, spec: Any) -> Any:
        scheduler = self._user_scheduler
        if scheduler is not None:
            # the scheduler was built on the plain optimizer: point it at the one that averages gradients, and
            # drop the step wrapper it installed (copied along with the optimizer's attributes)
            self.optimizer.__dict__.pop("step", None)
            scheduler.optimizer = self.optimizer
        return scheduler

    def _batch(self, batch: dict) -> dict:
        inputs, labels, sw = self._tensors(batch)
        out = dict(zip(self.spec.feature_cols, inputs, strict=True))
        # integer labels as int64 (what class-index losses take), as integer features are
        out.update((c, y.long() if not y.is_floating_point() and y.dtype != self._bool else y)
                   for c, y in zip(self.spec.label_cols, labels, strict=True))
        if sw is not None:
            out[self.spec.sample_weight_col] = sw
        return out

    def _loss_of(self, result: Any) -> Any:
        return result["loss"] if isinstance(result, dict) else result

    def _epoch_start(self) -> None:
        self.model.on_train_epoch_start()

    def _epoch_end(self) -> None:
        self.model.on_train_epoch_end()

    def _train_batch(self, batch: dict, step: int, acc: dict) -> tuple[float, int]:
        bpps = self.spec.backward_passes_per_step
        data = self._batch(batch)
        n = int(next(iter(data.values())).shape[0])
        self._acc, self._rows = acc, n
        if step % bpps == 0:
            self.optimizer.zero_grad()
        loss = self._loss_of(self.model.training_step(data, step))
        if loss is None:
            raise param_error("LightningEstimator", "training_step returned None; return the loss (or {'loss': ...})")
        (loss / bpps if bpps > 1 else loss).backward()
        if (step + 1) % bpps == 0:
            self.optimizer.step()
        value = _scalar(loss)
        acc["loss"] = acc.get("loss", 0.0) + value * n
        return value, n

    def _validate(self, run: RankRun, epoch: int) -> dict[str, float]:
        import torch

        self.model.eval()
        acc: dict[str, float] = {}
        rows, returned = 0, None
        self.model.on_validation_epoch_start()
        with torch.no_grad():
            for step, batch in enumerate(run.readers.epoch("val", epoch)):
                data = self._batch(batch)
                n = int(next(iter(data.values())).shape[0])
                self._acc, self._rows = acc, n
                result = self.model.validation_step(data, step)
                if result is not None:  # a returned loss counts as val_loss unless the step logs one itself
                    returned = (returned or 0.0) + _scalar(self._loss_of(result)) * n
                rows += n
        self.model.on_validation_epoch_end()
        if returned is not None and "val_loss" not in acc:
            acc["val_loss"] = returned
        return self._epoch_metrics(acc, rows)

    def save_model(self, directory: str) -> None:
        for name in ("log", "log_dict"):  # our recording hooks are not part of the module
            self.model.__dict__.pop(name, None)
        super().save_model(directory)
