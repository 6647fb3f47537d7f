"""Collectives on torch tensors, over the core's numpy buffers.

A CPU tensor is handed to the core as a numpy view of its own memory (no copy): ``tensor.numpy()``, and for
bfloat16 an int16 view read as uint16 with ``bfloat16=True``. A tensor the core cannot see directly (a CUDA
tensor, a non-contiguous view) is staged through a contiguous host copy and written back when the handle is
synchronized. CUDA tensors therefore also go through the core's engine (negotiation, fusion) and reach NCCL through
the core's torch backend (``SPARK_HVD_BACKEND=torch``, ``SPARK_HVD_TORCH_DEVICE=cuda``). They are deliberately not
sent to ``torch.distributed`` from this thread: the engine's thread drives the same communicator, and two threads
issuing collectives could order them differently on different ranks and deadlock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from spark_hvd import _binding_common as common
from spark_hvd._binding_common import (  # noqa: F401 - re-exported process API
    allgather_object,
    barrier,
    broadcast_object,
    cross_rank,
    cross_size,
    gloo_built,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
)
from spark_hvd.core.backend import ReduceOp
from spark_hvd.torch.compression import Compression, Compressor

log = logging.getLogger(__name__)

Average = common.Average
Sum = common.Sum
Min = common.Min
Max = common.Max
Product = common.Product


# --------------------------------------------------------------------------------------------------------------
# process API
# --------------------------------------------------------------------------------------------------------------

def nccl_built() -> bool:
    """True when torch has CUDA and NCCL (the core's torch backend can then use NCCL)."""
    return bool(torch.cuda.is_available() and torch.distributed.is_available()
                and torch.distributed.is_nccl_available())


def init(*args: Any, **kwargs: Any) -> None:
    """Join the job (idempotent). Arguments go to :func:`spark_hvd.core.init`; none are needed under
    ``spark-hvd-run`` or the Spark runner. On a CUDA host this rank's device is selected: ``SPARK_HVD_GPU``
    when the launcher set it, else the local rank."""
    c = common.core()
    c.init(*args, **kwargs)
    if torch.cuda.is_available():
        index = common.gpu_index(c.local_rank(), torch.cuda.device_count())
        if index is not None:
            torch.cuda.set_device(index)


# --------------------------------------------------------------------------------------------------------------
# tensors <-> core buffers
# --------------------------------------------------------------------------------------------------------------

def _np_view(tensor: torch.Tensor) -> tuple[np.ndarray, bool]:
    """Numpy view sharing memory with a contiguous CPU tensor; bfloat16 as uint16 + flag."""
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), True
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy(), False
    return t.numpy(), False


def _direct_view_ok(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_sparse


class _Staged:
    """A buffer the core works on for ``tensor``: the tensor's own memory, or a host copy written back later."""

    __slots__ = ("tensor", "host", "array", "bf16")

    def __init__(self, tensor: torch.Tensor, need_input: bool = True) -> None:
        self.tensor = tensor
        if _direct_view_ok(tensor):
            self.host = None
            src = tensor
        else:
            self.host = tensor.detach().to("cpu", copy=True).contiguous() if need_input else torch.empty(
                tensor.shape, dtype=tensor.dtype)
            src = self.host
        self.array, self.bf16 = _np_view(src)

    def write_back(self) -> torch.Tensor:
        if self.host is not None:
            with torch.no_grad():
                self.tensor.copy_(self.host)
        return self.tensor


def _from_numpy(arr: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``dtype`` on ``device`` from a core result array (no copy on CPU)."""
    arr = np.ascontiguousarray(arr)
    if dtype == torch.bfloat16:
        out = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    elif dtype == torch.bool:
        out = torch.from_numpy(arr.view(np.uint8)).view(torch.bool)
    else:
        out = torch.from_numpy(arr)
    if device.type != "cpu":
        out = out.to(device)
    return out


class Handle:
    """An operation in flight; pass it to :func:`synchronize` (result) or :func:`poll` (done yet?)."""

    __slots__ = ("_core_handle", "_finish", "_done", "_result", "_name")

    def __init__(self, core_handle: Any, finish: Callable[[Any], Any] | None = None, name: str | None = None,
                 done: bool = False) -> None:
        self._core_handle = core_handle
        self._finish = finish
        self._done = False
        self._result: Any = None
        self._name = name
        if done:
            self.wait()

    def poll(self) -> bool:
        if self._done:
            return True
        return bool(common.core().poll(self._core_handle))

    def wait(self) -> Any:
        if not self._done:
            raw = common.core().synchronize(self._core_handle) if self._core_handle is not None else None
            self._result = self._finish(raw) if self._finish is not None else raw
            self._done = True
            self._finish = None
            self._core_handle = None
        return self._result

    def __repr__(self) -> str:
        return f"Handle(name={self._name!r}, done={self._done})"


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s operation and return its result (the output tensor, or a list for grouped ops)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize() expects a Handle from an *_async call, got {type(handle).__name__}")
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when ``handle``'s operation has finished (then :func:`synchronize` returns at once)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"poll() expects a Handle from an *_async call, got {type(handle).__name__}")
    return handle.poll()


# --------------------------------------------------------------------------------------------------------------
# allreduce
# --------------------------------------------------------------------------------------------------------------

def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> Handle:
    """Start an in-place allreduce of ``tensor``; :func:`synchronize` returns ``tensor`` reduced."""
    common.require_init("allreduce_async_()")
    rop = common.resolve_op(op, average)
    staged = _Staged(tensor)
    h = common.core().allreduce_async(staged.array, name=name, op=rop, prescale=prescale_factor,
                                      postscale=postscale_factor, bfloat16=staged.bf16)
    return Handle(h, lambda _: staged.write_back(), name=name)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0) -> Handle:
    """Start an allreduce of a copy of ``tensor``; :func:`synchronize` returns the new reduced tensor."""
    common.require_init("allreduce_async()")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_async_(out, average=average, name=name, op=op, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """Allreduce ``tensor`` in place across ranks and return it."""
    common.require_init("allreduce_()")
    staged = _Staged(tensor)  # the core's blocking call runs the round in this thread (no hand-off)
    common.core().allreduce(staged.array, name=name, op=common.resolve_op(op, average), prescale=prescale_factor,
                            postscale=postscale_factor, bfloat16=staged.bf16)
    return staged.write_back()


class _AllreduceFunction(torch.autograd.Function):
    """Differentiable allreduce: the gradient of an allreduce is the allreduce of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, prescale: float,
                postscale: float) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return synchronize(allreduce_async(tensor, name=name, op=op, prescale_factor=prescale,
                                           postscale_factor=postscale))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        if ctx.op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise RuntimeError("allreduce with op Min/Max/Product is not differentiable")
        grad = synchronize(allreduce_async(grad_output, op=ctx.op, prescale_factor=ctx.prescale,
                                           postscale_factor=ctx.postscale))
        return grad, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (default: average) and return the result as a new tensor.

    ``compression=Compression.fp16`` sends floating-point data as float16. Differentiable.
    """
    common.require_init("allreduce()")
    rop = common.resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = _AllreduceFunction.apply(compressed, name, rop, prescale_factor, postscale_factor)
    else:
        out = synchronize(allreduce_async(compressed, name=name, op=rop, prescale_factor=prescale_factor,
                                          postscale_factor=postscale_factor))
    return compression.decompress(out, ctx)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start one allreduce of several tensors, in place; :func:`synchronize` returns the list."""
    common.require_init("grouped_allreduce_async_()")
    rop = common.resolve_op(op, average)
    tensors = list(tensors)
    if not tensors:
        return Handle(None, lambda _: [], name=name, done=True)
    staged = [_Staged(t) for t in tensors]
    bf16 = {s.bf16 for s in staged}
    if len(bf16) > 1:
        raise ValueError("grouped_allreduce cannot mix bfloat16 with other dtypes in one group")
    names = None if name is None else [f"{name}.{i}" for i in range(len(tensors))]
    h = common.core().grouped_allreduce_async([s.array for s in staged], names=names, op=rop,
                                              prescale=prescale_factor, postscale=postscale_factor,
                                              bfloat16=bf16.pop())
    return Handle(h, lambda _: [s.write_back() for s in staged], name=name)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start one allreduce of copies of several tensors; :func:`synchronize` returns the new tensors."""
    common.require_init("grouped_allreduce_async()")
    outs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(outs, average, name, op, prescale_factor, postscale_factor)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: ReduceOp | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Allreduce several tensors in place as one collective."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce several tensors as one collective; returns new tensors."""
    common.require_init("grouped_allreduce()")
    pairs = [compression.compress(t) for t in tensors]
    outs = synchronize(grouped_allreduce_async([p[0] for p in pairs], average, name, op, prescale_factor,
                                               postscale_factor))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs, strict=True)]


# --------------------------------------------------------------------------------------------------------------
# allgather, broadcast, alltoall, reducescatter
# --------------------------------------------------------------------------------------------------------------

def _host_array(tensor: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A contiguous host numpy array with ``tensor``'s data (a view when possible)."""
    if _direct_view_ok(tensor):
        return _np_view(tensor)
    return _np_view(tensor.detach().to("cpu").contiguous())


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> Handle:
    """Start an allgather; :func:`synchronize` returns every rank's tensor concatenated on dimension 0."""
    common.require_init("allgather_async()")
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension")
    arr, _ = _host_array(tensor)
    dtype, device = tensor.dtype, tensor.device
    h = common.core().allgather_async(arr, name=name)
    return Handle(h, lambda res: _from_numpy(res, dtype, device), name=name)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated on dimension 0 (the first dimension may differ by rank)."""
    return synchronize(allgather_async(tensor, name))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Handle:
    """Start an in-place broadcast of root's ``tensor``; :func:`synchronize` returns ``tensor``."""
    common.require_init("broadcast_async_()")
    staged = _Staged(tensor)
    h = common.core().broadcast_async(staged.array, root_rank, name=name)
    return Handle(h, lambda _: staged.write_back(), name=name)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Handle:
    """Start a broadcast into a copy of ``tensor``; :func:`synchronize` returns the new tensor."""
    common.require_init("broadcast_async()")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return broadcast_async_(out, root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with root's values, in place, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Root's ``tensor``, as a new tensor on every rank."""
    return synchronize(broadcast_async(tensor, root_rank, name))


def _splits_list(splits: Any) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(x) for x in splits.tolist()]
    return [int(x) for x in splits]


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None) -> Handle:
    """Start an alltoall; :func:`synchronize` returns ``(output, received_splits)``."""
    common.require_init("alltoall_async()")
    arr, _ = _host_array(tensor)
    dtype, device = tensor.dtype, tensor.device
    h = common.core().alltoall_async(arr, splits=_splits_list(splits), name=name)

    def finish(res: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, rsplits = res
        return _from_numpy(out, dtype, device), torch.tensor(list(rsplits), dtype=torch.int32)
    return Handle(h, finish, name=name)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank i (an even split when None) and gather what others sent.

    Returns the received rows concatenated in rank order; with ``splits`` given, ``(output, received_splits)``
    as in Horovod.
    """
    out, rsplits = synchronize(alltoall_async(tensor, splits, name))
    if splits is None:
        return out
    return out, rsplits


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None,
                        average: bool | None = None) -> Handle:
    """Start a reducescatter; :func:`synchronize` returns this rank's part of the reduced tensor."""
    common.require_init("reducescatter_async()")
    rop = common.resolve_op(op, average)
    dtype, device = tensor.dtype, tensor.device
    src = tensor.detach()
    if dtype == torch.bfloat16:
        src = src.float()  # the core's reducescatter has no bfloat16 mode: reduce in float32, round at the end
    arr = _np_view(src.to("cpu").contiguous())[0].copy()  # the core may reduce in place: keep the input intact
    out_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    h = common.core().reducescatter_async(arr, op=rop, name=name)
    return Handle(h, lambda res: _from_numpy(res, out_dtype, device).to(dtype), name=name)


def reducescatter(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None,
                  average: bool | None = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and return this rank's rows of the result (first dim split evenly,
    the first ``rows % size`` ranks getting one row more)."""
    return synchronize(reducescatter_async(tensor, name, op, average))
