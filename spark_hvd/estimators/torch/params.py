"""The Params only the torch estimator and its model take (the shared ones: ``spark_hvd.estimators.common.params``)."""

from __future__ import annotations

from pyspark.ml.param import TypeConverters

from spark_hvd.estimators.common.params import (
    ElasticParams,
    EstimatorParams,
    InputShapesParams,
    ModelParams,
    StepCheckpointParams,
    _add_accessors,
    _p,
    _to_choice,
    _to_optional,
)

__all__ = ["TorchEstimatorParams", "TorchModelParams"]


@_add_accessors
class TorchEstimatorParams(InputShapesParams, StepCheckpointParams, ElasticParams, EstimatorParams):
    """``EstimatorParams`` plus what only the Torch estimator takes."""

    train_minibatch_fn = _p("train_minibatch_fn", "replaces one training step: fn(model, optimizer, "
                            "transform_outputs, loss_fn, inputs, labels, sample_weights) -> (outputs, loss)")
    lr_scheduler = _p("lr_scheduler", "fn(optimizer) -> a torch LR scheduler, built on every rank on its optimizer")
    lr_scheduler_interval = _p("lr_scheduler_interval", "step the lr_scheduler after every 'epoch' or every 'batch'",
                               _to_choice("epoch", "batch"))
    best_metric = _p("best_metric", "a history key (e.g. val_loss): only epochs that improve it are checkpointed and "
                     "the returned model is the best epoch's; default: every epoch, the last one returned",
                     _to_optional(TypeConverters.toString))
    best_mode = _p("best_mode", "'min', 'max' or 'auto' (max for accuracy-like names) for best_metric",
                   _to_choice("auto", "min", "max"))
    mixed_precision = _p("mixed_precision", "'bf16' or 'fp16': forward pass and loss under torch.autocast on the "
                         "rank's device (fp16 with a GradScaler); default None (float32)",
                         _to_optional(_to_choice("bf16", "fp16")))

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(lr_scheduler_interval="epoch", best_metric=None, best_mode="auto", mixed_precision=None)


class TorchModelParams(InputShapesParams, ModelParams):
    """``ModelParams`` plus the Torch input shapes."""
