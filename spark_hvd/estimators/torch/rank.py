"""The rank half of ``TorchEstimator``: losses and metrics by name, and ``TorchTrainer``, the torch training loop.

``TorchTrainer`` is a ``RankTrainer`` (see ``common/rank_run.py``): the shared ``RankRun`` does init order, seeding,
resume, per-epoch end and finish; this file builds the module, its optimizer (wrapped in
``spark_hvd.torch.DistributedOptimizer``) and LR scheduler, and trains one epoch at a time. ``LightningTrainer``
(``lightning/rank.py``) reuses the device set-up, the batch tensors, the metric averaging and the final model, and
trains with Lightning's own ``Trainer``.

Callbacks (on every rank) may define ``on_train_begin(context)`` (a ``TrainingContext``: model, optimizer,
scheduler, ``stop_training``), ``on_epoch_begin(epoch)``, ``on_batch_end(epoch, step, loss)`` and
``on_epoch_end(epoch, logs)`` (logs averaged over ranks; set ``context.stop_training`` here to stop).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from spark_hvd.estimators.common.errors import param_error
from spark_hvd.estimators.common.rank_run import RankRun, RankTrainer, TrainingContext
from spark_hvd.estimators.common.spec import LOSS_NAMES, built_loss
from spark_hvd.estimators.torch.precision import MixedPrecision
from spark_hvd.estimators.torch.serde import build_optimizer, deserialize_module

__all__ = ["TorchTrainer", "resolve_losses", "resolve_metric", "default_train_minibatch", "loss_fns", "combined_loss",
           "fitted_outputs"]

log = logging.getLogger(__name__)

_LOSS_FUNCTIONS = {"mse": "mse_loss", "cross_entropy": "cross_entropy",
                   "bce_with_logits": "binary_cross_entropy_with_logits", "l1": "l1_loss"}


# ------------------------------------------------------------------------------------------------ loss, metrics


def resolve_losses(loss: Any, n_labels: int) -> list[Any]:
    """One loss (a callable or a name) per label; raises ``ValueError`` naming what is wrong."""
    if loss is None:
        raise param_error("TorchEstimator", f"set loss: a callable, one of {list(LOSS_NAMES)}, or a list of them")
    losses = list(loss) if isinstance(loss, list | tuple) else [loss] * n_labels
    if len(losses) != n_labels:
        raise param_error("TorchEstimator", f"{len(losses)} losses for {n_labels} label columns; give one loss per "
                          "label (or a single loss for all of them)")
    for i, item in enumerate(losses):
        if isinstance(item, str):
            if item not in _LOSS_FUNCTIONS:
                raise param_error("TorchEstimator", f"unknown loss name {item!r} (label {i}); use one of "
                                  f"{list(LOSS_NAMES)} or a callable")
        elif not callable(item):
            raise param_error("TorchEstimator", f"loss {i} is a {type(item).__name__}, not a callable or a name")
    return losses


def is_class_index_loss(item: Any) -> bool:
    """Whether the loss takes class indices as labels (cross entropy, NLL)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    if isinstance(item, str):
        return item == "cross_entropy"
    return item is F.cross_entropy or item is F.nll_loss or isinstance(item, torch.nn.CrossEntropyLoss
                                                                       | torch.nn.NLLLoss)


def _loss_fn(item: Any, weighted: bool) -> Callable:
    """fn(output, label) -> loss (one per row when ``weighted``, for a named loss)."""
    import torch.nn.functional as F  # noqa: N812

    if isinstance(item, str):
        fn = getattr(F, _LOSS_FUNCTIONS[item])
        if weighted:
            return lambda o, y, _f=fn: _per_row(_f(o, y, reduction="none"))
        return fn
    if weighted:
        return _unreduced(item) or item
    return item


def _unreduced(item: Any) -> Callable | None:
    """A callable loss as Horovod calls it with sample weights, one loss per element: a torch loss module copied
    with ``reduction="none"``, a function with a ``reduction`` parameter (``F.binary_cross_entropy``...) called with
    ``reduction="none"``; ``None`` for any other callable (called as given: it must return one loss per row)."""
    import copy
    import functools
    import inspect

    import torch

    if isinstance(item, torch.nn.modules.loss._Loss) and hasattr(item, "reduction"):
        unreduced = copy.copy(item)
        unreduced.reduction = "none"
        return unreduced
    try:
        params = inspect.signature(item).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    if "reduction" in params and params["reduction"].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                              inspect.Parameter.KEYWORD_ONLY):
        return functools.partial(item, reduction="none")
    return None


def _per_row(loss: Any) -> Any:
    return loss.reshape(loss.shape[0], -1).mean(1) if loss.dim() > 1 else loss


def resolve_metric(metric: Any) -> tuple[str, Callable]:
    """(name, fn(output, label) -> scalar tensor) of a metric name or callable."""
    if isinstance(metric, str):
        if metric not in _METRICS:
            raise param_error("TorchEstimator", f"unknown metric {metric!r}; use accuracy, mse, mae or a callable")
        return metric, _METRICS[metric]
    if not callable(metric):
        raise param_error("TorchEstimator", f"metric {metric!r} is not a callable or a name")
    return getattr(metric, "__name__", type(metric).__name__), metric


def _accuracy(output: Any, label: Any) -> Any:
    if output.dim() > 1 and output.shape[-1] > 1:
        return (output.argmax(-1) == label.reshape(output.shape[:-1]).long()).float().mean()
    return ((output.reshape(-1) > 0.5) == (label.reshape(-1) > 0.5)).float().mean()


def _as_float(output: Any, label: Any) -> tuple[Any, Any]:
    """Output and label in one floating dtype, at least float32 (a bf16/fp16 output of autocast is upcast)."""
    import torch

    dtype = torch.promote_types(output.dtype, torch.float32)
    return output.to(dtype), label.reshape(output.shape).to(dtype)


def _mse(output: Any, label: Any) -> Any:
    output, label = _as_float(output, label)
    return ((output - label) ** 2).mean()


def _mae(output: Any, label: Any) -> Any:
    output, label = _as_float(output, label)
    return (output - label).abs().mean()


_METRICS = {"accuracy": _accuracy, "mse": _mse, "mae": _mae}


def _fit_label(output: Any, label: Any, class_index: bool) -> Any:
    """Labels as the loss wants them: class indices as int64 of shape (rows,), else the output's dtype and shape
    (at least float32: under mixed precision the output is bf16/fp16, the label is not rounded to it)."""
    import torch

    if class_index:
        return label.reshape(-1).long() if label.dim() > 1 and label.shape[1:].numel() == 1 else label.long()
    if output.dtype.is_floating_point:
        dtype = torch.promote_types(output.dtype, torch.float32)
        label = label.to(dtype) if label.dtype != dtype else label
    if label.shape != output.shape and label.numel() == output.numel():
        label = label.reshape(output.shape)
    return label


def loss_fns(loss: Any, n_labels: int, weighted: bool) -> tuple[list[Callable], list[bool]]:
    """Per label, ``fn(output, label)`` (one loss per row when ``weighted``: ``sample_weight_col`` is set) and
    whether it takes class indices, from a loss param (a callable, a name or a list)."""
    losses = resolve_losses(loss, n_labels)
    return [_loss_fn(item, weighted) for item in losses], [is_class_index_loss(item) for item in losses]


def combined_loss(fns: list[Callable], weights: list[float], outputs: list, labels: list, sample_weights: Any) -> Any:
    """The training loss: the sum over labels of ``weight * fn(output, label)``; with ``sample_weights``, each
    label's per-row losses times their weights, averaged over the batch's rows (``mean(w * loss)``, as Horovod
    and Keras do: a row's weight counts the same in whichever batch it falls, which dividing by each batch's sum of
    weights would not give)."""
    total = 0.0
    for fn, w, o, y in zip(fns, weights, outputs, labels, strict=True):
        value = fn(o, y)
        if sample_weights is not None:
            if value.dim() == 0:
                raise ValueError("with sample_weight_col, a callable loss must return one value per row: "
                                 "give it a reduction parameter (called with reduction='none', as Horovod "
                                 "does) or return the unreduced losses")
            sw = sample_weights.reshape(-1).to(value.dtype)
            value = (_per_row(value) * sw).mean()
        total = total + w * value
    return total


def fitted_outputs(outputs: Any, labels: list, class_index: list[bool]) -> tuple[list, list]:
    """The module's output(s) as a list, and each label as its loss wants it (``_fit_label``)."""
    outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
    return outputs, [_fit_label(o, y, ci) for o, y, ci in zip(outputs, labels, class_index, strict=True)]


def default_train_minibatch(model: Any, optimizer: Any, transform_outputs: Callable, loss_fn: Callable,
                            inputs: list, labels: list, sample_weights: Any) -> tuple[list, Any]:
    """One training step (Horovod's ``train_minibatch_fn`` signature): forward, loss, backward, step."""
    optimizer.zero_grad()
    outputs = model(*inputs)
    outputs, labels = transform_outputs(outputs, labels)
    loss = loss_fn(outputs, labels, sample_weights)
    loss.backward()
    optimizer.step()
    return outputs, loss


# ------------------------------------------------------------------------------------------------ the trainer


class TorchTrainer(RankTrainer):
    """The torch loop (see the module docstring)."""

    def init(self, spec: Any) -> None:
        import torch

        import spark_hvd.torch as hvd
        from spark_hvd import core
        from spark_hvd.core.jobenv import gpu_index, torch_threads

        hvd.init()  # on a CUDA host this also makes the rank's GPU torch's current device
        self.hvd = hvd
        job = core.job_env()
        torch.set_num_threads(torch_threads(job))
        index = None
        if spec.use_gpu is not False and torch.cuda.is_available():
            index = gpu_index(job, torch.cuda.device_count(), required=spec.use_gpu is True)
        elif spec.use_gpu is True:
            raise ValueError(f"rank {job.rank}: use_gpu=True, but torch sees no CUDA device on this task (set "
                             "use_gpu=None to train on the CPU where there is no GPU)")
        on_gpu = hvd.allgather_object(index is not None)  # one device kind for the whole job
        if index is not None and not all(on_gpu):
            log.warning("rank %d: training on the CPU, as ranks %s have no GPU of their own (all ranks must train "
                        "on the same kind of device)", job.rank, [r for r, g in enumerate(on_gpu) if not g])
            index = None
        self.device = torch.device("cuda", index) if index is not None else torch.device("cpu")
        # TorchSpec's field; LightningSpec has none (a LightningModule brings its own precision)
        self.precision = MixedPrecision(getattr(spec, "mixed_precision", None), self.device, job.rank)

    def seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        np.random.seed(seed % (2**32))

    def build(self, spec: Any) -> None:
        self.spec = spec
        self.model = deserialize_module(spec.model_bytes).to(self.device)
        optimizer, self.scheduler_interval = self._build_training(spec)
        if spec.scale_lr_by_num_proc:  # before the scheduler, which takes the scaled rate as its base
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * self.hvd.size()
        kwargs = {"named_parameters": self.model.named_parameters(),
                  "backward_passes_per_step": spec.backward_passes_per_step}
        if spec.gradient_compression is not None:
            kwargs["compression"] = spec.gradient_compression
        # the scheduler is built on the distributed optimizer: it must wrap the step that averages gradients
        self.optimizer = self.hvd.DistributedOptimizer(optimizer, **kwargs)
        self.scheduler = self._build_scheduler(spec)
        self.context = TrainingContext(self.model, self.optimizer, self.hvd.rank(), self.hvd.size(), self.scheduler)

    def _build_training(self, spec: Any) -> tuple[Any, str]:
        """The optimizer (not yet distributed) and the scheduler interval; sets up losses and metrics."""
        weighted = bool(spec.sample_weight_col)
        n = len(spec.label_cols)
        self.losses, self.class_index = loss_fns(built_loss(spec.loss, spec.loss_constructors), n, weighted)
        self.loss_weights = list(spec.loss_weights or [1.0] * n)
        self.metrics = [resolve_metric(m) for m in spec.metrics]
        self.step_fn = spec.train_minibatch_fn or default_train_minibatch
        return build_optimizer(spec.optimizer, self.model), spec.lr_scheduler_interval

    def _build_scheduler(self, spec: Any) -> Any:
        return spec.lr_scheduler(self.optimizer) if spec.lr_scheduler is not None else None

    # ---- checkpoints
    def save_checkpoint(self, directory: str) -> None:
        import torch

        torch.save({k: v.cpu() for k, v in self.model.state_dict().items()}, f"{directory}/model.pt")
        torch.save(self.optimizer.state_dict(), f"{directory}/optimizer.pt")
        if self.scheduler is not None:
            torch.save(self.scheduler.state_dict(), f"{directory}/scheduler.pt")
        if self.precision.scaler is not None:
            torch.save(self.precision.state_dict(), f"{directory}/grad_scaler.pt")

    def load_checkpoint(self, directory: str) -> None:
        import torch

        self.model.load_state_dict(torch.load(f"{directory}/model.pt", map_location=self.device))
        self.optimizer.load_state_dict(torch.load(f"{directory}/optimizer.pt", map_location=self.device))
        if self.scheduler is not None and os.path.exists(f"{directory}/scheduler.pt"):
            self.scheduler.load_state_dict(torch.load(f"{directory}/scheduler.pt", weights_only=False))
        if self.precision.scaler is not None and os.path.exists(f"{directory}/grad_scaler.pt"):
            self.precision.load_state_dict(torch.load(f"{directory}/grad_scaler.pt"))

    def sync(self) -> None:
        self.hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(self.hvd.broadcast_object(self.scheduler.state_dict(), root_rank=0))
        if self.precision.scaler is not None:  # the loss scale of a resumed run: rank 0's
            self.precision.load_state_dict(self.hvd.broadcast_object(self.precision.state_dict(), root_rank=0))

    def rescale_lr(self, factor: float) -> None:
        """Multiply every param group's learning rate (and the scheduler's base rates) by ``factor``."""
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * factor
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * factor
        if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]

    def save_model(self, directory: str) -> None:
        import torch

        torch.save({k: v.cpu() for k, v in self.model.state_dict().items()}, f"{directory}/model.pt")

    def output_shapes(self, batch: dict) -> list[list[int]]:
        import torch

        self.model.eval()
        with torch.no_grad(), self.precision.autocast():
            out = self.model(*self._tensors(batch)[0])
        return [list(o.shape[1:]) for o in (out if isinstance(out, list | tuple) else [out])]

    # ---- training
    def train(self, run: RankRun) -> None:
        spec, callbacks = self.spec, self.spec.callbacks
        for cb in callbacks:
            getattr(cb, "on_train_begin", lambda ctx: None)(self.context)
        for epoch in range(run.start, spec.epochs):
            for cb in callbacks:
                getattr(cb, "on_epoch_begin", lambda e: None)(epoch)
            self.model.train()
            skip = run.start_step if epoch == run.start else 0  # a resume from a step checkpoint
            acc: dict[str, float] = dict(run.resume_progress.get("acc", {})) if skip else {}
            rows = int(run.resume_progress.get("rows", 0)) if skip else 0
            for step, batch in enumerate(run.readers.epoch("train", epoch, skip=skip), start=skip):
                loss, n = self._train_batch(batch, step, acc)
                run.batch_done(epoch, step, loss)
                rows += n
                if self.scheduler is not None and self.scheduler_interval == "batch" \
                        and (step + 1) % spec.backward_passes_per_step == 0:
                    self.scheduler.step()
                for cb in callbacks:
                    getattr(cb, "on_batch_end", lambda e, s, loss: None)(epoch, step, loss)
                run.step_end(epoch, step, {"acc": acc, "rows": rows})
            logs = self._epoch_metrics(acc, rows)
            if run.readers.has_validation:
                logs.update(self._validate(run, epoch))
            if self.scheduler is not None:
                logs["lr"] = float(self.optimizer.param_groups[0]["lr"])
                if self.scheduler_interval == "epoch":
                    self.scheduler.step()
            for cb in callbacks:
                getattr(cb, "on_epoch_end", lambda e, logs: None)(epoch, logs)
            if run.end_epoch(epoch, logs, stop=self.context.stop_training):
                break

    def _tensors(self, batch: dict) -> tuple[list, list, Any]:
        import torch

        spec, shapes = self.spec, self.spec.input_shapes
        with warnings.catch_warnings():
            # the reader's arrays may be read-only views of Arrow buffers; the tensors are never written in place
            warnings.filterwarnings("ignore", message=".*not writable.*")
            inputs = []
            for i, col in enumerate(spec.feature_cols):
                t = torch.from_numpy(np.ascontiguousarray(batch[col]))
                if shapes is not None:
                    t = t.reshape(t.shape[0], *shapes[i])
                inputs.append(self._to_device(t))
            labels = [self._to_device(torch.from_numpy(np.ascontiguousarray(batch[c]))) for c in spec.label_cols]
            sw = batch.get(spec.sample_weight_col) if spec.sample_weight_col else None
            sw = self._to_device(torch.from_numpy(np.ascontiguousarray(sw))) if sw is not None else None
        return inputs, labels, sw

    def _to_device(self, t: Any) -> Any:
        """A host tensor on the rank's device: to a GPU through pinned memory with a non-blocking copy (the copy
        overlaps the host's work on the next tensor; CUDA orders it before the kernels that read it)."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _transform_outputs(self, outputs: Any, labels: list) -> tuple[list, list]:
        return fitted_outputs(outputs, labels, self.class_index)

    def _loss(self, outputs: list, labels: list, sample_weights: Any) -> Any:
        total = combined_loss(self.losses, self.loss_weights, outputs, labels, sample_weights)
        bpps = self.spec.backward_passes_per_step
        return total / bpps if bpps > 1 else total

    def _train_batch(self, batch: dict, step: int, acc: dict) -> tuple[float, int]:
        """One training batch; adds its metrics to ``acc``; returns (the batch's loss, its rows)."""
        bpps, amp = self.spec.backward_passes_per_step, self.precision
        inputs, labels, sw = self._tensors(batch)
        if self.spec.train_minibatch_fn is None:
            # accumulate bpps backward passes; DistributedOptimizer allreduces on the last, step() applies it
            if step % bpps == 0:
                self.optimizer.zero_grad()
            with amp.autocast():  # forward and loss (autocast's advice: not the backward)
                outputs, labels = self._transform_outputs(self.model(*inputs), labels)
                loss = self._loss(outputs, labels, sw)
            amp.backward(loss)
            if (step + 1) % bpps == 0:
                amp.step(self.optimizer)
        else:  # the user's step (bf16: under autocast; fp16 is refused with it, it cannot use our scaler)
            with amp.autocast():
                outputs, loss = self.step_fn(self.model, self.optimizer, self._transform_outputs, self._loss,
                                             inputs, labels, sw)
            outputs, labels = self._transform_outputs(outputs, labels)
        n = int(inputs[0].shape[0])
        value = float(loss.detach()) * bpps
        self._add_metrics(acc, "", outputs, labels, value, n)
        return value, n

    def _validate(self, run: RankRun, epoch: int) -> dict[str, float]:
        import torch

        self.model.eval()
        acc: dict[str, float] = {}
        rows = 0
        with torch.no_grad(), self.precision.autocast():
            for batch in run.readers.epoch("val", epoch):
                inputs, labels, sw = self._tensors(batch)
                outputs, labels = self._transform_outputs(self.model(*inputs), labels)
                n = int(inputs[0].shape[0])
                loss = float(self._loss(outputs, labels, sw)) * self.spec.backward_passes_per_step
                self._add_metrics(acc, "val_", outputs, labels, loss, n)
                rows += n
        return self._epoch_metrics(acc, rows)

    def _add_metrics(self, acc: dict, prefix: str, outputs: list, labels: list, loss: float, n: int) -> None:
        acc[f"{prefix}loss"] = acc.get(f"{prefix}loss", 0.0) + loss * n
        for name, fn in self.metrics:
            for j, (o, y) in enumerate(zip(outputs, labels, strict=True)):
                key = f"{prefix}{name}" if len(outputs) == 1 else f"{prefix}{self.spec.label_cols[j]}_{name}"
                acc[key] = acc.get(key, 0.0) + float(fn(o.detach(), y)) * n

    def _epoch_metrics(self, acc: dict, rows: int) -> dict[str, float]:
        """Row-weighted sums -> means over every rank's rows (one allreduce)."""
        import torch

        keys = sorted(acc)
        buf = torch.tensor([acc[k] for k in keys] + [float(rows)], dtype=torch.float64)
        total = self.hvd.allreduce(buf, op=self.hvd.Sum, name=f"spark_hvd.metrics.{len(keys)}.{'.'.join(keys)}")
        count = max(float(total[-1]), 1.0)
        return {k: float(total[i]) / count for i, k in enumerate(keys)}
