"""Horovod's MXNet training wrappers: ``DistributedOptimizer`` (an ``mx.optimizer.Optimizer``) and
``DistributedTrainer`` (a Gluon ``Trainer``), both averaging gradients over the core's engine before the update.

Averaging: the core's ``Average`` with ``prescale = 1 / gradient_predivide_factor`` and ``postscale =
gradient_predivide_factor`` (``_binding_common.gradient_scales``), so the sum happens on gradients divided by the
factor and the result is the plain average (Horovod's semantics). ``DistributedTrainer`` keeps its gradients in one
flat buffer per dtype (``spark_hvd.mxnet.flat_grads``) and reduces it with one blocking allreduce per step.
``DistributedOptimizer``, and the trainer where a buffer cannot hold the gradients, submit every gradient of a call
before waiting for any, so the engine fuses them; without groups each goes as soon as MXNet's queued reads and
writes of it are done (last parameter first), overlapping the reduction of the first with the backward pass of the
rest. ``num_groups`` > 0 splits them into that many named groups, as Horovod does (``<first>:<last>`` names), each
submitted whole.
"""

from __future__ import annotations

import logging
import pickle
import warnings
from collections.abc import Sequence
from typing import Any

import mxnet as mx

from spark_hvd import _binding_common as common
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.mxnet import mpi_ops, zero
from spark_hvd.mxnet import ndarray as nda
from spark_hvd.mxnet.compression import Compression, Compressor
from spark_hvd.mxnet.flat_grads import FlatGrads

log = logging.getLogger(__name__)


def split_groups(items: Sequence[Any], num_groups: int) -> list[list[Any]]:
    """``items`` split into ``num_groups`` consecutive groups whose lengths differ by at most one (the first
    ``len % num_groups`` are longer); empty groups are left out."""
    n = max(1, min(num_groups, len(items)))
    per, extra = divmod(len(items), n)
    out, at = [], 0
    for i in range(n):
        step = per + (1 if i < extra else 0)
        out.append(list(items[at:at + step]))
        at += step
    return [g for g in out if g]


def _allreduce_grads(grads: list[Any], names: list[str], num_groups: int, predivide: float,
                     process_set: ProcessSet) -> None:
    """Average ``grads`` (host NDArrays, in the parameters' order) in place across ``process_set``, then wait.

    Without groups each gradient is submitted as soon as MXNet's queued reads and writes of it are done, last
    parameter first (the order backward produces them), so the engine reduces the first ones while MXNet computes
    the rest. With
    ``num_groups`` > 0, Horovod's groups: one submission per group (per dtype within a group) after MXNet's queued
    operators are done."""
    prescale, postscale = common.gradient_scales(ReduceOp.AVERAGE, predivide)
    if num_groups <= 0:
        mpi_ops.allreduce_async_inplace(grads[::-1], names[::-1], ReduceOp.AVERAGE, prescale, postscale,
                                        process_set, as_ready=True)()
        return
    waits = []
    for group in split_groups(list(zip(grads, names, strict=True)), num_groups):
        by_dtype: dict[Any, list[tuple[Any, str]]] = {}
        for g, n in group:
            by_dtype.setdefault(g.dtype, []).append((g, n))
        for entries in by_dtype.values():
            ts = [g for g, _ in entries]
            base = f"{entries[0][1]}:{entries[-1][1]}"
            waits.append(mpi_ops.allreduce_async_inplace(ts, [f"{base}.{i}" for i in range(len(ts))],
                                                         ReduceOp.AVERAGE, prescale, postscale, process_set))
    for wait in waits:
        wait()


class DistributedOptimizer(mx.optimizer.Optimizer):
    """An MXNet optimizer that averages each gradient across the ranks (of ``process_set``) before ``optimizer``
    updates the weight. Use it with ``mx.gluon.Trainer(..., kvstore=None)`` or ``Module.fit(kvstore=None)``.

    Attributes that are not its own are read from and written to the wrapped optimizer (a Trainer sets
    ``rescale_grad`` on the optimizer it holds: the wrapped one must see it).
    """

    _OWN = frozenset({"_optimizer", "_gradient_predivide_factor", "_num_groups", "_process_set"})

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set) -> None:
        common.gradient_scales(ReduceOp.AVERAGE, gradient_predivide_factor)  # checks the factor
        if num_groups < 0:
            raise ValueError(f"num_groups must be >= 0, got {num_groups}")
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_gradient_predivide_factor", float(gradient_predivide_factor))
        object.__setattr__(self, "_num_groups", int(num_groups))
        object.__setattr__(self, "_process_set", process_set)

    def __getattr__(self, item: str) -> Any:
        if item in DistributedOptimizer._OWN:
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, key: str, value: Any) -> None:
        if key in DistributedOptimizer._OWN:
            object.__setattr__(self, key, value)
        else:
            setattr(self._optimizer, key, value)

    def __getstate__(self) -> dict[str, Any]:
        """The wrapper's own fields (``Trainer.save_states`` pickles the optimizer; the wrapped one pickles itself)."""
        return {k: self.__dict__[k] for k in DistributedOptimizer._OWN}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def create_state(self, index: Any, weight: Any) -> Any:
        """The wrapped optimizer's state for ``weight``."""
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index: Any, weight: Any) -> Any:
        """The wrapped optimizer's state for ``weight`` (with a float32 master copy of a float16 one)."""
        return self._optimizer.create_state_multi_precision(index, weight)

    def _reduce(self, index: Any, grad: Any) -> None:
        ps = self._process_set
        if not ps.included() or common.set_size(ps) == 1:
            return
        common.require_init("DistributedOptimizer.update()")
        if isinstance(index, (tuple, list)):
            grads, names = list(grad), [str(i) for i in index]
        else:
            grads, names = [grad], [str(index)]
        _allreduce_grads(grads, names, self._num_groups, self._gradient_predivide_factor, ps)

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Average ``grad`` (one NDArray, or a list with ``index`` a list) across ranks, then update."""
        self._reduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """:meth:`update` for optimizers keeping float32 master weights of float16 ones."""
        self._reduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr: float) -> None:
        """Set the wrapped optimizer's learning rate."""
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: dict[Any, float]) -> None:
        """Set the wrapped optimizer's per-parameter learning-rate multipliers."""
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict[Any, float]) -> None:
        """Set the wrapped optimizer's per-parameter weight-decay multipliers."""
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A Gluon ``Trainer`` whose ``step`` averages the gradients across the ranks (of ``process_set``) over the
    core's engine instead of a kvstore, then updates as ``Trainer`` does.

    The parameters' gradients become slices of one flat NDArray per dtype (``spark_hvd.mxnet.flat_grads``: built
    here when the parameters are initialised, else at the first step), and a step reduces each buffer in place with
    one allreduce, every rank updating every weight; with ``num_groups`` > 0, or where a buffer cannot hold them,
    the gradients go one by one. With ``sharded_update=True``, where that is exact (one buffer, SGD or Adam, dense
    host weights: ``spark_hvd.mxnet.zero``), a step shards the update instead (ZeRO stage 1): the buffer is
    reduce-scattered, each rank updates its 1/N of the weights with its 1/N of the optimizer state, and the
    weights are allgathered (elsewhere the allreduce path, with a debug log saying why). It is not the default:
    on the core's transports measured (docs/mxnet.md) its reduce-scatter and allgather cost more than the
    allreduce, more than half the update saves.

    With the sharded update, ``param.grad()`` after a step holds the average only in this rank's shard (the rest
    is this rank's own gradient), and ``save_states`` is a collective: every rank of the set calls it (the states
    are gathered; each rank writes the file it names, in Gluon's format). ``allreduce_grads()`` / ``update()``
    called apart leave the sharded update for good (also a collective, at the first of them).

    Args:
        params: the parameters to train (``net.collect_params()``, a dict, or a list), in the same order on every
            rank (they are named by position).
        optimizer: an optimizer name (``"sgd"``) or an ``mx.optimizer.Optimizer`` (a ``DistributedOptimizer`` is
            unwrapped, with a warning: the trainer reduces the gradients itself).
        optimizer_params: the optimizer's keyword arguments when ``optimizer`` is a name.
        compression: ``Compression.fp16`` sends float gradients as float16.
        gradient_predivide_factor: divide gradients by this before the sum and multiply after (the result is the
            average either way); keeps float16 sums in range on large jobs.
        prefix: prepended to the collectives' names; give each trainer of one program its own.
        num_groups: > 0 splits the gradients into this many named groups (Horovod's option), each gradient in its
            own array (no flat buffer).
        process_set: average over the ranks of this process set only.
        sharded_update: shard the update across the ranks where it is exact (see above).
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: dict[str, Any] | None = None,
                 compression: type[Compressor] = Compression.none, gradient_predivide_factor: float = 1.0,
                 prefix: str | None = None, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set, sharded_update: bool = False) -> None:
        common.gradient_scales(ReduceOp.AVERAGE, gradient_predivide_factor)  # checks the factor
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"DistributedTrainer: prefix must be a str, got {type(prefix).__name__}")
        if num_groups < 0:
            raise ValueError(f"num_groups must be >= 0, got {num_groups}")
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer reduces the gradients itself: it takes a plain optimizer, and the "
                          "DistributedOptimizer given was unwrapped", stacklevel=2)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._compression = compression
        self._gradient_predivide_factor = float(gradient_predivide_factor)
        self._prefix = prefix or ""
        self._num_groups = int(num_groups)
        self._process_set = process_set
        self._fuse = True
        self._flat: FlatGrads | None = None
        self._shard_mode = bool(sharded_update)
        self._zero: zero.ShardedUpdate | None = None
        self._unsharded_why: str | None = None
        params = [p for p in self._params if p.grad_req != "null"]
        if (num_groups == 0 and all(p._grad for p in params) and common.is_initialized() and process_set.included()
                and common.set_size(process_set) > 1):
            # built now, before a backward binds the gradient arrays (FlatGrads' docstring); else at the first step
            # that reduces (none in a job of one: the gradients stay Gluon's)
            self._flat = FlatGrads(params)

    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """``Trainer.step``; with the sharded update: reduce-scatter, update this rank's shard, allgather."""
        if not self._shard_mode:
            super().step(batch_size, ignore_stale_grad)
            return
        self._check_and_rescale_grad(self._scale / batch_size)
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()
        sharded = self._sharded()
        if sharded is None:  # Gluon's own step (what it did above again, then the allreduce path)
            super().step(batch_size, ignore_stale_grad)
            return
        prescale, postscale = common.gradient_scales(ReduceOp.AVERAGE, self._gradient_predivide_factor)
        sharded.step(prescale, postscale, ignore_stale_grad)

    def _not_sharded(self, why: str) -> None:
        if why != self._unsharded_why:
            self._unsharded_why = why
            log.debug("DistributedTrainer %r: the allreduce path, not the sharded update: %s", self._prefix, why)

    def _sharded(self) -> zero.ShardedUpdate | None:
        """This step's sharded update, or None for the allreduce path (building the flat buffer as
        ``_allreduce_grads`` would, and leaving a sharded update whose buffer is gone)."""
        ps = self._process_set
        if not self._shard_mode:
            return None
        if not ps.included() or common.set_size(ps) == 1:
            self._not_sharded("a job (process set) of one rank")
            return None
        if self._num_groups > 0 or self._compression is not Compression.none:
            self._not_sharded("num_groups > 0" if self._num_groups > 0 else "compression")
            return None
        common.require_init("DistributedTrainer.step()")
        params = [p for p in self._params if p.grad_req != "null"]
        flat = self._flat
        if flat is None or not flat.current(params):
            self._leave_sharded()
            if not self._fuse:
                self._not_sharded("the gradients are reduced one by one (a static_shape block)")
                return None
            flat = self._flat = FlatGrads(params)
        elif not flat.verify():
            self._leave_sharded()
            self._fuse, self._flat = False, None
            self._not_sharded("a static_shape block writes the gradient arrays it was bound to")
            return None
        if self._zero is not None and self._zero.flat is flat:
            return self._zero
        why = zero.why_not(self, params, flat)
        if why is not None:
            self._not_sharded(why)
            return None
        self._zero = zero.ShardedUpdate(self, params, flat, ps)
        updater = self._updaters[0]
        self._zero.load_states(updater.states)  # states made (or loaded) before: this rank's shard of them
        updater.states, updater.states_synced = {}, {}
        return self._zero

    def _leave_sharded(self) -> None:
        """Back to Gluon's updater with every parameter's whole state (a collective)."""
        if self._zero is None:
            return
        states = self._zero.gather_states()
        self._zero = None
        updater = self._updaters[0]
        updater.states, updater.states_synced = states, dict.fromkeys(states, True)

    def allreduce_grads(self) -> None:
        """``Trainer.allreduce_grads``: averages every gradient in place (and leaves the sharded update)."""
        self._shard_mode = False
        self._leave_sharded()
        super().allreduce_grads()

    def update(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """``Trainer.update`` (leaves the sharded update)."""
        self._shard_mode = False
        self._leave_sharded()
        super().update(batch_size, ignore_stale_grad)

    def save_states(self, fname: str) -> None:
        """``Trainer.save_states``; with the sharded update a collective (every rank gathers the whole states and
        writes ``fname``), in Gluon's format."""
        if self._zero is None:
            super().save_states(fname)
            return
        states = self._zero.gather_states()
        with open(fname, "wb") as f:
            f.write(pickle.dumps((states, self._optimizer)))

    def load_states(self, fname: str) -> None:
        """``Trainer.load_states`` (a file of any ``Trainer``); with the sharded update this rank keeps its shard."""
        super().load_states(fname)
        if self._zero is not None:
            updater = self._updaters[0]
            self._zero.load_states(updater.states)
            updater.states, updater.states_synced = {}, {}

    def _allreduce_grads(self) -> None:
        ps = self._process_set
        if not ps.included() or common.set_size(ps) == 1:
            return
        common.require_init("DistributedTrainer.step()")
        if self._num_groups > 0 or not self._fuse:
            self._allreduce_each()
            return
        params = [p for p in self._params if p.grad_req != "null"]
        flat = self._flat
        if flat is None or not flat.current(params):
            flat = self._flat = FlatGrads(params)  # this step's gradients copied in; verified at the next one
        elif not flat.verify():  # a static_shape block writes the former arrays: each gradient on its own
            self._fuse, self._flat = False, None
            self._allreduce_each()
            return
        prescale, postscale = common.gradient_scales(ReduceOp.AVERAGE, self._gradient_predivide_factor)
        if len(flat.buffers) == 1 and not flat.rest and self._compression is Compression.none:
            # the steady path: every gradient in one buffer, reduced in place by one blocking allreduce (the engine
            # runs it in this thread) once MXNet's queued operators (backward) are done
            nda.wait_all()
            common.core().allreduce(flat.views[0], name=f"{self._prefix}trainer.grads", op=ReduceOp.AVERAGE,
                                    prescale=prescale, postscale=postscale, process_set=ps)
            return
        tensors = [*flat.buffers, *(p.list_grad()[0] for p in flat.rest)]
        if not tensors:
            return
        names = [f"{self._prefix}trainer.grads.{i}" for i in range(len(flat.buffers))]
        names += [f"{self._prefix}{self._params.index(p)}" for p in flat.rest]
        sent, contexts = zip(*(self._compression.compress(t) for t in tensors), strict=True)
        mpi_ops.allreduce_inplace(list(sent), names, ReduceOp.AVERAGE, prescale, postscale, ps)
        targets = [[b] for b in flat.buffers] + [p.list_grad() for p in flat.rest]
        for t, s, ctx, outs in zip(tensors, sent, contexts, targets, strict=True):
            if s is not t:
                value = self._compression.decompress(s, ctx)
                for out in outs:
                    out[:] = value

    def _allreduce_each(self) -> None:
        """Horovod's ``num_groups``: the gradients in that many named groups of their own arrays."""
        grads, names, restore = [], [], []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grad = param.list_grad()[0]
            sent, ctx = self._compression.compress(grad)
            grads.append(sent)
            names.append(f"{self._prefix}{i}")
            if sent is not grad:
                restore.append((param, sent, ctx))
        if grads:
            _allreduce_grads(grads, names, self._num_groups, self._gradient_predivide_factor, self._process_set)
        for param, sent, ctx in restore:
            value = self._compression.decompress(sent, ctx)
            for g in param.list_grad():
                g[:] = value
