"""``TorchEstimator`` and ``TorchModel``: what differs for PyTorch (the rest is in ``base.py`` and ``params.py``)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import cloudpickle
import numpy as np
from pyspark import keyword_only

from spark_hvd.estimators.base import BaseModel
from spark_hvd.estimators.params import TorchModelParams

__all__ = ["TorchModel"]

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
        return cloudpickle.loads(data)

    @classmethod
    def _load_for_inference(cls, data: bytes) -> Any:
        import torch
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is not None:  # one intra-op thread per task core: tasks of an executor share its cores
            torch.set_num_threads(max(1, int(ctx.cpus())))
        model = cls._deserialize_model(data)
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
