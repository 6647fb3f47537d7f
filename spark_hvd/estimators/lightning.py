"""``LightningEstimator`` and ``LightningModel``: a ``lightning`` LightningModule trained like a torch module.

The module travels and is saved as ``TorchEstimator``'s modules are (cloudpickle, trained weights as a state dict);
the rank half is ``lightning_rank.py``.
"""

from __future__ import annotations

from typing import Any

from spark_hvd.estimators.errors import param_error, param_type_error
from spark_hvd.estimators.lightning_rank import LightningTrainer
from spark_hvd.estimators.params import KeywordParams, LightningEstimatorParams
from spark_hvd.estimators.spec import LightningSpec
from spark_hvd.estimators.torch import TorchModel, TorchModuleEstimator

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

    Batches are dicts of tensors keyed by column name (features shaped by ``input_shapes`` if given). Every rank
    runs ``training_step`` on its shard; gradients are averaged over ranks by ``spark_hvd.torch.DistributedOptimizer``
    around the optimizer of ``configure_optimizers`` (its LR scheduler, ``interval`` "epoch" or "step", is
    stepped and checkpointed). ``self.log``/``self.log_dict`` values are averaged over all ranks' rows per epoch:
    ``getHistory()`` has them by the logged name, plus ``loss`` (the mean of ``training_step``'s result) and
    ``val_loss`` (what ``validation_step`` returns, unless it logs ``val_loss`` itself). Checkpoints, resume by
    ``run_id``, retries, callbacks, ``terminate_on_nan``, MLflow and progress work as for ``TorchEstimator``.
    ``optimizer``, ``loss`` and ``metrics`` are not params here: the module defines them. See
    ``lightning_rank.py`` for why the module's hooks are driven by spark_hvd's loop rather than a Lightning
    ``Trainer`` (in short: ``self.trainer`` is not available inside the module).
    """

    _model_class = LightningModel
    _spec_class = LightningSpec
    _trainer_class = LightningTrainer

    def _check_model(self, model: Any) -> bytes:
        import lightning.pytorch as pl

        if not isinstance(model, pl.LightningModule):
            raise param_type_error("LightningEstimator", f"model must be a lightning LightningModule, got "
                                   f"{type(model).__name__}")
        for hook in ("training_step", "configure_optimizers"):
            if getattr(type(model), hook) is getattr(pl.LightningModule, hook):
                raise param_type_error("LightningEstimator", f"{type(model).__name__} does not define {hook}")
        for param in ("optimizer", "loss", "metrics", "loss_weights"):
            if self._opt(getattr(self, param)):
                raise param_error("LightningEstimator",
                                  f"{param} is defined by the LightningModule (configure_optimizers"
                                  ", training_step, self.log); leave the {param} param unset")
        return super()._check_model(model)

    def _check_loss(self, n_labels: int) -> None:
        """Nothing to check: the loss is the module's ``training_step``."""

    def _train_spec(self) -> dict:
        return {"input_shapes": self.getOrDefault(self.input_shapes)}
