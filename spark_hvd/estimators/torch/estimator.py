"""``TorchEstimator`` and ``TorchModel``: what differs for PyTorch (the rest is in ``common/``: ``fit.py``,
``model.py``, ``params.py``; the rank half is ``torch/rank.py``)."""

from __future__ import annotations

import io
import logging
import warnings
from typing import Any

import cloudpickle
import numpy as np

from spark_hvd import pickling
from spark_hvd.estimators.common import compat
from spark_hvd.estimators.common.errors import param_error, param_type_error
from spark_hvd.estimators.common.fit import BaseEstimator
from spark_hvd.estimators.common.mlflow_stage import MlflowStage
from spark_hvd.estimators.common.model import BaseModel, task_gpu_index, task_threads
from spark_hvd.estimators.common.params import KeywordParams
from spark_hvd.estimators.common.rank_run import EarlyStopping
from spark_hvd.estimators.common.spec import BestPolicy
from spark_hvd.estimators.torch.params import TorchEstimatorParams, TorchModelParams
from spark_hvd.estimators.torch.rank import TorchTrainer, is_class_index_loss, resolve_losses, resolve_metric
from spark_hvd.estimators.torch.serde import (
    build_optimizer,
    deserialize_module,
    load_optimizer_spec,
    optimizer_spec,
    serialize_module,
)
from spark_hvd.estimators.torch.spec import TorchSpec
from spark_hvd.store.run_dir import RunDir

__all__ = ["TorchEstimator", "TorchModel", "EarlyStopping"]

log = logging.getLogger(__name__)


class TorchModel(KeywordParams, MlflowStage, BaseModel, TorchModelParams):
    """A trained ``torch.nn.Module`` as a Spark ML ``Model``.

    ``transform(df)`` calls the module on batches of ``batch_size`` rows, one tensor per feature column (Vector and
    array columns as ``(rows, size)`` float32, or ``(rows, *input_shape)``; scalar columns as ``(rows,)``), and adds
    one column per label: ``<label>__output`` by default (``setOutputCols``), a double where the module gives one
    value per row and an ``array<float>`` otherwise. A module with several labels returns a tuple of tensors.
    """

    _serialize_model = staticmethod(serialize_module)
    _deserialize_model = staticmethod(deserialize_module)

    def _input_shapes(self) -> list | None:
        return self.getOrDefault(self.input_shapes)

    @classmethod
    def _load_for_inference(cls, data: bytes, use_gpu: bool = False) -> Any:
        import torch

        threads = task_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        model = cls._deserialize_model(data)  # on the CPU, wherever it was trained
        index = task_gpu_index(use_gpu, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if index is not None:
            model.to(torch.device("cuda", index))
        model.eval()
        return model

    @classmethod
    def _predict(cls, model: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return cls._predict_batches(model, inputs, max(1, len(inputs[0])))

    def export(self, path: str, format: str = "torchscript", example: Any = None, verify: bool = True,  # noqa: A002
               **kwargs: Any) -> dict[str, Any]:
        """Write the network to the directory ``path`` as ``format`` ``"torchscript"`` or ``"onnx"``, with its
        input and output names and shapes in ``spark_hvd_export.json`` beside it (the batch dimension open);
        ``verify`` loads the artifact back and compares it with the network. See ``estimators/torch/export.py``."""
        from spark_hvd.estimators.torch.export import export_torch

        return export_torch(self, path, format, example=example, verify=verify, **kwargs)

    @classmethod
    def _predict_batches(cls, model: Any, inputs: list[np.ndarray], batch_size: int) -> list[np.ndarray]:
        """One ``torch.from_numpy`` per input (no copy), the module on ``batch_size`` rows at a time on the
        module's device, one host copy of each output at the end. On a GPU the inputs are copied once into pinned
        host memory, so each batch's copy to the device is asynchronous (``non_blocking``): the next batch's
        transfer overlaps this batch's kernels."""
        import torch

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")  # Arrow buffers are read-only; not written
            tensors = [torch.from_numpy(x) for x in inputs]
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        if device.type == "cuda":
            tensors = [t.pin_memory() for t in tensors]
        parts: list[list[Any]] = []
        with torch.inference_mode():
            for start in range(0, len(tensors[0]), batch_size) or [0]:
                chunk = [t[start:start + batch_size] for t in tensors]
                if device.type != "cpu":
                    chunk = [t.to(device, non_blocking=True) for t in chunk]
                out = model(*chunk)
                outs = [out] if isinstance(out, torch.Tensor) else list(out)
                if not parts:
                    parts = [[] for _ in outs]
                if len(outs) != len(parts):
                    raise ValueError(f"the module returned {len(outs)} outputs for one batch and {len(parts)} "
                                     "for another")
                for acc, o in zip(parts, outs, strict=True):
                    acc.append(o)
            return [(p[0] if len(p) == 1 else torch.cat(p)).detach().cpu().numpy() for p in parts]


# ------------------------------------------------------------------------------------------------ the estimator


class TorchModuleEstimator(BaseEstimator):
    """What the Torch and Lightning estimators share: module bytes, input shapes, the trained module read back,
    MLflow."""

    _serialize_model = staticmethod(serialize_module)
    _deserialize_model = staticmethod(deserialize_module)

    def _check_model(self, model: Any) -> bytes:
        shapes, features = self.getOrDefault(self.input_shapes), self.getOrDefault(self.feature_cols)
        if shapes is not None and len(shapes) != len(features):
            raise param_error(self, f"input_shapes has {len(shapes)} entries for {len(features)} "
                              "feature columns")
        return serialize_module(model)

    def _load_trained_model(self, store: Any, run_id: str, model_bytes: bytes) -> Any:
        import torch

        # a CPU copy of the user's module from the bytes the ranks got (not pickled again), then the trained weights
        model = deserialize_module(model_bytes)
        state = torch.load(io.BytesIO(RunDir(store, run_id).read_model_file("model.pt")), map_location="cpu")
        model.load_state_dict(state)
        return model.eval()

    def _model_params(self) -> dict:
        return {"input_shapes": self.getOrDefault(self.input_shapes)}

    def _log_mlflow_model(self, model: Any, **kwargs: Any) -> None:
        import mlflow.pytorch
        import torch

        # explicit requirements: MLflow's inference of them loads the model in a subprocess (tens of seconds)
        compat.log_model(mlflow.pytorch.log_model, model, "model", serialization_format="pickle",
                         pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                                           f"cloudpickle=={cloudpickle.__version__}"], **kwargs)


class TorchEstimator(KeywordParams, TorchModuleEstimator, TorchEstimatorParams):
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
    is called unreduced, as Horovod calls it (a torch loss module with ``reduction="none"``, a function with a
    ``reduction`` parameter with ``reduction="none"``; any other must return one loss per row), and each label's
    loss is the batch's mean of its weighted per-row losses (``mean(w * loss)``, Horovod's). ``metrics``: names
    (``"accuracy"``, ``"mse"``, ``"mae"``) or callables ``fn(output, label) -> scalar tensor``, computed per epoch
    on train and validation data, averaged over ranks.
    ``callbacks``: objects with any of ``on_train_begin(context)`` (a ``TrainingContext``: model, optimizer,
    scheduler, ``stop_training``), ``on_epoch_begin(epoch)``, ``on_batch_end(epoch, step, loss)``,
    ``on_epoch_end(epoch, logs)``, called on every rank (``EarlyStopping`` is one). ``lr_scheduler``:
    ``fn(optimizer) -> scheduler``, stepped per ``lr_scheduler_interval``. ``best_metric``/``best_mode``: only
    improving epochs are checkpointed and the best one is returned. ``terminate_on_nan``: a non-finite loss raises.
    """

    _model_class = TorchModel
    _spec_class = TorchSpec
    _trainer_class = TorchTrainer

    # ---- persistence: the optimizer is saved as a spec over the model's parameters, rebuilt on load
    def _dump_object(self, name: str, value: Any) -> bytes:
        if name == "optimizer":
            return pickling.dumps(optimizer_spec(value, self.getOrDefault(self.model)))
        return super()._dump_object(name, value)

    def _load_objects(self, blobs: dict[str, bytes]) -> dict[str, Any]:
        spec = blobs.pop("optimizer", None)
        out = super()._load_objects(blobs)
        if spec is not None:
            out["optimizer"] = build_optimizer(load_optimizer_spec(spec), out["model"])
        return out

    # ---- framework hooks of BaseEstimator
    def _check_model(self, model: Any) -> bytes:
        data = super()._check_model(model)
        opt = self._opt(self.optimizer)
        if opt is None:
            raise param_error("TorchEstimator", "set optimizer, e.g. torch.optim.Adam(model.parameters(), lr=1e-3)")
        self._optimizer_spec = optimizer_spec(opt, model)
        return data

    def _check_loss(self, n_labels: int) -> None:
        if self._opt(self.loss) is not None and self._opt(self.loss_constructors) is not None:
            raise param_error("TorchEstimator", "loss and loss_constructors are both set; set one")
        resolve_losses(self._loss_value(), n_labels)
        for m in self._metrics():
            resolve_metric(m)
        for param in ("lr_scheduler", "train_minibatch_fn"):
            value = self._opt(getattr(self, param))
            if value is not None and not callable(value):
                raise param_type_error("TorchEstimator", f"{param} must be a callable, got {type(value).__name__}")
        if self.getOrDefault(self.mixed_precision) == "fp16" and self._opt(self.train_minibatch_fn) is not None:
            raise param_error("TorchEstimator", "mixed_precision='fp16' scales the loss in the estimator's own step, "
                              "which train_minibatch_fn replaces; use mixed_precision='bf16' (no loss scaling), or "
                              "drop train_minibatch_fn")

    _is_class_index_loss = staticmethod(is_class_index_loss)

    def _learning_rate(self) -> float | None:
        groups = getattr(self._opt(self.optimizer), "param_groups", None) or []
        rates = {g.get("lr") for g in groups}
        rate = rates.pop() if len(rates) == 1 else None
        return float(rate) if isinstance(rate, int | float) else None

    def _classifier_kind(self) -> str | None:
        from spark_hvd.estimators.common.classifier import torch_kind

        return torch_kind(self._loss_value())

    def _preflight(self, spec: Any, label_max: dict[str, float]) -> None:
        from spark_hvd.estimators.torch.preflight import torch_forward_check

        torch_forward_check(type(self).__name__, spec, label_max)

    def _checkpoint_policy(self) -> BestPolicy | None:
        best = self.getOrDefault(self.best_metric)
        return BestPolicy.create(best, self.getOrDefault(self.best_mode)) if best else None

    def _train_spec(self) -> dict:
        get = self.getOrDefault
        best = get(self.best_metric)
        return {
            "optimizer": self._optimizer_spec,
            "loss": self._opt(self.loss),
            "loss_constructors": tuple(self._opt(self.loss_constructors) or ()),
            "loss_weights": get(self.loss_weights),
            "metrics": tuple(self._metrics()),
            "input_shapes": get(self.input_shapes),
            "train_minibatch_fn": self._opt(self.train_minibatch_fn),
            "lr_scheduler": self._opt(self.lr_scheduler),
            "lr_scheduler_interval": get(self.lr_scheduler_interval),
            "mixed_precision": get(self.mixed_precision),
            "checkpoint_every_steps": get(self.checkpoint_every_steps),
            "checkpoint_every_seconds": get(self.checkpoint_every_seconds),
            "elastic": get(self.elastic),
            "best": BestPolicy.create(best, get(self.best_mode)) if best else None,
        }
