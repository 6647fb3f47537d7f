"""``TorchEstimator`` and ``TorchModel``: what differs for PyTorch (the rest is in ``base.py`` and ``params.py``)."""

from __future__ import annotations

import inspect
import io
import logging
import os
import pickle
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
from pyspark import keyword_only

from spark_hvd.estimators.base import BaseEstimator, BaseModel, RunFiles, ShardReaders, append_history
from spark_hvd.estimators.params import LOSS_NAMES, TorchEstimatorParams, TorchModelParams

__all__ = ["TorchEstimator", "TorchModel"]

log = logging.getLogger(__name__)


class TorchModel(BaseModel, TorchModelParams):
    """A trained ``torch.nn.Module`` as a Spark ML ``Model``.

    ``transform(df)`` calls the module on batches of ``batch_size`` rows, one tensor per feature column (Vector and
    array columns as ``(rows, size)`` float32, or ``(rows, *input_shape)``; scalar columns as ``(rows,)``), and adds
    one column per label: ``<label>__output`` by default (``setOutputCols``), a double where the module gives one
    value per row and an ``array<float>`` otherwise. A module with several labels returns a tuple of tensors.
    """

    @keyword_only
    def __init__(self, *, model: Any = None, feature_cols: list[str] | None = None,
                 label_cols: list[str] | None = None, output_cols: list[str] | None = None, batch_size: int = 1024,
                 history: dict | None = None, run_id: str | None = None, metadata: dict | None = None,
                 input_shapes: list[list[int]] | None = None) -> None:
        super().__init__()
        self._set(**self._input_kwargs)

    @keyword_only
    def setParams(self, *, model: Any = None, feature_cols: list[str] | None = None,  # noqa: N802
                  label_cols: list[str] | None = None, output_cols: list[str] | None = None, batch_size: int = 1024,
                  history: dict | None = None, run_id: str | None = None, metadata: dict | None = None,
                  input_shapes: list[list[int]] | None = None) -> TorchModel:
        """Sets params by keyword and returns ``self``."""
        return self._set(**self._input_kwargs)

    def _input_shapes(self) -> list | None:
        return self.getOrDefault(self.input_shapes)

    @classmethod
    def _serialize_model(cls, model: Any) -> bytes:
        return serialize_module(model)

    @classmethod
    def _deserialize_model(cls, data: bytes) -> Any:
        return deserialize_module(data)

    @classmethod
    def _load_for_inference(cls, data: bytes) -> Any:
        import torch
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is not None:  # one intra-op thread per task core: tasks of an executor share its cores
            torch.set_num_threads(max(1, int(ctx.cpus())))
        model = cls._deserialize_model(data)  # on the CPU, wherever it was trained
        model.eval()
        return model

    @classmethod
    def _predict(cls, model: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
        import torch

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")  # Arrow buffers are read-only; not written
            tensors = [torch.from_numpy(x) for x in inputs]
        with torch.inference_mode():
            out = model(*tensors)
        if isinstance(out, torch.Tensor):
            out = [out]
        return [o.detach().cpu().numpy() for o in out]


class _CPUUnpickler(pickle.Unpickler):
    """Unpickles a cloudpickled module with every tensor storage loaded on the CPU.

    A tensor pickles as its storage's ``torch.save`` bytes, loaded back by ``torch.storage._load_from_bytes``,
    which restores the storage on the device it was saved from: a module pickled on a GPU (trained there, or
    built there by the user) would fail to load on a CPU-only executor or driver. This unpickler swaps that one
    function for a ``torch.load(..., map_location="cpu")``.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.storage" and name == "_load_from_bytes":
            return _load_storage_on_cpu
        return super().find_class(module, name)


def _load_storage_on_cpu(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def deserialize_module(data: bytes) -> Any:
    """The inverse of :func:`serialize_module`, with every parameter and buffer on the CPU (whatever device the
    module was on when it was pickled); move it with ``.to(device)``."""
    model = _CPUUnpickler(io.BytesIO(data)).load()
    return model.to("cpu") if hasattr(model, "to") else model


def serialize_module(model: Any) -> bytes:
    """A ``torch.nn.Module`` -> bytes (cloudpickle, so classes defined in a notebook travel by value)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        return cloudpickle.dumps(model)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do
        raise TypeError(f"the model ({type(model).__name__}) cannot be pickled with cloudpickle: {exc}. Keep "
                        "open files, locks, sockets and generators out of the module's attributes.") from exc


# ------------------------------------------------------------------------------------------------ the estimator


class TorchEstimator(BaseEstimator, TorchEstimatorParams):
    """Data-parallel training of a ``torch.nn.Module`` on a Spark DataFrame; ``fit(df)`` returns a ``TorchModel``.

    Example::

        est = TorchEstimator(num_proc=2, store=Store.create("/tmp/store"), model=net,
                             optimizer=torch.optim.Adam(net.parameters(), lr=1e-3), loss="cross_entropy",
                             feature_cols=["features"], label_cols=["label"], batch_size=64, epochs=5,
                             validation=0.1)
        model = est.fit(train_df)          # or Pipeline(stages=[assembler, est]).fit(train_df)

    The module is called with one tensor per feature column (see ``TorchModel``) and returns one tensor per label
    (a tuple for several). The optimizer is rebuilt on every rank from its class, param groups and state, on that
    rank's copy of the module, then wrapped in ``spark_hvd.torch.DistributedOptimizer``. The learning rate is used
    as given: gradients are averaged over ranks, so scale it yourself (often by ``num_proc``) if you want to.

    ``loss``: a callable ``loss(output, label)``, a name (``"mse"``, ``"cross_entropy"``, ``"bce_with_logits"``,
    ``"l1"``), or a list with one per label (combined with ``loss_weights``). With ``sample_weight_col``, a callable
    must return one loss per row. ``metrics``: names (``"accuracy"``, ``"mse"``, ``"mae"``) or callables
    ``fn(output, label) -> scalar tensor``, computed per epoch on train and validation data, averaged over ranks.
    ``callbacks``: objects with any of ``on_epoch_begin(epoch)``, ``on_batch_end(epoch, step, loss)``,
    ``on_epoch_end(epoch, logs)``, called on every rank.
    """

    _model_class = TorchModel

    @keyword_only
    def __init__(self, *, num_proc: int | None = None, model: Any = None, optimizer: Any = None, loss: Any = None,
                 loss_weights: list[float] | None = None, metrics: list | None = None,
                 feature_cols: list[str] | None = None, label_cols: list[str] | None = None,
                 sample_weight_col: str | None = None, input_shapes: list[list[int]] | None = None,
                 validation: float | str | None = None, batch_size: int = 32, val_batch_size: int | None = None,
                 epochs: int = 1, train_steps_per_epoch: int | None = None,
                 validation_steps_per_epoch: int | None = None, shuffle: bool = True, random_seed: int | None = None,
                 store: Any = None, run_id: str | None = None, callbacks: list | None = None,
                 train_minibatch_fn: Callable | None = None, transformation_fn: Callable | None = None,
                 backward_passes_per_step: int = 1, gradient_compression: Any = None, use_gpu: bool | None = None,
                 partitions_per_process: int = 10, verbose: int = 1, mlflow: bool | str | None = None,
                 max_retries: int = 0) -> None:
        super().__init__()
        self._set(**self._input_kwargs)

    @keyword_only
    def setParams(self, *, num_proc: int | None = None, model: Any = None, optimizer: Any = None,  # noqa: N802
                  loss: Any = None, loss_weights: list[float] | None = None, metrics: list | None = None,
                  feature_cols: list[str] | None = None, label_cols: list[str] | None = None,
                  sample_weight_col: str | None = None, input_shapes: list[list[int]] | None = None,
                  validation: float | str | None = None, batch_size: int = 32, val_batch_size: int | None = None,
                  epochs: int = 1, train_steps_per_epoch: int | None = None,
                  validation_steps_per_epoch: int | None = None, shuffle: bool = True,
                  random_seed: int | None = None, store: Any = None, run_id: str | None = None,
                  callbacks: list | None = None, train_minibatch_fn: Callable | None = None,
                  transformation_fn: Callable | None = None, backward_passes_per_step: int = 1,
                  gradient_compression: Any = None, use_gpu: bool | None = None, partitions_per_process: int = 10,
                  verbose: int = 1, mlflow: bool | str | None = None, max_retries: int = 0) -> TorchEstimator:
        """Sets params by keyword and returns ``self``."""
        return self._set(**self._input_kwargs)

    # ---- persistence: the optimizer is saved as a spec over the model's parameters, rebuilt on load
    @classmethod
    def _serialize_model(cls, model: Any) -> bytes:
        return serialize_module(model)

    @classmethod
    def _deserialize_model(cls, data: bytes) -> Any:
        return deserialize_module(data)

    def _dump_object(self, name: str, value: Any) -> bytes:
        if name == "optimizer":
            return cloudpickle.dumps(optimizer_spec(value, self.getOrDefault(self.model)))
        return super()._dump_object(name, value)

    def _load_objects(self, blobs: dict[str, bytes]) -> dict[str, Any]:
        spec = blobs.pop("optimizer", None)
        out = super()._load_objects(blobs)
        if spec is not None:
            out["optimizer"] = build_optimizer(_CPUUnpickler(io.BytesIO(spec)).load(), out["model"])
        return out

    # ---- framework hooks of BaseEstimator
    def _check_model(self, model: Any) -> bytes:
        data = serialize_module(model)
        opt = self._opt(self.optimizer)
        if opt is None:
            raise ValueError("TorchEstimator: set optimizer, e.g. torch.optim.Adam(model.parameters(), lr=1e-3)")
        self._optimizer_spec = optimizer_spec(opt, model)
        shapes = self.getOrDefault(self.input_shapes)
        if shapes is not None and len(shapes) != len(self.getOrDefault(self.feature_cols)):
            raise ValueError(f"TorchEstimator: input_shapes has {len(shapes)} entries for "
                             f"{len(self.getOrDefault(self.feature_cols))} feature columns")
        return data

    def _check_loss(self, n_labels: int) -> None:
        resolve_losses(self._opt(self.loss), n_labels)
        for m in self._metrics():
            _resolve_metric(m)

    def _train_spec(self, model_bytes: bytes) -> dict:
        get = self.getOrDefault
        return {
            "model_bytes": model_bytes,
            "optimizer": self._optimizer_spec,
            "loss": get(self.loss),
            "loss_weights": get(self.loss_weights),
            "metrics": self._metrics(),
            "input_shapes": get(self.input_shapes),
            "train_minibatch_fn": self._opt(self.train_minibatch_fn),
        }

    def _train_function(self) -> Callable[[dict], Any]:
        return train_on_rank

    def _load_trained_model(self, store: Any, run_id: str) -> Any:
        import torch

        # a CPU copy of the user's module (which may sit on a GPU of the driver), then the trained weights
        model = deserialize_module(serialize_module(self.getOrDefault(self.model)))
        state = torch.load(io.BytesIO(RunFiles(store, run_id).read_model_file("model.pt")), map_location="cpu")
        model.load_state_dict(state)
        return model.eval()

    def _model_params(self) -> dict:
        return {"input_shapes": self.getOrDefault(self.input_shapes)}

    def _log_mlflow_model(self, model: Any, **kwargs: Any) -> None:
        import mlflow.pytorch
        import torch

        # explicit requirements: MLflow's inference of them loads the model in a subprocess (tens of seconds)
        mlflow.pytorch.log_model(model, name="model", serialization_format="pickle",
                                 pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                                                   f"cloudpickle=={cloudpickle.__version__}"], **kwargs)


# ------------------------------------------------------------------------------------------------ optimizer


def optimizer_spec(optimizer: Any, model: Any) -> dict:
    """What rebuilds ``optimizer`` on another copy of ``model``: its class, param groups (as indices into
    ``model.parameters()``) with their hyperparameters, its defaults and its state."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer built on the model's parameters, got "
                        f"{type(optimizer).__name__}")
    index = {id(p): i for i, p in enumerate(model.parameters())}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        idx = [index.get(id(p)) for p in group["params"]]
        if None in idx:
            raise ValueError(f"optimizer param group {g} holds tensors that are not parameters of the model; build "
                             "it on this model, e.g. torch.optim.Adam(model.parameters(), lr=1e-3)")
        groups.append((idx, {k: v for k, v in group.items() if k != "params"}))
    cls = type(optimizer)
    if getattr(cls, "__module__", "") == "spark_hvd.torch.optimizer":  # a DistributedOptimizer: its base class
        cls = cls.__mro__[2]
    # the state on the CPU (load_state_dict moves it to each parameter's device), so it unpickles anywhere
    return {"cls": cls, "groups": groups, "defaults": dict(optimizer.defaults),
            "state": _to_cpu(optimizer.state_dict())}


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples moved to the CPU."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def build_optimizer(spec: dict, model: Any) -> Any:
    """The optimizer described by ``optimizer_spec``, on ``model``'s parameters, with its state loaded."""
    params = list(model.parameters())
    groups = [{"params": [params[i] for i in idx], **hyper} for idx, hyper in spec["groups"]]
    cls = spec["cls"]
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in spec["defaults"].items() if k in accepted and k != "params"}
    opt = cls(groups, **kwargs)
    opt.load_state_dict(spec["state"])
    return opt


# ------------------------------------------------------------------------------------------------ loss, metrics

_LOSS_FUNCTIONS = {"mse": "mse_loss", "cross_entropy": "cross_entropy",
                   "bce_with_logits": "binary_cross_entropy_with_logits", "l1": "l1_loss"}


def resolve_losses(loss: Any, n_labels: int) -> list[Any]:
    """One loss (a callable or a name) per label; raises ``ValueError`` naming what is wrong."""
    if loss is None:
        raise ValueError(f"TorchEstimator: set loss: a callable, one of {list(LOSS_NAMES)}, or a list of them")
    losses = list(loss) if isinstance(loss, list | tuple) else [loss] * n_labels
    if len(losses) != n_labels:
        raise ValueError(f"TorchEstimator: {len(losses)} losses for {n_labels} label columns; give one loss per "
                         "label (or a single loss for all of them)")
    for i, item in enumerate(losses):
        if isinstance(item, str):
            if item not in _LOSS_FUNCTIONS:
                raise ValueError(f"TorchEstimator: unknown loss name {item!r} (label {i}); use one of "
                                 f"{list(LOSS_NAMES)} or a callable")
        elif not callable(item):
            raise ValueError(f"TorchEstimator: loss {i} is a {type(item).__name__}, not a callable or a name")
    return losses


def _loss_fn(item: Any, weighted: bool) -> tuple[Callable, bool]:
    """(fn(output, label) -> loss, whether labels are class indices)."""
    import torch.nn.functional as F  # noqa: N812

    if isinstance(item, str):
        fn = getattr(F, _LOSS_FUNCTIONS[item])
        if weighted:
            return (lambda o, y, _f=fn: _per_row(_f(o, y, reduction="none"))), item == "cross_entropy"
        return fn, item == "cross_entropy"
    import torch

    is_ce = item is F.cross_entropy or isinstance(item, torch.nn.CrossEntropyLoss | torch.nn.NLLLoss) \
        or item is F.nll_loss
    return item, is_ce


def _per_row(loss: Any) -> Any:
    return loss.reshape(loss.shape[0], -1).mean(1) if loss.dim() > 1 else loss


def _resolve_metric(metric: Any) -> tuple[str, Callable]:
    if isinstance(metric, str):
        if metric not in ("accuracy", "mse", "mae"):
            raise ValueError(f"TorchEstimator: unknown metric {metric!r}; use accuracy, mse, mae or a callable")
        return metric, _METRICS[metric]
    if not callable(metric):
        raise ValueError(f"TorchEstimator: metric {metric!r} is not a callable or a name")
    return getattr(metric, "__name__", type(metric).__name__), metric


def _accuracy(output: Any, label: Any) -> Any:
    if output.dim() > 1 and output.shape[-1] > 1:
        return (output.argmax(-1) == label.reshape(output.shape[:-1]).long()).float().mean()
    return ((output.reshape(-1) > 0.5) == (label.reshape(-1) > 0.5)).float().mean()


def _mse(output: Any, label: Any) -> Any:
    return ((output - label.reshape(output.shape).to(output.dtype)) ** 2).mean()


def _mae(output: Any, label: Any) -> Any:
    return (output - label.reshape(output.shape).to(output.dtype)).abs().mean()


_METRICS = {"accuracy": _accuracy, "mse": _mse, "mae": _mae}


def _fit_label(output: Any, label: Any, class_index: bool) -> Any:
    """Labels as the loss wants them: class indices as int64 of shape (rows,), else the output's dtype and shape."""
    if class_index:
        return label.reshape(-1).long() if label.dim() > 1 and label.shape[1:].numel() == 1 else label.long()
    label = label.to(output.dtype) if label.dtype != output.dtype and output.dtype.is_floating_point else label
    if label.shape != output.shape and label.numel() == output.numel():
        label = label.reshape(output.shape)
    return label


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


# ------------------------------------------------------------------------------------------------ on every rank


def train_on_rank(spec: dict) -> dict | None:
    """The training function of every rank (run by ``spark_hvd.runner``); rank 0 returns the history."""
    import torch

    import spark_hvd.torch as hvd
    from spark_hvd.runner import StepReporter, report

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, hvd.local_size())))
    if spec["random_seed"] is not None:
        torch.manual_seed(spec["random_seed"])
        np.random.seed(spec["random_seed"] % (2**32))
    use_gpu = spec["use_gpu"] is not False and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    model = deserialize_module(spec["model_bytes"]).to(device)
    optimizer = build_optimizer(spec["optimizer"], model)
    files = RunFiles(spec["store"], spec["run_id"])
    start, history = 0, {}
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            found = files.latest_checkpoint(tmp)
            if found is not None:
                last, history = found
                model.load_state_dict(torch.load(f"{tmp}/model.pt", map_location=device))
                optimizer.load_state_dict(torch.load(f"{tmp}/optimizer.pt", map_location=device))
                start = last + 1
                logging.getLogger(__name__).info("run %s: resuming after epoch %d", spec["run_id"], last)
    start, history = hvd.broadcast_object((start, history), root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    kwargs = {"named_parameters": model.named_parameters(),
              "backward_passes_per_step": spec["backward_passes_per_step"]}
    if spec["gradient_compression"] is not None:
        kwargs["compression"] = spec["gradient_compression"]
    dist_opt = hvd.DistributedOptimizer(optimizer, **kwargs)

    weighted = bool(spec["sample_weight_col"])
    resolved = [_loss_fn(item, weighted) for item in resolve_losses(spec["loss"], len(spec["label_cols"]))]
    class_index = [ci for _, ci in resolved]
    loss_weights = spec["loss_weights"] or [1.0] * len(resolved)
    metrics = [_resolve_metric(m) for m in spec["metrics"]]
    shapes = spec["input_shapes"]
    step_fn = spec["train_minibatch_fn"] or default_train_minibatch
    bpps = spec["backward_passes_per_step"]

    def transform_outputs(outputs: Any, labels: list) -> tuple[list, list]:
        outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
        return outputs, [_fit_label(o, y, ci) for o, y, ci in zip(outputs, labels, class_index, strict=True)]

    def loss_fn(outputs: list, labels: list, sample_weights: Any) -> Any:
        total = 0.0
        for (fn, _), w, o, y in zip(resolved, loss_weights, outputs, labels, strict=True):
            value = fn(o, y)
            if sample_weights is not None:
                if value.dim() == 0:
                    raise ValueError("with sample_weight_col, a callable loss must return one value per row "
                                     "(e.g. reduction='none')")
                sw = sample_weights.reshape(-1).to(value.dtype)
                value = (_per_row(value) * sw).sum() / sw.sum().clamp_min(1e-12)
            total = total + w * value
        return total / bpps if bpps > 1 else total

    def tensors(batch: dict) -> tuple[list, list, Any]:
        with warnings.catch_warnings():
            # the reader's arrays may be read-only views of Arrow buffers; the tensors are never written in place
            warnings.filterwarnings("ignore", message=".*not writable.*")
            inputs = []
            for i, col in enumerate(spec["feature_cols"]):
                t = torch.from_numpy(np.ascontiguousarray(batch[col]))
                if shapes is not None:
                    t = t.reshape(t.shape[0], *shapes[i])
                inputs.append(t.to(device))
            labels = [torch.from_numpy(np.ascontiguousarray(batch[c])).to(device) for c in spec["label_cols"]]
            sw = batch.get(spec["sample_weight_col"]) if weighted else None
            sw = torch.from_numpy(np.ascontiguousarray(sw)).to(device) if sw is not None else None
        return inputs, labels, sw

    def add_metrics(acc: dict, prefix: str, outputs: list, labels: list, loss: Any, n: int) -> None:
        acc[f"{prefix}loss"] = acc.get(f"{prefix}loss", 0.0) + float(loss) * (bpps if prefix == "" else 1) * n
        for name, fn in metrics:
            for j, (o, y) in enumerate(zip(outputs, labels, strict=True)):
                key = f"{prefix}{name}" if len(outputs) == 1 else f"{prefix}{spec['label_cols'][j]}_{name}"
                acc[key] = acc.get(key, 0.0) + float(fn(o.detach(), y)) * n

    def averaged(acc: dict, rows: int) -> dict:
        keys = sorted(acc)
        buf = torch.tensor([acc[k] for k in keys] + [float(rows)], dtype=torch.float64)
        total = hvd.allreduce(buf, op=hvd.Sum, name=f"spark_hvd.metrics.{len(keys)}.{'.'.join(keys)}")
        count = max(float(total[-1]), 1.0)
        return {k: float(total[i]) / count for i, k in enumerate(keys)}

    callbacks = spec["callbacks"]
    readers = ShardReaders(spec, rank, size)
    output_shapes = None
    progress = StepReporter(readers.steps("train"), spec["epochs"]) if rank == 0 and spec["verbose"] else None
    for epoch in range(start, spec["epochs"]):
        for cb in callbacks:
            getattr(cb, "on_epoch_begin", lambda e: None)(epoch)
        model.train()
        acc, rows = {}, 0
        for step, batch in enumerate(readers.epoch("train", epoch)):
            inputs, labels, sw = tensors(batch)
            if bpps > 1 and spec["train_minibatch_fn"] is None:
                # accumulate bpps backward passes; DistributedOptimizer allreduces on the last, step() applies it
                if step % bpps == 0:
                    dist_opt.zero_grad()
                outputs, labels = transform_outputs(model(*inputs), labels)
                loss = loss_fn(outputs, labels, sw)
                loss.backward()
                if (step + 1) % bpps == 0:
                    dist_opt.step()
            else:
                outputs, loss = step_fn(model, dist_opt, transform_outputs, loss_fn, inputs, labels, sw)
                outputs, labels = transform_outputs(outputs, labels)
            if output_shapes is None:
                output_shapes = [list(o.shape[1:]) for o in outputs]
            n = int(inputs[0].shape[0])
            add_metrics(acc, "", outputs, labels, loss.detach(), n)
            rows += n
            for cb in callbacks:
                getattr(cb, "on_batch_end", lambda e, s, loss: None)(epoch, step, float(loss))
            if progress is not None:
                progress(epoch, step + 1, loss=loss.detach())
        logs = averaged(acc, rows)
        if readers.has_validation:
            model.eval()
            vacc, vrows = {}, 0
            with torch.no_grad():
                for batch in readers.epoch("val", epoch):
                    inputs, labels, sw = tensors(batch)
                    outputs, labels = transform_outputs(model(*inputs), labels)
                    loss = loss_fn(outputs, labels, sw) * (bpps if bpps > 1 else 1)
                    n = int(inputs[0].shape[0])
                    add_metrics(vacc, "val_", outputs, labels, loss, n)
                    vrows += n
            logs.update(averaged(vacc, vrows))
        append_history(history, logs)
        if rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                torch.save({k: v.cpu() for k, v in model.state_dict().items()}, f"{tmp}/model.pt")
                torch.save(optimizer.state_dict(), f"{tmp}/optimizer.pt")
                files.write_checkpoint(epoch, tmp, history)
        report(epoch=epoch, **logs)
        for cb in callbacks:
            getattr(cb, "on_epoch_end", lambda e, logs: None)(epoch, logs)
    if rank != 0:
        return None
    if output_shapes is None:  # nothing left to train (a finished run resumed): one forward pass for the shapes
        model.eval()
        with torch.no_grad():
            gen = readers.epoch("train", 0)
            batch = next(gen)
            gen.close()
            out = model(*tensors(batch)[0])
            output_shapes = [list(o.shape[1:]) for o in (out if isinstance(out, list | tuple) else [out])]
    with tempfile.TemporaryDirectory() as tmp:
        buf = io.BytesIO()
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, buf)
        with open(f"{tmp}/model.pt", "wb") as f:
            f.write(buf.getvalue())
        files.write_model(tmp)
    return {"history": history, "output_shapes": output_shapes}
