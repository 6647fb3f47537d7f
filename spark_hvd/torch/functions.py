"""Broadcast of model parameters and optimizer state from one rank to all (Horovod's helpers)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from spark_hvd import _binding_common as common
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.torch import mpi_ops

log = logging.getLogger(__name__)


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite parameters / buffers on every rank (of ``process_set``), in place, with root's values.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()`` (a list of ``(name, tensor)``).
        root_rank: the (global) rank whose values win.
        process_set: broadcast among the ranks of this process set only.
    """
    common.require_init("broadcast_parameters()")
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: kv[0])
    else:
        items = list(params)
        for x in items:
            if not (isinstance(x, tuple) and len(x) == 2):
                raise ValueError("broadcast_parameters expects a state_dict or a list of (name, tensor) tuples, "
                                 f"got an element of type {type(x).__name__}")
    handles = []
    for name, p in items:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a tensor")
        handles.append(mpi_ops.broadcast_async_(p.data if p.requires_grad else p, root_rank,
                                                name=f"bcast.param.{name}", process_set=process_set))
    for h in handles:
        mpi_ops.synchronize(h)


@dataclass(frozen=True)
class _TensorSlot:
    """Placeholder for a tensor in a broadcast optimizer state skeleton."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _map_leaves(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` (nested dicts, lists and tuples, as a ``state_dict``) with every other value ``v`` as ``leaf(v)``."""
    if isinstance(obj, dict):
        return {k: _map_leaves(v, leaf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_leaves(v, leaf) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_leaves(v, leaf) for v in obj)
    return leaf(obj)


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a :class:`_TensorSlot`, the tensors appended to ``tensors``."""
    def slot(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        tensors.append(value)
        return _TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)

    return _map_leaves(obj, slot)


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every :class:`_TensorSlot` replaced by its tensor of ``tensors``."""
    return _map_leaves(obj, lambda value: tensors[value.index] if isinstance(value, _TensorSlot) else value)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's (of ``process_set``) optimizer state (moments, step counts, hyper-parameters) equal to
    root's.

    Works whatever the ranks hold: torch creates optimizer state lazily, so some ranks may have none yet
    (a fresh optimizer) while root restored a checkpoint, or the other way round. Root sends the structure of
    its ``state_dict()`` as an object and the tensors with tensor broadcasts; the other ranks load it.
    """
    common.require_init("broadcast_optimizer_state()")
    if not optimizer.state_dict()["state"]:
        # Horovod's visible side effect, which scripts may rely on: a trainable parameter without a gradient gets a
        # zero one when the optimizer has no state yet (Horovod then takes a step to create the state; here the
        # state is root's as it is, so no step is taken and no parameter moves)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    is_root = mpi_ops.rank() == root_rank
    tensors: list[torch.Tensor] = []
    skeleton = _strip(optimizer.state_dict(), tensors) if is_root else None
    skeleton = mpi_ops.broadcast_object(skeleton, root_rank=root_rank, name="bcast.optstate.skeleton",
                                        process_set=process_set)
    if is_root:
        bufs = [t.detach().to("cpu").contiguous() for t in tensors]
    else:
        slots: list[_TensorSlot] = []

        def collect(o: Any) -> None:
            if isinstance(o, _TensorSlot):
                slots.append(o)
            elif isinstance(o, dict):
                for v in o.values():
                    collect(v)
            elif isinstance(o, (list, tuple)):
                for v in o:
                    collect(v)
        collect(skeleton)
        slots.sort(key=lambda s: s.index)
        bufs = [torch.empty(s.shape, dtype=s.dtype) for s in slots]
    handles = [mpi_ops.broadcast_async_(b, root_rank, name=f"bcast.optstate.{i}", process_set=process_set)
               for i, b in enumerate(bufs)]
    for h in handles:
        mpi_ops.synchronize(h)
    if not is_root:
        optimizer.load_state_dict(_fill(skeleton, bufs))
