"""Model parameters across ranks: ``broadcast_parameters`` (Horovod's MXNet helper)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import mxnet as mx

from spark_hvd import _binding_common as common
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.mxnet import mpi_ops


def _parameter_dict_types() -> tuple[type, ...]:
    try:
        from mxnet.gluon.parameter import ParameterDict  # MXNet 1.x; MXNet 2 uses plain dicts
    except ImportError:
        return (Mapping,)
    return (Mapping, ParameterDict)


def _broadcast_after_init(param: Any, root_rank: int, name: str, process_set: ProcessSet) -> None:
    """Make ``param`` (deferred initialisation: its shape is known at the first forward pass) take root's values
    as soon as it is initialised, on every context it lives on."""
    init_impl = param._init_impl

    def init_then_broadcast(self: Any, *args: Any, **kwargs: Any) -> None:
        init_impl(*args, **kwargs)
        _broadcast_param_data(self, mpi_ops.broadcast_inplace_async([self.data()], [name], root_rank,
                                                                    process_set))
    param._init_impl = types.MethodType(init_then_broadcast, param)


def _broadcast_param_data(param: Any, wait: Any) -> None:
    wait()
    ctxs = param.list_ctx()
    if len(ctxs) > 1:  # the first context's copy got root's values: give them to the others
        param.set_data(param.data(ctxs[0]))


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str | None = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite parameters on every rank (of ``process_set``), in place, with root's values.

    Args:
        params: a Gluon ``ParameterDict`` (``net.collect_params()``), a dict of ``Parameter``, or a dict of
            NDArrays (``Module.get_params()``'s). A parameter whose initialisation is deferred (its shape is known
            at the first forward pass) gets root's values when it is initialised.
        root_rank: the (global) rank whose values win.
        prefix: prepended to each collective's name; give each call in one program its own when several models
            are broadcast (Horovod's rule).
        process_set: broadcast among the ranks of this process set only.
    """
    common.require_init("broadcast_parameters()")
    common.check_member(process_set, "broadcast_parameters()")
    if not isinstance(params, _parameter_dict_types()):
        raise ValueError(f"broadcast_parameters expects a ParameterDict or a dict of Parameters / NDArrays, got "
                         f"{type(params).__name__}")
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"broadcast_parameters: prefix must be a str, got {type(prefix).__name__}")
    if common.set_size(process_set) == 1:
        return
    prefix = prefix or ""
    tensors, names, owners = [], [], []
    for key, p in sorted(params.items(), key=lambda kv: str(kv[0])):
        name = f"{prefix}{key}"
        if isinstance(p, mx.gluon.Parameter):
            try:
                data = p.data()
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(p, root_rank, name, process_set)
                continue
            owners.append(p)
        elif isinstance(p, mx.nd.NDArray):
            data = p
            owners.append(None)
        else:
            raise ValueError(f"broadcast_parameters: {key!r} is a {type(p).__name__}, not a Parameter or an NDArray")
        tensors.append(data)
        names.append(name)
    if not tensors:
        return
    wait = mpi_ops.broadcast_inplace_async(tensors, names, root_rank, process_set)
    wait()
    for p in owners:
        if p is not None and len(p.list_ctx()) > 1:
            p.set_data(p.data(p.list_ctx()[0]))
