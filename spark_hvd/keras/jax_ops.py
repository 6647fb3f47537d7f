"""Collectives on JAX arrays for Keras 3's JAX backend (``KERAS_BACKEND=jax``).

A concrete array goes to the core as numpy and comes back as a ``jax.Array``; inside ``jax.jit`` (Keras's compiled
``train_step``, where ``DistributedOptimizer`` reduces the gradients) the same numpy code runs in an ordered
``jax.experimental.io_callback``, so every rank runs its collectives in program order. CPU arrays; not
differentiable (Keras's JAX trainer reduces gradients, it does not differentiate through the reduction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from spark_hvd import _binding_common as common
from spark_hvd.core import compression as _compression
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet, global_process_set

FP16Compressor, Compression = _compression.framework_compression(
    __name__, half=jnp.float16, is_floating=lambda dtype: jnp.issubdtype(dtype, jnp.floating),
    cast=lambda tensor, dtype: tensor.astype(dtype))


def init(*args: Any, **kwargs: Any) -> None:
    """Join the job (idempotent). Arguments go to :func:`spark_hvd.core.init`."""
    common.core().init(*args, **kwargs)


def _traced(arrays: Sequence[Any]) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _host(fn: Callable[..., list[np.ndarray]], arrays: Sequence[Any], shapes: Sequence[jax.ShapeDtypeStruct]
          ) -> list[Any]:
    """``fn`` on numpy copies of ``arrays``: at once, or as an ordered host callback inside ``jax.jit``."""
    if _traced(arrays):
        return list(io_callback(lambda *a: fn(*[np.array(x, copy=True) for x in a]), list(shapes), *arrays,
                                ordered=True))
    return [jnp.asarray(o) for o in fn(*[np.array(a, copy=True) for a in arrays])]


def grouped_allreduce(values: Sequence[Any], name: str | None = None, average: bool | None = None,
                      compression: Any = Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Reduce several arrays across ranks (of ``process_set``; default: average) as one collective."""
    common.require_init("grouped_allreduce()")
    common.check_member(process_set, "grouped_allreduce()")
    rop = common.resolve_op(op, average)
    pairs = [compression.compress(jnp.asarray(v)) for v in values]
    sent = [p[0] for p in pairs]
    if not sent:
        return []
    names = [None] * len(sent) if name is None else [f"{name}.{i}" for i in range(len(sent))]

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        c = common.core()
        views = [common.to_core_buffer(a) for a in arrays]
        handles = [c.allreduce_async(v, name=n, op=rop, prescale=prescale_factor, postscale=postscale_factor,
                                     bfloat16=flag, process_set=process_set)
                   for (v, flag), n in zip(views, names, strict=True)]
        for h in handles:
            c.synchronize(h)
        return list(arrays)

    outs = _host(fn, sent, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in sent])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs, strict=True)]


def allreduce(value: Any, name: str | None = None, average: bool | None = None, compression: Any = Compression.none,
              op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``value`` across ranks (default: average); a new array of the same shape."""
    return grouped_allreduce([value], name, average, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


def _concrete(what: str, value: Any) -> np.ndarray:
    if _traced([value]):
        raise NotImplementedError(f"{what} of a traced JAX array (inside jax.jit) is not supported: its output "
                                  "shape depends on the other ranks; call it outside jit")
    return np.array(value, copy=True)


def allgather(value: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """Every rank's ``value`` concatenated on dimension 0 (outside ``jax.jit``)."""
    common.require_init("allgather()")
    a = _concrete("allgather", value)
    buf, _ = common.to_core_buffer(a)
    return jnp.asarray(np.asarray(common.core().allgather(buf, name=name, process_set=process_set)).view(a.dtype))


def broadcast(value: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Root's ``value`` on every rank."""
    common.require_init("broadcast()")
    common.check_member(process_set, "broadcast()")
    arr = jnp.asarray(value)

    def fn(a: np.ndarray) -> list[np.ndarray]:
        common.core().broadcast(common.to_core_buffer(a)[0], root_rank, name=name, process_set=process_set)
        return [a]
    return _host(fn, [arr], [jax.ShapeDtypeStruct(arr.shape, arr.dtype)])[0]


def alltoall(value: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows to rank i (outside ``jax.jit``); with ``splits`` given ``(output, received_splits)``."""
    common.require_init("alltoall()")
    a = _concrete("alltoall", value)
    split_list = None if splits is None else [int(s) for s in np.asarray(splits).reshape(-1)]
    out, rsplits = common.core().alltoall(common.to_core_buffer(a)[0], splits=split_list, name=name,
                                          process_set=process_set)
    out = jnp.asarray(np.asarray(out).view(a.dtype))
    return out if splits is None else (out, jnp.asarray(np.asarray(rsplits, dtype=np.int32)))


def reducescatter(value: Any, name: str | None = None, op: ReduceOp | None = None, average: bool | None = None,
                  process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``value`` across ranks and return this rank's rows (outside ``jax.jit``)."""
    common.require_init("reducescatter()")
    a = _concrete("reducescatter", value)
    out = common.core().reducescatter(a, op=common.resolve_op(op, average), name=name, process_set=process_set)
    return jnp.asarray(out)
