"""``LegacyModule``: a plain ``torch.nn.Module`` given to ``LightningEstimator`` with the estimator's ``optimizer``,
``loss``, ``loss_weights``, ``metrics`` and ``sample_weight_col``, trained as a
LightningModule (Horovod's "legacy" Lightning estimator: ``horovod.spark.lightning.legacy``).

The step is ``TorchEstimator``'s (``torch/rank.py``): the module called with one tensor per feature column (by
name when ``forward`` names every feature column, as Horovod calls it; else in ``feature_cols`` order), its outputs
and labels fitted as for ``TorchEstimator``'s losses, the loss ``combined_loss`` (the mean of the weighted per-row
losses with ``sample_weight_col``, as Horovod), the optimizer rebuilt from its spec on the module's parameters;
metrics are logged per batch (``self.log``: averaged over rows and ranks per epoch). So a plain module trains here
as under ``TorchEstimator`` (the tests compare the two); the fitted ``LightningModel.getModel()`` is the trained
plain module, as in Horovod.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl

from spark_hvd.estimators.torch.rank import combined_loss, fitted_outputs, loss_fns, resolve_metric
from spark_hvd.estimators.torch.serde import build_optimizer

__all__ = ["LegacyModule"]


class LegacyModule(pl.LightningModule):
    """A LightningModule around ``model`` that trains it with a ``TorchEstimator``'s optimizer, losses and
    metrics (see the module's docstring). ``optimizer`` is ``torch.serde.optimizer_spec``'s description over
    ``model``'s parameters; ``loss`` a loss param (a callable, a name or a list, one per label)."""

    def __init__(self, model: Any, optimizer: dict, loss: Any, loss_weights: Any,
                 metrics: tuple, feature_cols: list[str], label_cols: list[str], sample_weight_col: str | None):
        super().__init__()
        self.model = model
        self._optimizer = optimizer
        self._loss = loss
        self._loss_weights = list(loss_weights or [1.0] * len(label_cols))
        self._metrics = [resolve_metric(m) for m in metrics]
        self._feature_cols, self._label_cols = list(feature_cols), list(label_cols)
        self._weight_col = sample_weight_col
        try:
            names = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            names = {}
        self._by_name = all(c in names for c in feature_cols)
        self._fns: tuple | None = None  # built on first use

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The plain module's forward."""
        return self.model(*args, **kwargs)

    def configure_optimizers(self) -> Any:
        """The estimator's optimizer, rebuilt on this copy's parameters with its state."""
        return build_optimizer(self._optimizer, self.model)

    def training_step(self, batch: dict, batch_idx: int) -> Any:
        """The estimator's loss on one batch; metrics logged by name."""
        return self._step(batch, "")

    def validation_step(self, batch: dict, batch_idx: int) -> Any:
        """The validation loss (the history's ``val_loss``); metrics logged as ``val_<name>``."""
        return self._step(batch, "val_")

    def _step(self, batch: dict, prefix: str) -> Any:
        inputs = [batch[c] for c in self._feature_cols]
        out = self.model(**dict(zip(self._feature_cols, inputs, strict=True))) if self._by_name \
            else self.model(*inputs)
        if self._fns is None:
            self._fns = loss_fns(self._loss, len(self._label_cols), bool(self._weight_col))
        fns, class_index = self._fns
        outputs, labels = fitted_outputs(out, [batch[c] for c in self._label_cols], class_index)
        weights = batch[self._weight_col] if self._weight_col else None
        for name, fn in self._metrics:
            for j, (o, y) in enumerate(zip(outputs, labels, strict=True)):
                key = name if len(outputs) == 1 else f"{self._label_cols[j]}_{name}"
                self.log(f"{prefix}{key}", fn(o.detach(), y), batch_size=len(inputs[0]))
        return combined_loss(fns, self._loss_weights, outputs, labels, weights)
