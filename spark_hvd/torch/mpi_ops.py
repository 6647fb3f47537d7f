"""Collectives on torch tensors, over the core's engine.

A CPU tensor is handed to the core as a numpy view of its own memory (no copy): ``tensor.numpy()``, and for
bfloat16 an int16 view read as uint16 with ``bfloat16=True``; the ring reduces it. A CUDA tensor is handed over as
it is (a ``spark_hvd.core.engine.device.DeviceBuffer``) and reduced where it lies by NCCL, with the same negotiation,
fusion and error naming (``SPARK_HVD_DEVICE_BACKEND=none`` stages it through host memory and the ring instead;
``gloo`` also sends CPU tensors down the device path, the CPU stand-in that tests it). A tensor the core cannot see
directly (a non-contiguous view) is staged through a contiguous copy written back when the handle is synchronized.
Nothing is sent to ``torch.distributed`` from this thread: the engine's thread drives the communicator, and two
threads issuing collectives could order them differently on different ranks and deadlock.

Over 400 lines on purpose: every asynchronous op of Horovod's torch surface (each with ``process_set=``) lives here,
as in ``horovod/torch/mpi_ops.py``, beside the staging helpers they share; the differentiable forms are in
``collectives.py``."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from spark_hvd import _binding_common as common
from spark_hvd._binding_common import set_rank, set_size  # noqa: F401 - used as mpi_ops.set_rank (collectives.py)
from spark_hvd._process_api import *  # noqa: F403 - Horovod's process API, re-exported as its mpi_ops does
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.engine.device import DeviceBuffer, device_key
from spark_hvd.core.process_sets import ProcessSet, global_process_set

log = logging.getLogger(__name__)



# --------------------------------------------------------------------------------------------------------------
# process API
# --------------------------------------------------------------------------------------------------------------

def init(*args: Any, **kwargs: Any) -> None:
    """Join the job (idempotent). Arguments go to :func:`spark_hvd.core.init`; none are needed under
    ``spark-hvd-run`` or the Spark runner. On a CUDA host this rank's GPU becomes torch's current device, by the
    one GPU policy (``spark_hvd.core.jobenv.gpu_index``): the GPU Spark assigned to the task, else the local rank;
    an assigned GPU that is not visible raises ``ValueError`` naming the rank."""
    c = common.core()
    c.init(*args, **kwargs)
    if torch.cuda.is_available():
        index = common.gpu_index(torch.cuda.device_count())
        if index is not None:
            torch.cuda.set_device(index)


# --------------------------------------------------------------------------------------------------------------
# tensors <-> core buffers
# --------------------------------------------------------------------------------------------------------------

def _np_view(tensor: torch.Tensor) -> tuple[np.ndarray, bool]:
    """Numpy view sharing memory with a contiguous CPU tensor; bfloat16 as uint16 + flag."""
    t = tensor.detach() if tensor.requires_grad else tensor  # detach costs more than the view itself
    dtype = t.dtype
    if dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), True
    if dtype == torch.bool:
        return t.view(torch.uint8).numpy(), False
    return t.numpy(), False


def _direct_view_ok(tensor: torch.Tensor) -> bool:
    return tensor.is_cpu and tensor.is_contiguous() and not tensor.is_sparse


def _device_key(tensor: torch.Tensor) -> str | None:
    """The core's device kind when ``tensor`` is reduced where it lies (CUDA: NCCL, by the whole job's group or a
    process set's own), None for host memory."""
    if tensor.is_sparse:
        return None
    kind = "cpu" if tensor.is_cpu else tensor.device.type  # is_cpu: a flag; .device builds an object
    return device_key(kind, common.core().settings().device_backend)


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {}
_STRIDED = torch.strided
# dtypes whose ``tensor.numpy()`` is the core's array as it is (bfloat16 and bool need a view: ``_np_view``)
_NUMPY_SHARED = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
                           torch.int32, torch.int64})
_device_setting: list[Any] = [None, None]  # (the settings object, whether CPU tensors take the device path)


# numpy views of small contiguous CPU tensors that ``allreduce_`` handed over, by ``id(tensor)``: (view, data_ptr,
# shape, stride, dtype). ``tensor.numpy()`` costs more than checking that the tensor still has the address and
# layout a kept view was made for. A kept view needs no weak reference to its tensor: it keeps its memory alive
# (as ``numpy()``'s does), so no other memory can take that address while it is kept, and a tensor (this one, or
# another that took its id) with the same address, dtype, shape and strides has exactly the view's elements. The
# kept memory is bounded: at most ``_VIEWS_MAX`` views of up to ``_VIEW_MAX_BYTES`` each (emptied when full).
_VIEWS: dict[int, tuple[np.ndarray, int, torch.Size, tuple[int, ...], torch.dtype]] = {}
_SEEN: dict[int, Any] = {}  # weak references to tensors seen once, by ``id(tensor)``
_VIEWS_MAX = 512
_VIEW_MAX_BYTES = 1 << 14  # a larger tensor's round costs far more than its ``numpy()``


def _host_view(tensor: torch.Tensor) -> np.ndarray | None:
    """``tensor.numpy()`` when that is the core's array for ``tensor`` as it is (a contiguous strided CPU tensor
    of a dtype numpy shares, not requiring grad), else None; a small tensor's view is kept and reused while the
    tensor keeps its address, dtype, shape and strides (moved, resized or re-strided in place: a new view), from
    the tensor's second call on (a tensor made for one call is not kept alive)."""
    key = id(tensor)
    entry = _VIEWS.get(key)
    if entry is not None:
        arr, ptr, shape, stride, dtype = entry
        try:  # what took a dead tensor's id may have no data_ptr (sparse, meta, not a tensor): staged as before
            same = (tensor.data_ptr() == ptr and tensor.dtype is dtype and tensor.shape == shape
                    and tensor.stride() == stride)
        except (AttributeError, RuntimeError, TypeError, NotImplementedError):
            same = False
        if same:  # requires_grad set since: ``_Staged`` would hand over a view of this same memory
            return arr
    if not (tensor.is_cpu and tensor.layout is _STRIDED and tensor.dtype in _NUMPY_SHARED
            and not tensor.requires_grad and tensor.is_contiguous()):
        return None
    arr = tensor.numpy()
    if entry is not None:
        _VIEWS.pop(key, None)  # its memory need not stay kept (pop: another thread may have emptied the table)
    if 0 < arr.nbytes <= _VIEW_MAX_BYTES:
        seen = _SEEN.get(key)
        if seen is not None and seen() is tensor:  # its second call: a tensor used again, worth a kept view
            _SEEN.pop(key, None)
            if len(_VIEWS) >= _VIEWS_MAX:
                _VIEWS.clear()
            _VIEWS[key] = (arr, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
        else:  # a tensor made for one call keeps nothing alive and costs only a weak reference
            if len(_SEEN) >= _VIEWS_MAX:
                _SEEN.clear()
            _SEEN[key] = weakref.ref(tensor)
    return arr


def _cpu_on_device(settings: Any) -> bool:
    """Whether CPU tensors take the device path (``SPARK_HVD_DEVICE_BACKEND=gloo``), for the job's settings."""
    if _device_setting[0] is not settings:
        _device_setting[:] = [settings, device_key("cpu", settings.device_backend) is not None]
    return bool(_device_setting[1])


def _ready_event(tensor: torch.Tensor) -> Any:
    """An event recorded now on the current stream of ``tensor``'s GPU: the engine's stream waits for it before
    reading the tensor (everything queued so far that writes it is then done). None for a CPU tensor."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    if tensor.get_device() == torch.cuda.current_device():
        event.record()  # the current stream (building the stream object costs more than the record)
    else:
        event.record(torch.cuda.current_stream(tensor.device))
    return event


def _device_buffer(tensor: torch.Tensor, key: str, ready: Any = None) -> DeviceBuffer:
    """``tensor`` (contiguous) as the engine carries a device tensor, with ``ready`` (else a new event) marking
    its data ready."""
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.dtype == torch.bfloat16:
        dtype, bf16 = np.dtype(np.uint16), True
    else:
        dtype = _NUMPY_DTYPES.get(t.dtype)
        if dtype is None:
            dtype = _NUMPY_DTYPES[t.dtype] = torch.empty(0, dtype=t.dtype).numpy().dtype
        bf16 = False
    return DeviceBuffer(t, key, dtype, tuple(t.shape), bf16, ready if ready is not None else _ready_event(t))


def _is_global(process_set: ProcessSet | None) -> bool:
    return process_set is None or process_set.process_set_id == 0


class _Staged:
    """A buffer the core works on for ``tensor``: the tensor's own memory (host memory: a numpy view; a CUDA
    tensor: the tensor itself), or a contiguous copy written back later."""

    __slots__ = ("tensor", "host", "array", "bf16")

    def __init__(self, tensor: torch.Tensor, need_input: bool = True, ready: Any = None) -> None:
        self.tensor = tensor
        key = _device_key(tensor)
        if key is not None:
            src = tensor if tensor.is_contiguous() else tensor.detach().contiguous()
            self.host = None if src is tensor else src
            self.array: Any = _device_buffer(src, key, ready)
            self.bf16 = self.array.bfloat16
            return
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

    def __call__(self) -> Any:
        """The result, as :meth:`wait` (Horovod's ``sparse_allreduce_async`` hands out a callable)."""
        return self.wait()

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
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place allreduce of ``tensor``; :func:`synchronize` returns ``tensor`` reduced."""
    common.require_init("allreduce_async_()")
    rop = common.resolve_op(op, average)
    staged = _Staged(tensor)
    h = common.core().allreduce_async(staged.array, name=name, op=rop, prescale=prescale_factor,
                                      postscale=postscale_factor, bfloat16=staged.bf16, process_set=process_set)
    return Handle(h, lambda _: staged.write_back(), name=name)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce of a copy of ``tensor``; :func:`synchronize` returns the new reduced tensor."""
    common.require_init("allreduce_async()")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_async_(out, average=average, name=name, op=op, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, process_set=process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Allreduce ``tensor`` in place across ranks and return it."""
    # the blocking call runs the round in this thread (``Engine.allreduce``, as ``spark_hvd.core.allreduce`` does);
    # a contiguous CPU tensor of a dtype numpy shares is handed over as its own numpy view (what ``_Staged`` makes
    # of it, with fewer checks on the path of every call)
    engine = common.core().get_engine(process_set, "allreduce_()")
    rop = op if average is None and op.__class__ is ReduceOp else common.resolve_op(op, average)
    arr = None if _cpu_on_device(engine.settings) else _host_view(tensor)
    if arr is not None:
        engine.allreduce(arr, name, op=rop, prescale=prescale_factor, postscale=postscale_factor)
        return tensor
    staged = _Staged(tensor)
    engine.allreduce(staged.array, name, op=rop, prescale=prescale_factor, postscale=postscale_factor,
                     bfloat16=staged.bf16)
    return staged.write_back()


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """Start one allreduce of several tensors, in place; :func:`synchronize` returns the list."""
    common.require_init("grouped_allreduce_async_()")
    rop = common.resolve_op(op, average)
    tensors = list(tensors)
    if not tensors:
        return Handle(None, lambda _: [], name=name, done=True)
    ready = _ready_event(tensors[0])  # one event marks every tensor of the group ready
    staged = [_Staged(t, ready=ready) for t in tensors]
    if len({isinstance(s.array, DeviceBuffer) for s in staged}) > 1:
        raise ValueError(f"grouped_allreduce{f' {name!r}' if name else ''} mixes CUDA and host-memory tensors in one "
                         f"group (devices: {sorted({str(t.device) for t in tensors})}); move them to one device")
    bf16 = {s.bf16 for s in staged}
    if len(bf16) > 1:
        raise ValueError("grouped_allreduce cannot mix bfloat16 with other dtypes in one group")
    names = None if name is None else [f"{name}.{i}" for i in range(len(tensors))]
    h = common.core().grouped_allreduce_async([s.array for s in staged], names=names, op=rop,
                                              prescale=prescale_factor, postscale=postscale_factor,
                                              bfloat16=bf16.pop(), process_set=process_set)
    return Handle(h, lambda _: [s.write_back() for s in staged], name=name)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start one allreduce of copies of several tensors; :func:`synchronize` returns the new tensors."""
    common.require_init("grouped_allreduce_async()")
    outs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(outs, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: ReduceOp | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce several tensors in place as one collective."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# --------------------------------------------------------------------------------------------------------------
# allgather, broadcast, alltoall, reducescatter
# --------------------------------------------------------------------------------------------------------------

def _host_array(tensor: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A contiguous host numpy array with ``tensor``'s data (a view when possible)."""
    if _direct_view_ok(tensor):
        return _np_view(tensor)
    return _np_view(tensor.detach().to("cpu").contiguous())


def _allgather_start(tensor: torch.Tensor, name: str | None, process_set: ProcessSet = global_process_set
                     ) -> tuple[Any, Callable[[Any], torch.Tensor]]:
    if tensor.dim() == 0:
        raise ValueError(f"allgather of {name or 'a tensor'} needs a tensor with at least one dimension, got a 0-d "
                         "tensor (use tensor.reshape(1))")
    key = _device_key(tensor)
    if key is not None:
        return (common.core().allgather_async(_device_buffer(tensor.contiguous(), key), name=name,
                                              process_set=process_set), lambda res: res)
    arr, _ = _host_array(tensor)
    dtype, device = tensor.dtype, tensor.device
    return (common.core().allgather_async(arr, name=name, process_set=process_set),
            lambda res: _from_numpy(res, dtype, device))


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
                    ) -> Handle:
    """Start an allgather; :func:`synchronize` returns every rank's tensor concatenated on dimension 0."""
    common.require_init("allgather_async()")
    h, finish = _allgather_start(tensor, name, process_set)
    return Handle(h, finish, name=name)


def _member_names(name: str | None, count: int) -> list[str | None]:
    return [None] * count if name is None else [f"{name}.{i}" for i in range(count)]


def _grouped(started: list[tuple[Any, Callable[[Any], Any]]], name: str | None,
             then: Callable[[list[Any]], Any] | None = None) -> Handle:
    """One handle over several started collectives; its result is the list of their results (``then`` of it)."""
    from spark_hvd.core.engine.engine import GroupHandle

    group = GroupHandle(name or "group", [h for h, _ in started])
    finishes = [f for _, f in started]

    def finish(results: list[Any]) -> Any:
        out = [f(r) for f, r in zip(finishes, results, strict=True)]
        return then(out) if then is not None else out
    return Handle(group, finish, name=name)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather of each of ``tensors`` together; :func:`synchronize` returns the list of results."""
    common.require_init("grouped_allgather_async()")
    tensors = list(tensors)
    return _grouped([_allgather_start(t, n, process_set) for t, n in zip(tensors, _member_names(name, len(tensors)),
                                                                         strict=True)], name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place broadcast of root's ``tensor``; :func:`synchronize` returns ``tensor``."""
    common.require_init("broadcast_async_()")
    staged = _Staged(tensor)
    h = common.core().broadcast_async(staged.array, root_rank, name=name, process_set=process_set)
    return Handle(h, lambda _: staged.write_back(), name=name)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start a broadcast into a copy of ``tensor``; :func:`synchronize` returns the new tensor."""
    common.require_init("broadcast_async()")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return broadcast_async_(out, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with root's values, in place, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def _splits_list(splits: Any) -> list[int] | None:
    """``splits`` as a list of ints; a float tensor or a non-integral number is an error, as in Horovod."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise ValueError(f"alltoall splits must be an integer tensor (torch.int32 in Horovod), got {splits.dtype}")
        return [int(x) for x in splits.reshape(-1).tolist()]
    out = []
    for x in splits:
        if isinstance(x, bool) or not float(x).is_integer():
            raise ValueError(f"alltoall splits must be integers, got {x!r}")
        out.append(int(x))
    return out


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall; :func:`synchronize` returns ``(output, received_splits)``."""
    common.require_init("alltoall_async()")
    key = _device_key(tensor)
    if key is not None:
        h = common.core().alltoall_async(_device_buffer(tensor.contiguous(), key), splits=_splits_list(splits),
                                         name=name, process_set=process_set)
        return Handle(h, lambda res: (res[0], torch.tensor(list(res[1]), dtype=torch.int32)), name=name)
    arr, _ = _host_array(tensor)
    dtype, device = tensor.dtype, tensor.device
    h = common.core().alltoall_async(arr, splits=_splits_list(splits), name=name, process_set=process_set)

    def finish(res: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, rsplits = res
        return _from_numpy(out, dtype, device), torch.tensor(list(rsplits), dtype=torch.int32)
    return Handle(h, finish, name=name)


def _reducescatter_start(tensor: torch.Tensor, name: str | None, op: ReduceOp, prescale: float,
                         postscale: float, process_set: ProcessSet = global_process_set
                         ) -> tuple[Any, Callable[[Any], torch.Tensor]]:
    if tensor.dim() == 0:
        raise ValueError(f"reducescatter of {name or 'a tensor'} needs a tensor with at least one dimension, got a "
                         "0-d tensor")
    key = _device_key(tensor)
    if key is not None:  # the device group reduces bfloat16 in float32 and never writes the input
        h = common.core().reducescatter_async(_device_buffer(tensor.contiguous(), key), op=op, name=name,
                                              prescale=prescale, postscale=postscale, process_set=process_set)
        return h, lambda res: res
    dtype, device = tensor.dtype, tensor.device
    src = tensor.detach()
    if dtype == torch.bfloat16:
        src = src.float()  # the core's reducescatter has no bfloat16 mode: reduce in float32, round at the end
    arr = _np_view(src.to("cpu").contiguous())[0].copy()  # the core may reduce in place: keep the input intact
    out_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    h = common.core().reducescatter_async(arr, op=op, name=name, prescale=prescale, postscale=postscale,
                                          process_set=process_set)
    return h, lambda res: _from_numpy(res, out_dtype, device).to(dtype)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None,
                        average: bool | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start a reducescatter; :func:`synchronize` returns this rank's part of the reduced tensor.

    ``prescale_factor`` multiplies every rank's input before the reduction, ``postscale_factor`` the result."""
    common.require_init("reducescatter_async()")
    h, finish = _reducescatter_start(tensor, name, common.resolve_op(op, average), prescale_factor,
                                     postscale_factor, process_set)
    return Handle(h, finish, name=name)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | None = None, average: bool | None = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set) -> Handle:
    """Start a reducescatter of each of ``tensors`` together; :func:`synchronize` returns the list of parts."""
    common.require_init("grouped_reducescatter_async()")
    rop = common.resolve_op(op, average)
    tensors = list(tensors)
    return _grouped([_reducescatter_start(t, n, rop, prescale_factor, postscale_factor, process_set)
                     for t, n in zip(tensors, _member_names(name, len(tensors)), strict=True)], name)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None,
                           process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce of a sparse COO tensor as Horovod does it: every rank's indices and values are
    allgathered; :func:`synchronize` returns the sparse sum (``Sum``) or average (``Average``, the default),
    uncoalesced (duplicate indices add up when it is coalesced or used)."""
    common.require_init("sparse_allreduce_async()")
    rop = common.resolve_op(op)
    if rop not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"sparse_allreduce supports op=Average or op=Sum, got {rop}")
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async expects a sparse COO tensor; use allreduce_async for dense ones")
    t = tensor.detach().coalesce()
    names = _member_names(name, 2)
    started = [_allgather_start(t.indices().t().contiguous(), names[0], process_set),
               _allgather_start(t.values().contiguous(), names[1], process_set)]
    shape, scale = t.shape, (1.0 / set_size(process_set) if rop is ReduceOp.AVERAGE else 1.0)

    def to_sparse(results: list[torch.Tensor]) -> torch.Tensor:
        indices, values = results
        return torch.sparse_coo_tensor(indices.t(), values * scale if scale != 1.0 else values, shape)
    return _grouped(started, name, to_sparse)
