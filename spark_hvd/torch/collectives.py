"""The blocking, differentiable collectives of ``spark_hvd.torch``, with Horovod's gradients.

Each returns a new tensor. When an input requires a gradient (and grad mode is on) the call goes through a
``torch.autograd.Function`` whose backward is Horovod's, so a script migrated from Horovod gets the same
gradients:

============================  =========================================================================
forward                       backward (``g``: the gradient of this rank's output)
============================  =========================================================================
allreduce (Average / Sum)     the same allreduce of ``g`` (same op, prescale and postscale)
grouped_allreduce             the same, for every tensor of the group
allgather                     this rank's rows of the *average* over ranks of ``g``
grouped_allgather             the same, for every tensor of the group
broadcast                     on the root: the average over ranks of ``g``; elsewhere zeros
alltoall                      ``g`` sent back where it came from (alltoall with the received splits)
reducescatter                 allgather of ``g``, times ``size`` for Sum, times prescale and postscale
grouped_reducescatter         the same, for every tensor of the group
============================  =========================================================================

The allgather and broadcast gradients are averages, not sums: Horovod's convention (each rank's loss counts
``1/size``, as when gradients are averaged by ``DistributedOptimizer``); docs/migrating-from-horovod.md says more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from spark_hvd import _binding_common as common
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.torch import mpi_ops
from spark_hvd.torch.compression import Compression, Compressor


def _wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _row_offset(rows: int, process_set: ProcessSet) -> int:
    """The index of this rank's first row in an allgather of ``rows`` rows from every rank (of the set)."""
    counts = mpi_ops.synchronize(mpi_ops.allgather_async(torch.tensor([rows], dtype=torch.int64),
                                                         process_set=process_set))
    return int(counts[:mpi_ops.set_rank(process_set)].sum())


def _submit_grouped(submit: Callable[..., mpi_ops.Handle], tensors: Sequence[torch.Tensor], name: str | None,
                    op: ReduceOp, prescale: float, postscale: float, process_set: ProcessSet) -> list[torch.Tensor]:
    """``submit`` (``mpi_ops.grouped_allreduce_async`` or ``grouped_reducescatter_async``) of ``tensors``, waited
    for."""
    return list(mpi_ops.synchronize(submit(list(tensors), name=name, op=op, prescale_factor=prescale,
                                           postscale_factor=postscale, process_set=process_set)))


def _grouped_reduction(function: type[torch.autograd.Function], submit: Callable[..., mpi_ops.Handle],
                       tensors: Sequence[torch.Tensor], compression: type[Compressor], name: str | None,
                       op: ReduceOp, prescale: float, postscale: float, process_set: ProcessSet) -> list[torch.Tensor]:
    """A grouped allreduce or reducescatter: ``tensors`` compressed, reduced through the autograd ``function``
    where a gradient is wanted (else by ``submit`` alone), and the results decompressed."""
    pairs = [compression.compress(t) for t in tensors]
    compressed = [p[0] for p in pairs]
    if compressed and _wants_grad(*compressed):
        outs = list(function.apply(name, op, prescale, postscale, process_set, *compressed))
    else:
        outs = _submit_grouped(submit, compressed, name, op, prescale, postscale, process_set)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs, strict=True)]


# --------------------------------------------------------------------------------------------------------------
# allreduce
# --------------------------------------------------------------------------------------------------------------

class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, prescale: float,
                postscale: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale, ctx.ps = op, prescale, postscale, process_set
        return mpi_ops.synchronize(mpi_ops.allreduce_async(tensor, name=name, op=op, prescale_factor=prescale,
                                                           postscale_factor=postscale, process_set=process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise RuntimeError(f"allreduce with op {ctx.op.name.title()} is not differentiable; use Average or Sum")
        out = mpi_ops.synchronize(mpi_ops.allreduce_async(grad, op=ctx.op, prescale_factor=ctx.prescale,
                                                          postscale_factor=ctx.postscale, process_set=ctx.ps))
        return out, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (default: average) and return the result as a new tensor.

    ``compression=Compression.fp16`` sends floating-point data as float16. Differentiable.
    """
    common.require_init("allreduce()")
    rop = common.resolve_op(op, average)
    compressed, cctx = compression.compress(tensor)
    if _wants_grad(compressed):
        out = _Allreduce.apply(compressed, name, rop, prescale_factor, postscale_factor, process_set)
    else:  # a blocking call: in place on a copy, which runs the round in this thread (``Engine.allreduce``)
        out = mpi_ops.allreduce_(compressed.detach().clone(memory_format=torch.contiguous_format), name=name, op=rop,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                 process_set=process_set)
    return compression.decompress(out, cctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.prescale, ctx.postscale, ctx.ps = op, prescale, postscale, process_set
        return tuple(_submit_grouped(mpi_ops.grouped_allreduce_async, tensors, name, op, prescale, postscale,
                                     process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        if ctx.op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise RuntimeError(f"grouped_allreduce with op {ctx.op.name.title()} is not differentiable")
        outs = _submit_grouped(mpi_ops.grouped_allreduce_async, grads, None, ctx.op, ctx.prescale, ctx.postscale,
                               ctx.ps)
        return (None, None, None, None, None, *outs)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce several tensors as one collective; returns new tensors. Differentiable."""
    common.require_init("grouped_allreduce()")
    return _grouped_reduction(_GroupedAllreduce, mpi_ops.grouped_allreduce_async, tensors, compression, name,
                              common.resolve_op(op, average), prescale_factor, postscale_factor, process_set)


# --------------------------------------------------------------------------------------------------------------
# allgather
# --------------------------------------------------------------------------------------------------------------

class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.ps = tensor.shape[0], process_set
        return mpi_ops.synchronize(mpi_ops.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = mpi_ops.synchronize(mpi_ops.allreduce_async(grad, op=ReduceOp.AVERAGE, process_set=ctx.ps))
        return averaged.narrow(0, _row_offset(ctx.rows, ctx.ps), ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated on dimension 0 (the first dimension may differ by rank).
    Differentiable."""
    common.require_init("allgather()")
    if _wants_grad(tensor):
        return _Allgather.apply(tensor, name, process_set)
    return mpi_ops.synchronize(mpi_ops.allgather_async(tensor, name, process_set))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.rows, ctx.ps = [t.shape[0] for t in tensors], process_set
        return tuple(mpi_ops.synchronize(mpi_ops.grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        averaged = mpi_ops.synchronize(mpi_ops.grouped_allreduce_async(list(grads), op=ReduceOp.AVERAGE,
                                                                       process_set=ctx.ps))
        counts = mpi_ops.synchronize(mpi_ops.allgather_async(torch.tensor([ctx.rows], dtype=torch.int64),
                                                             process_set=ctx.ps))
        offsets = counts[:mpi_ops.set_rank(ctx.ps)].sum(dim=0).tolist()
        return (None, None, *[g.narrow(0, int(o), n) for g, o, n in zip(averaged, offsets, ctx.rows, strict=True)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of several tensors submitted together; returns the list. Differentiable."""
    common.require_init("grouped_allgather()")
    tensors = list(tensors)
    if tensors and _wants_grad(*tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))
    return mpi_ops.synchronize(mpi_ops.grouped_allgather_async(tensors, name, process_set))


# --------------------------------------------------------------------------------------------------------------
# broadcast
# --------------------------------------------------------------------------------------------------------------

class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.ps = root_rank, process_set
        return mpi_ops.synchronize(mpi_ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = mpi_ops.synchronize(mpi_ops.allreduce_async(grad, op=ReduceOp.AVERAGE, process_set=ctx.ps))
        if mpi_ops.rank() != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Root's ``tensor``, as a new tensor on every rank. Differentiable."""
    common.require_init("broadcast()")
    if _wants_grad(tensor):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return mpi_ops.synchronize(mpi_ops.broadcast_async(tensor, root_rank, name, process_set))


# --------------------------------------------------------------------------------------------------------------
# alltoall
# --------------------------------------------------------------------------------------------------------------

class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = mpi_ops.synchronize(mpi_ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.ps = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _dead: Any) -> tuple:
        back, _ = mpi_ops.synchronize(mpi_ops.alltoall_async(grad.contiguous(), ctx.received, process_set=ctx.ps))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank i (an even split when None) and gather what others sent.

    Returns the received rows concatenated in rank order; with ``splits`` given, ``(output, received_splits)``
    as in Horovod. ``splits`` must hold integers (a float tensor is an error). Differentiable.
    """
    common.require_init("alltoall()")
    if _wants_grad(tensor):
        out, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        out, received = mpi_ops.synchronize(mpi_ops.alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, received)


# --------------------------------------------------------------------------------------------------------------
# reducescatter
# --------------------------------------------------------------------------------------------------------------

def _check_differentiable(op: ReduceOp) -> None:
    """A reducescatter that takes part in autograd reduces by Average or Sum (its backward: a scaled allgather)."""
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"reducescatter with op {op.name.title()} is not differentiable; use Average or Sum")


def _reducescatter_grad(grad: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                        process_set: ProcessSet) -> torch.Tensor:
    factor = (mpi_ops.set_size(process_set) if op is ReduceOp.SUM else 1) * prescale * postscale
    return grad * factor if factor != 1 else grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, prescale: float,
                postscale: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale, ctx.ps = op, prescale, postscale, process_set
        return mpi_ops.synchronize(mpi_ops.reducescatter_async(tensor, name, op, prescale_factor=prescale,
                                                               postscale_factor=postscale, process_set=process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        scaled = _reducescatter_grad(grad, ctx.op, ctx.prescale, ctx.postscale, ctx.ps)
        gathered = mpi_ops.synchronize(mpi_ops.allgather_async(scaled.contiguous(), process_set=ctx.ps))
        return gathered, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
                  average: bool | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (default: average) and return this rank's rows of the result (first dim
    split evenly, the first ``rows % size`` ranks getting one row more). Differentiable for Average and Sum."""
    common.require_init("reducescatter()")
    rop = common.resolve_op(op, average)
    compressed, cctx = compression.compress(tensor)
    if _wants_grad(compressed):
        _check_differentiable(rop)
        out = _Reducescatter.apply(compressed, name, rop, prescale_factor, postscale_factor, process_set)
    else:
        out = mpi_ops.synchronize(mpi_ops.reducescatter_async(compressed, name, rop, prescale_factor=prescale_factor,
                                                              postscale_factor=postscale_factor,
                                                              process_set=process_set))
    return compression.decompress(out, cctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        _check_differentiable(op)
        ctx.op, ctx.prescale, ctx.postscale, ctx.ps = op, prescale, postscale, process_set
        return tuple(_submit_grouped(mpi_ops.grouped_reducescatter_async, tensors, name, op, prescale, postscale,
                                     process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        scaled = [_reducescatter_grad(g, ctx.op, ctx.prescale, ctx.postscale, ctx.ps).contiguous() for g in grads]
        gathered = mpi_ops.synchronize(mpi_ops.grouped_allgather_async(scaled, process_set=ctx.ps))
        return (None, None, None, None, None, *gathered)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
                          average: bool | None = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`reducescatter` of several tensors submitted together; returns the list. Differentiable."""
    common.require_init("grouped_reducescatter()")
    return _grouped_reduction(_GroupedReducescatter, mpi_ops.grouped_reducescatter_async, tensors, compression,
                              name, common.resolve_op(op, average), prescale_factor, postscale_factor, process_set)
