"""PyTorch objects <-> bytes for the estimators: the module (cloudpickle, loaded on the CPU) and the optimizer (a
spec rebuilt on another copy of the module). The driver side (``torch/estimator.py``) and the rank side
(``torch/rank.py``) both use it."""

from __future__ import annotations

import inspect
import io
import pickle
from typing import Any

from spark_hvd import pickling

__all__ = ["serialize_module", "deserialize_module", "optimizer_spec", "build_optimizer", "load_optimizer_spec"]


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
        return pickling.dumps(model)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do
        raise TypeError(f"the model ({type(model).__name__}) cannot be pickled with cloudpickle: {exc}. Keep "
                        "open files, locks, sockets and generators out of the module's attributes.") from exc


def load_optimizer_spec(data: bytes) -> dict:
    """A pickled :func:`optimizer_spec` read back with every tensor of its state on the CPU."""
    return _CPUUnpickler(io.BytesIO(data)).load()


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
