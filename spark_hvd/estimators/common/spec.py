"""The typed training spec: what the driver's ``fit`` hands every rank (one frozen dataclass per framework).

``TrainSpec`` holds what every framework shares (the store and run, the prepared dataset's ``DatasetInfo``, the
column names, batch sizes, epochs, callbacks, step checkpoints, elastic ...); each framework's spec (``TorchSpec``
in ``spark_hvd.estimators.torch.spec``, ``KerasSpec``, ``LightningSpec``) adds its own fields. Everything in a spec
is picklable (it travels to the ranks with cloudpickle); the model travels as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BestPolicy", "CompiledSpec", "LOSS_NAMES", "TrainSpec", "built_loss", "model_metadata"]

#: the torch losses the loss param takes by name (here, not in ``params.py``: the ranks read it, and params.py
#: imports pyspark.ml, which a rank must not pay for)
LOSS_NAMES = ("mse", "cross_entropy", "bce_with_logits", "l1")

#: metric names for which bigger is better when a best-epoch mode is "auto"
_MAX_HINTS = ("acc", "auc", "precision", "recall", "f1")


@dataclass(frozen=True)
class BestPolicy:
    """Which epochs count as an improvement: ``monitor`` (a history key such as ``val_loss``) going ``mode``
    (``min``/``max``) by more than ``min_delta``. Only improving epochs are checkpointed; the returned model is the
    last improving epoch's."""

    monitor: str
    mode: str = "min"
    min_delta: float = 0.0

    @classmethod
    def create(cls, monitor: str, mode: str = "auto", min_delta: float = 0.0) -> BestPolicy:
        """A policy whose ``auto`` mode is resolved from the metric's name (max for accuracy-like names)."""
        if mode not in ("min", "max"):
            mode = "max" if any(h in monitor for h in _MAX_HINTS) else "min"
        return cls(monitor, mode, abs(float(min_delta)))

    def improved(self, value: float, best: float | None) -> bool:
        """Whether ``value`` improves on ``best`` (None: nothing yet, so it does)."""
        if best is None:
            return True
        if self.mode == "max":
            return value > best + self.min_delta
        return value < best - self.min_delta


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """What every rank receives, whatever the framework."""

    store: Any
    run_id: str
    dataset: Any  #: the prepared data's ``spark_hvd.data.metadata.DatasetInfo``
    model_bytes: bytes
    feature_cols: tuple[str, ...]
    label_cols: tuple[str, ...]
    sample_weight_col: str | None = None
    batch_size: int = 32
    val_batch_size: int = 32
    epochs: int = 1
    train_steps_per_epoch: int | None = None
    validation_steps_per_epoch: int | None = None
    shuffle: bool = True
    random_seed: int | None = None
    callbacks: tuple = ()
    transformation_fn: Any = None
    collate_fn: Any = None
    reader_pool_type: str = "auto"
    reader_num_workers: int | None = None
    val_reader_num_workers: int | None = None  #: the validation reader's workers (None: ``reader_num_workers``)
    shuffle_buffer_size: int | None = None  #: rows the training shuffle mixes (None: the reader's default)
    inmemory_cache_all: bool = False  #: keep the shard's rows in memory after the first epoch
    label_shapes: tuple | None = None  #: per label, the per-row shape every label batch is reshaped to
    ragged: str = "pad"
    backward_passes_per_step: int = 1
    gradient_compression: Any = None
    use_gpu: bool | None = None
    mp_start_method: str | None = None  #: the rank's multiprocessing start method during the fit (None: Python's)
    verbose: int = 1
    terminate_on_nan: bool = True
    scale_lr_by_num_proc: bool = False
    best: BestPolicy | None = None
    checkpoint_upload: str = "async"  #: "async" (background upload of a local snapshot) or "sync"
    checkpoint_when_busy: str = "wait"  #: "wait" for the upload in flight, or "skip" the checkpoint
    keep_checkpoints: int | None = None  #: the newest N epoch checkpoints are kept (None: all)
    keep_best_checkpoints: int | None = None  #: ... and the best K by ``monitor``
    monitor: BestPolicy | None = None  #: what ranks the checkpoints (``keep_best_checkpoints``, ``final_model``)
    final_model: str = "last"  #: "last", or "best": the kept checkpoint best by ``monitor``
    checkpoint_every_steps: int | None = None  #: step checkpoints (``step_checkpoint``) every N optimizer steps
    checkpoint_every_seconds: float | None = None  #: ... or every N seconds
    elastic: bool = False  #: trained on ``run_elastic`` (the history records each epoch's number of ranks)


@dataclass(frozen=True, kw_only=True)
class CompiledSpec(TrainSpec):
    """``TrainSpec`` plus what a framework that compiles the model with an optimizer and a loss is given (torch and
    Keras; a LightningModule brings its own)."""

    optimizer: dict  #: as the framework's ``optimizer_spec`` describes it
    loss: Any
    loss_constructors: tuple = ()  #: zero-argument callables building the losses on the rank (``built_loss``)
    loss_weights: tuple[float, ...] | None = None
    metrics: tuple = ()


def built_loss(loss: Any, constructors: tuple = ()) -> Any:
    """The loss a rank trains with: ``loss``, or what the ``loss_constructors`` build there (one, or a list of one
    per label): Horovod's param for losses that do not pickle."""
    if not constructors:
        return loss
    losses = [fn() for fn in constructors]
    return losses[0] if len(losses) == 1 else losses


def model_metadata(info: Any, output_shapes: list[list[int]]) -> dict:
    """The JSON metadata a fitted Model keeps: per feature its model dtype, shape and kind; per label its stored
    dtype, shape and kind; the per-row output shapes; the prepared dataset's key."""
    import numpy as np

    from spark_hvd.data.metadata import model_input_dtype

    def describe(col: str, dtype: str) -> dict:
        spec = info.columns[col]
        return {"dtype": dtype, "shape": list(spec.shape), "kind": spec.kind}

    return {
        "features": {c: describe(c, np.dtype(model_input_dtype(info.columns[c].dtype)).name)
                     for c in info.feature_cols},
        "labels": {c: describe(c, info.columns[c].dtype) for c in info.label_cols},
        "output_shapes": output_shapes,
        "dataset": info.key,
    }
