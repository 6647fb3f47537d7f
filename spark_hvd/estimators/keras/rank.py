"""The rank half of ``KerasEstimator``: ``train_keras_rank`` and ``KerasTrainer``, a ``RankTrainer`` around
``model.fit``.

Works on Keras's TensorFlow, torch and JAX backends (the estimator's ``backend``, see ``keras/backend.py``):
TensorFlow is imported only when it is the backend. ``model.fit`` runs every epoch in one call (so Keras callbacks
such as ``EarlyStopping`` or LR schedules keep their state); a callback of ours hands each epoch's averaged logs to
``RankRun.end_epoch`` and, after every batch, calls ``RankRun.step_end`` (step checkpoints; the epoch's running sums
are the values of the model's metric variables on the rank). A resume inside an epoch runs that epoch's remaining
batches in a ``model.fit`` of their own (the dataset drops the batches already trained, the metric variables are put
back at its start), then the following epochs in a second ``model.fit``.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import numpy as np

from spark_hvd.core.jobenv import JobEnv, gpu_index, torch_threads
from spark_hvd.estimators.common.errors import param_error
from spark_hvd.estimators.common.rank_run import RankRun, RankTrainer, train_on_rank
from spark_hvd.estimators.keras.backend import set_threads
from spark_hvd.estimators.keras.inference import predict
from spark_hvd.estimators.keras.serde import MODEL_FILE, build_optimizer, deserialize_keras_model

__all__ = ["KerasTrainer", "train_keras_rank"]

log = logging.getLogger(__name__)

_OPTIMIZER_FILE = "optimizer.npz"


def _select_devices(use_gpu: bool | None, job: JobEnv | None) -> None:
    """The rank's GPU by the one GPU policy (``gpu_index``: Spark's assignment, else the local rank; never
    wrapped around), or none (``use_gpu=False``, or a local rank beyond the GPUs). TensorFlow backend: the only
    visible GPU; torch backend: torch's current device (Keras's torch backend uses ``cuda``, the current one)."""
    import keras

    if keras.backend.backend() == "jax":  # the CPU jax of the ``jax`` extra: no device to pick
        return
    if keras.backend.backend() == "torch":
        import torch

        if use_gpu is not False and torch.cuda.is_available():
            index = gpu_index(job, torch.cuda.device_count(), required=use_gpu is True)
            if index is not None:
                torch.cuda.set_device(index)
        return
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    index = None if use_gpu is False else gpu_index(job, len(gpus), required=use_gpu is True)
    try:
        tf.config.set_visible_devices([] if index is None else gpus[index], "GPU")
    except RuntimeError as exc:  # devices already initialised in this (reused) Python worker
        log.warning("rank %s: TensorFlow's GPUs were initialised before spark_hvd could pin GPU %s (%s)",
                    0 if job is None else job.rank, index, exc)


def _per_output_metrics(metrics: tuple, n_outputs: int) -> Any:
    """A flat metric list applies to every output (Keras 3 wants one list per output for several outputs)."""
    if not metrics:
        return None
    if n_outputs <= 1 or any(isinstance(m, list | tuple | dict) for m in metrics):
        return list(metrics)
    return [[m if isinstance(m, str) else copy.deepcopy(m) for m in metrics] for _ in range(n_outputs)]


def _float16_layers(model: Any) -> bool:
    """Whether any layer of ``model`` computes under the ``mixed_float16`` policy (a model reloaded from its
    ``.keras`` file keeps its layers' policies, while the model's own may be the global float32)."""
    layers = model._flatten_layers(include_self=True) if hasattr(model, "_flatten_layers") else [model, *model.layers]
    return any(getattr(getattr(layer, "dtype_policy", None), "name", "") == "mixed_float16" for layer in layers)


def scale_learning_rate(optimizer: Any, factor: float) -> None:
    """Multiply a Keras optimizer's constant learning rate by ``factor`` (``scale_lr_by_num_proc``); a schedule is
    an error: scale the schedule itself."""
    import keras

    if isinstance(optimizer.learning_rate, keras.optimizers.schedules.LearningRateSchedule) or callable(
            getattr(optimizer, "_learning_rate", None)):
        raise param_error("KerasEstimator", "scale_lr_by_num_proc needs a constant learning rate, the optimizer has a "
                          "schedule; scale the schedule's rates by num_proc yourself")
    optimizer.learning_rate = float(np.asarray(optimizer.learning_rate)) * factor


def train_keras_rank(trainer_class: type[RankTrainer], spec: Any, fresh: bool = False) -> dict | None:
    """Every rank of a ``KerasEstimator`` fit: ``train_on_rank`` on Keras's ``spec.backend``, here, or, when the
    Python worker of any rank already runs Keras on another backend (or asks for it with ``fresh=True``), in a fresh
    Python process on every rank (``spark_hvd.runner.fresh.run_rank_fresh``; the ranks decide together)."""
    import spark_hvd.core as core
    from spark_hvd.estimators.keras.backend import loaded_backend, runs_here

    here = runs_here(spec.backend) and not fresh
    if all(core.allgather_object(here, name="spark_hvd.keras.backend_here")):
        return train_on_rank(trainer_class, spec)
    from spark_hvd.runner.fresh import run_rank_fresh

    if not here and not fresh:
        log.info("rank %d: this Python worker runs Keras on %r; training on %r in a fresh Python process",
                 core.rank(), loaded_backend(), spec.backend)
    return run_rank_fresh(train_on_rank, (trainer_class, spec), env={"KERAS_BACKEND": spec.backend})


class KerasTrainer(RankTrainer):
    """``model.fit`` on the rank's shard, compiled with the rebuilt optimizer in ``DistributedOptimizer``."""

    def init(self, spec: Any) -> None:
        job = JobEnv.from_env()  # the launch contract (the core is not initialised yet: TF must be set up first)
        set_threads(torch_threads(job), inter_op=2)  # the one policy: the host's cores shared among its ranks
        _select_devices(spec.use_gpu, job)
        import spark_hvd.keras as hvd

        hvd.init()
        self.hvd = hvd

    def seed(self, seed: int) -> None:
        import keras

        keras.utils.set_random_seed(seed)

    def build(self, spec: Any) -> None:
        self.spec = spec
        self.model = deserialize_keras_model(spec.model_bytes)
        kwargs: dict[str, Any] = {"backward_passes_per_step": spec.backward_passes_per_step}
        if spec.gradient_compression is not None:
            kwargs["compression"] = spec.gradient_compression
        optimizer = build_optimizer(spec.optimizer)
        if spec.scale_lr_by_num_proc:
            scale_learning_rate(optimizer, self.hvd.size())
        import keras

        if _float16_layers(self.model) and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            # loss scaling for float16 layers, inside DistributedOptimizer: the gradients are reduced before the
            # loss scale's inf/nan check, so every rank skips the same steps
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer = self.hvd.DistributedOptimizer(optimizer, **kwargs)
        self.model.compile(optimizer=optimizer, loss=spec.loss,
                           loss_weights=list(spec.loss_weights) if spec.loss_weights else None,
                           metrics=_per_output_metrics(spec.metrics, len(spec.label_cols)), jit_compile=False)
        optimizer.build(self.model.trainable_variables)  # on every rank, so the broadcast covers the same variables

    def save_checkpoint(self, directory: str) -> None:
        self.model.save(os.path.join(directory, MODEL_FILE))
        np.savez(os.path.join(directory, _OPTIMIZER_FILE),
                 **{f"v{i}": np.asarray(v) for i, v in enumerate(self.model.optimizer.variables)})

    def load_checkpoint(self, directory: str) -> None:
        self.model.load_weights(os.path.join(directory, MODEL_FILE))
        with np.load(os.path.join(directory, _OPTIMIZER_FILE)) as saved:
            values = [saved[f"v{i}"] for i in range(len(saved.files))]
        variables = self.model.optimizer.variables
        if len(values) != len(variables):
            raise ValueError(f"the checkpoint has {len(values)} optimizer variables, the optimizer {len(variables)}: "
                             "was the optimizer changed?")
        for var, value in zip(variables, values, strict=True):
            var.assign(value)

    def sync(self) -> None:
        """Nothing here: ``BroadcastGlobalVariablesCallback(0)`` broadcasts at the start of ``model.fit``."""

    def resized_progress(self, progress: list[dict], rank: int, size: int) -> dict:
        """A step checkpoint of another number of ranks (an elastic relaunch): every rank's metric variables start
        from the old ranks' summed variables divided by the new number of ranks. ``MetricAverageCallback``
        averages the ranks' results at the epoch's end, so for Keras's sum-and-count metrics (the loss, ``Mean``,
        ``MeanMetricWrapper`` metrics such as accuracy or mse) with as many rows on every rank the epoch's value is
        exactly the mean over every batch trained in it, before and after the relaunch."""
        saved = [p.get("metrics") for p in progress]
        if not saved or any(m is None or len(m) != len(saved[0]) for m in saved):
            return {}
        return {"metrics": [np.sum([np.asarray(m[i], np.float64) for m in saved], axis=0) / size
                            for i in range(len(saved[0]))]}

    def rescale_lr(self, factor: float) -> None:
        """The constant learning rate times ``factor`` (``scale_lr_by_num_proc`` on a resume on another number of
        ranks; every rank, before ``model.fit`` broadcasts rank 0's optimizer variables)."""
        scale_learning_rate(self.model.optimizer, factor)

    def save_model(self, directory: str) -> None:
        self.model.save(os.path.join(directory, MODEL_FILE))

    def output_shapes(self, batch: dict) -> list[list[int]]:
        try:
            shapes = [list(o.shape[1:]) for o in self.model.outputs]
            if all(d is not None for s in shapes for d in s):
                return shapes
        except (AttributeError, ValueError):
            pass
        out = predict(self.model, [batch[c] for c in self.spec.feature_cols])
        return [list(np.asarray(o).shape[1:]) for o in out]

    def train(self, run: RankRun) -> None:
        import keras

        from spark_hvd._keras_common import compat as keras_compat
        from spark_hvd.data.keras_loader import KerasBatchDataset

        spec, hvd = self.spec, self.hvd
        readers = run.readers
        cols = (list(spec.feature_cols), list(spec.label_cols), spec.sample_weight_col)
        skip = run.start_step  # batches of epoch run.start already trained (a resume from a step checkpoint)
        train = KerasBatchDataset(readers.readers["train"], *cols, first_epoch=run.start, skip=skip)
        steps = min(readers.steps("train"), len(train))
        if skip >= steps:  # a checkpoint after the epoch's last batch (its end was not committed)
            log.warning("rank %d: the step checkpoint is after the last batch of epoch %d; Keras cannot run an epoch "
                        "of no batch, so its last batch is trained again before the epoch ends", run.rank, run.start)
            skip = steps - 1
            train = KerasBatchDataset(readers.readers["train"], *cols, first_epoch=run.start, skip=skip)
        saved_metrics = run.resume_progress.get("metrics") if skip else None
        keep_sums = run.checkpoints_inside_epochs
        val, val_steps = None, None
        if readers.has_validation:
            val = KerasBatchDataset(readers.readers["val"], *cols)
            val_steps = min(readers.steps("val"), len(val))

        class _RunCallback(keras.callbacks.Callback):
            """Each epoch's averaged logs to ``run.end_epoch``; a non-finite loss stops with an error."""

            epoch, offset, stopped = 0, 0, False

            def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
                self.epoch = epoch
                self.offset = skip if epoch == run.start else 0
                if self.offset and saved_metrics is not None:  # Keras reset them just before: the resumed sums
                    variables = self.model.metrics_variables
                    if len(variables) == len(saved_metrics):
                        for var, value in zip(variables, saved_metrics, strict=True):
                            var.assign(np.asarray(value).astype(var.dtype))
                    else:
                        log.warning("rank %d: the step checkpoint has %d metric variables, the model %d: the "
                                    "epoch's metrics count only its remaining batches", run.rank,
                                    len(saved_metrics), len(variables))

            def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
                step = batch + self.offset
                run.batch_done(self.epoch, step, (logs or {}).get("loss"))
                if keep_sums:
                    run.step_end(self.epoch, step,
                                 {"metrics": [np.array(v) for v in self.model.metrics_variables]})

            def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
                logs = {k: float(np.asarray(v)) for k, v in (logs or {}).items()
                        if isinstance(v, int | float | np.number | np.ndarray) or hasattr(v, "numpy")}
                self.model.stop_training = run.end_epoch(epoch, logs, stop=bool(self.model.stop_training))
                self.stopped = self.stopped or self.model.stop_training

        ours = _RunCallback()
        callbacks = [*keras_compat.restart_after_peek(train, val), hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.MetricAverageCallback(), *spec.callbacks, ours]
        start = run.start
        # shuffle=False: the reader's stream is shuffled already (Keras's index shuffle would be ignored by it, but
        # Keras 3.3-3.6 also reorder the yielded batches in a tf.data shuffle buffer, off the checkpointed order)
        fit = {"validation_data": val, "callbacks": callbacks, "shuffle": False,
               "validation_steps": None if val is None else keras_compat.fit_steps(val_steps, val),
               "verbose": 2 if (spec.verbose >= 2 and run.rank == 0) else 0}
        if skip:  # the rest of the epoch a step checkpoint interrupted, then the following epochs
            self.model.fit(train, epochs=start + 1, initial_epoch=start, steps_per_epoch=steps - skip, **fit)
            start += 1
            if ours.stopped or start >= spec.epochs:
                return
        self.model.fit(train, epochs=spec.epochs, initial_epoch=start,
                       steps_per_epoch=keras_compat.fit_steps(steps, train), **fit)
