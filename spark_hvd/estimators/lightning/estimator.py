"""``LightningEstimator`` and ``LightningModel``: a ``lightning`` LightningModule trained like a torch module.

The module travels and is saved as ``TorchEstimator``'s modules are (cloudpickle, trained weights as a state dict);
the rank half is ``lightning/rank.py``.
"""

from __future__ import annotations

import posixpath
from typing import Any

from spark_hvd.estimators.common.errors import param_error, param_type_error
from spark_hvd.estimators.common.params import KeywordParams
from spark_hvd.estimators.lightning.checks import check_trainer_settings
from spark_hvd.estimators.lightning.params import LightningEstimatorParams
from spark_hvd.estimators.lightning.rank import CHECKPOINT_FILE, LightningTrainer
from spark_hvd.estimators.lightning.spec import LightningSpec
from spark_hvd.estimators.torch.estimator import TorchModel, TorchModuleEstimator
from spark_hvd.store.run_dir import RunDir

__all__ = ["LightningEstimator", "LightningModel"]


class LightningModel(TorchModel):
    """A trained LightningModule as a Spark ML ``Model``: ``transform`` calls its ``forward`` on batches, as
    ``TorchModel`` does; ``getModel()`` is the LightningModule."""


class LightningEstimator(KeywordParams, TorchModuleEstimator, LightningEstimatorParams):
    """Data-parallel training of a ``lightning`` LightningModule on a Spark DataFrame; ``fit`` -> ``LightningModel``.

    Example::

        class Net(lightning.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

            def forward(self, x):
                return self.net(x)

            def training_step(self, batch, batch_idx):
                loss = F.cross_entropy(self(batch["features"]), batch["label"])
                self.log("train_loss", loss)
                return loss

            def validation_step(self, batch, batch_idx):
                self.log("val_acc", (self(batch["features"]).argmax(1) == batch["label"]).float().mean())

            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-2)

        est = LightningEstimator(num_proc=2, store=store, model=Net(), feature_cols=["features"],
                                 label_cols=["label"], batch_size=32, epochs=5, validation=0.2)
        fitted = est.fit(df)              # fitted.getModel() is the trained Net

    Each rank runs Lightning's own ``lightning.Trainer.fit`` with a ``DDPStrategy`` over torch.distributed, which
    meets over the job's authenticated store (``lightning/rank.py``, ``lightning/env.py``): gradients are averaged
    by DDP, and Lightning runs ``configure_optimizers`` (one or several optimizers with manual optimization, LR
    schedulers), precision, gradient clipping and accumulation, ``callbacks`` (Lightning callbacks), ``logger`` and
    ``self.log``. Batches are dicts of tensors keyed by column name (features shaped by ``input_shapes`` if given),
    from the rank's shard of the prepared data. ``self.log``/``self.log_dict`` values are averaged over all ranks'
    rows per epoch: ``getHistory()`` has them by the logged name, plus ``loss`` (the mean of ``training_step``'s
    loss), ``val_loss`` (what ``validation_step`` returns, unless it logs ``val_loss`` itself) and ``lr`` under a
    scheduler. Checkpoints (Lightning's full state, once an epoch, and inside epochs with
    ``checkpoint_every_steps`` / ``_seconds``: a resume continues at the exact batch), resume by ``run_id``, retries,
    ``elastic``, ``terminate_on_nan``, ``scale_lr_by_num_proc``, MLflow and progress work as for ``TorchEstimator``.
    ``optimizer``, ``loss`` and ``metrics`` are not params here (the module defines them), nor
    ``gradient_compression`` (DDP averages); except for a plain ``torch.nn.Module`` (Horovod's legacy estimator),
    which they train with ``TorchEstimator``'s step on Lightning's Trainer (``lightning/legacy.py``; ``getModel()``
    is then the plain module). docs/estimators.md lists what the Trainer is given (``profiler`` included).
    """

    _model_class = LightningModel
    _spec_class = LightningSpec
    _trainer_class = LightningTrainer

    def _check_model(self, model: Any) -> bytes:
        import lightning.pytorch as pl
        import torch

        if not isinstance(model, pl.LightningModule):
            if not isinstance(model, torch.nn.Module):
                raise param_type_error("LightningEstimator", f"model must be a lightning LightningModule (or a "
                                       f"torch.nn.Module with optimizer and loss), got {type(model).__name__}")
            legacy = self._legacy_module(model)
            check_trainer_settings(self, legacy)
            return super()._check_model(legacy)
        for hook in ("training_step", "configure_optimizers"):
            if getattr(type(model), hook) is getattr(pl.LightningModule, hook):
                raise param_type_error("LightningEstimator", f"{type(model).__name__} does not define {hook}")
        for param in ("optimizer", "loss", "metrics", "loss_weights"):
            if self._opt(getattr(self, param)):
                raise param_error("LightningEstimator",
                                  f"{param} is defined by the LightningModule (configure_optimizers"
                                  ", training_step, self.log); leave the {param} param unset")
        check_trainer_settings(self, model)
        return super()._check_model(model)

    def _legacy_module(self, model: Any) -> Any:
        """A plain torch module as Horovod's legacy Lightning estimator takes it: wrapped with the estimator's
        optimizer, loss, loss_weights, metrics and sample_weight_col (``lightning/legacy.py``)."""
        from spark_hvd.estimators.lightning.legacy import LegacyModule
        from spark_hvd.estimators.torch.rank import resolve_losses, resolve_metric
        from spark_hvd.estimators.torch.serde import optimizer_spec

        name = type(model).__name__
        opt, loss = self._opt(self.optimizer), self._opt(self.loss)
        if opt is None or loss is None:
            raise param_error("LightningEstimator", f"model {name} is a plain torch.nn.Module: set optimizer and "
                              "loss (it is trained as TorchEstimator trains it), or give a LightningModule")
        labels = list(self.getOrDefault(self.label_cols))
        resolve_losses(loss, len(labels))
        for m in self._metrics():
            resolve_metric(m)
        return LegacyModule(model, optimizer_spec(opt, model), loss, self.getOrDefault(self.loss_weights),
                            tuple(self._metrics()), list(self.getOrDefault(self.feature_cols)), labels,
                            self._opt(self.sample_weight_col))

    def _load_trained_model(self, store: Any, run_id: str, model_bytes: bytes) -> Any:
        """The trained module; for a plain torch module (``LegacyModule``), that module, as Horovod returns it."""
        from spark_hvd.estimators.lightning.legacy import LegacyModule

        model = super()._load_trained_model(store, run_id, model_bytes)
        return model.model if isinstance(model, LegacyModule) else model

    def _check(self, df: Any) -> dict:
        """First (before any Spark job): a run to resume must hold Lightning checkpoints (a run of the earlier
        own-loop LightningEstimator, or of another estimator, cannot be resumed here); then the shared checks."""
        run_id, store = self.getOrDefault(self.run_id), self._opt(self.store)
        if run_id and store is not None:
            if isinstance(store, str):
                from spark_hvd.store import Store

                store = Store.create(store)
            store.run_path(run_id)  # checks the name (the shared checks' error)
            run_dir = RunDir(store, run_id)
            epochs = run_dir.list_checkpoints()
            if epochs and not store.exists(posixpath.join(run_dir.checkpoint_path(epochs[-1]), CHECKPOINT_FILE)):
                raise param_error(self, f"run_id {run_id!r} has a checkpoint of epoch {epochs[-1]} without "
                                  f"{CHECKPOINT_FILE} (not written by LightningEstimator's Trainer); give a new "
                                  "run_id")
            if self.getOrDefault(self.checkpoint_every_steps) or self.getOrDefault(self.checkpoint_every_seconds):
                self._check_step_checkpoint(run_dir, (epochs[-1] + 1, 0) if epochs else (0, 0))
        self._apply_num_gpus()
        return super()._check(df)

    def _apply_num_gpus(self) -> None:
        """Horovod's ``num_gpus`` (GPUs per rank) as ``use_gpu``'s default for this fit: 1 -> True, 0 -> False;
        more, or a ``use_gpu`` set to the other meaning, is refused naming both."""
        num_gpus = self.getOrDefault(self.num_gpus)
        if num_gpus is None:
            self._setDefault(use_gpu=None)  # the shared default (a num_gpus of an earlier fit is gone)
            return
        if num_gpus not in (0, 1):
            raise param_error(self, f"num_gpus={num_gpus}: each rank trains on one device (its Spark task's GPU, or "
                              "the CPU); give 1 or 0, and more ranks (num_proc) for more GPUs")
        if self.isSet(self.use_gpu) and self.getOrDefault(self.use_gpu) is not None \
                and bool(self.getOrDefault(self.use_gpu)) != bool(num_gpus):
            raise param_error(self, f"num_gpus={num_gpus} and use_gpu={self.getOrDefault(self.use_gpu)} disagree; "
                              "give one of them")
        self._setDefault(use_gpu=bool(num_gpus))

    def _check_step_checkpoint(self, run_dir: RunDir, after: tuple[int, int]) -> None:
        """The newest committed step checkpoint later than ``after`` (the one a resume would take) must be
        Lightning's."""
        store, run_id = run_dir.store, run_dir.run_id
        for (epoch, step), path in run_dir.step_checkpoints():
            if (epoch, step) <= after:
                return
            if store.is_committed(path):
                if not store.exists(posixpath.join(path, CHECKPOINT_FILE)):
                    raise param_error(self, f"run_id {run_id!r} has a step checkpoint (batch {step} of epoch "
                                      f"{epoch}) without {CHECKPOINT_FILE} (not written by LightningEstimator's "
                                      "Trainer); give a new run_id")
                return

    def _preflight(self, spec: Any, label_max: dict[str, float]) -> None:
        from spark_hvd.estimators.lightning.preflight import lightning_forward_check

        lightning_forward_check(type(self).__name__, spec)

    def _check_loss(self, n_labels: int) -> None:
        """Nothing to check: the loss is the module's ``training_step``."""

    def _train_spec(self) -> dict:
        get = self.getOrDefault
        return {"input_shapes": get(self.input_shapes), "trainer_args": dict(self._opt(self.trainer_args) or {}),
                "logger": self._opt(self.logger), "log_every_n_steps": get(self.log_every_n_steps),
                "precision": get(self.precision), "gradient_clip_val": get(self.gradient_clip_val),
                "profiler": self._opt(self.profiler),
                "checkpoint_every_steps": get(self.checkpoint_every_steps),
                "checkpoint_every_seconds": get(self.checkpoint_every_seconds), "elastic": get(self.elastic)}
