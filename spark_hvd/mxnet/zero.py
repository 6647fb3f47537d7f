"""The sharded update of ``DistributedTrainer`` (ZeRO stage 1): each rank updates 1/N of the weights.

The allreduce path of ``DistributedTrainer`` averages the whole flat gradient buffer (``flat_grads``) on every rank
and every rank then runs the optimizer over every weight. Here the buffer is reduce-scattered instead: rank r gets
the average of its shard ``[lo, hi)`` of the buffer (the core's split: the first ``n % N`` ranks one element more),
updates the weights of that shard with its shard of the optimizer state, and the updated shards are allgathered
into every rank's weights. The bytes each rank sends are those of one ring allreduce (a reduce-scatter and an
allgather), the update is 1/N of it, and each rank keeps 1/N of the optimizer state.

A shard cuts across parameters: rank r's part of parameter i (a :class:`Segment`) is updated by the optimizer as
parameter i itself would be, with the same index ``i`` (so ``lr_mult``, ``wd_mult``, the update counts that a
learning-rate scheduler and Adam's bias correction read, ``clip_gradient`` and ``rescale_grad`` are the ones the
unsharded update uses) on a view of the parameter's own weights, a slice of the reduced gradient shard and a
state of the segment's length. That is exact for optimizers that update every element on its own
(:data:`ELEMENTWISE`); others keep the allreduce path.

The optimizer state is sharded, so :meth:`ShardedUpdate.gather_states` (a collective: every rank of the set calls
it) rebuilds the whole state of every parameter as Gluon's own ``Updater`` holds it; ``DistributedTrainer``
uses it to save states in Gluon's format (a file any ``Trainer`` loads) and to leave the sharded update.
:meth:`ShardedUpdate.load_states` takes a rank's shard of such whole states (no communication).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mxnet as mx
import numpy as np

from spark_hvd import _binding_common as common
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet
from spark_hvd.mxnet import ndarray as nda
from spark_hvd.mxnet.flat_grads import FlatGrads

log = logging.getLogger(__name__)

#: optimizers whose update of an element reads only that element's weight, gradient and state (and per-parameter
#: scalars: learning rate, weight decay, update count), so updating a slice of a parameter is exact
ELEMENTWISE = (mx.optimizer.SGD, mx.optimizer.Adam)


def shard_bounds(n: int, parts: int) -> list[int]:
    """The core's reducescatter split of ``n`` elements into ``parts`` (the first ``n % parts`` one longer)."""
    per, extra = divmod(n, parts)
    return [i * per + min(i, extra) for i in range(parts + 1)]


@dataclass(frozen=True)
class Segment:
    """Rank's part of one parameter: elements ``[start, stop)`` of the parameter (flattened), which are elements
    ``[start + offset, stop + offset)`` of the flat buffer and ``[shard_at, shard_at + stop - start)`` of the
    rank's shard."""

    index: int  # the parameter's index in the trainer (the optimizer's index)
    param: Any
    start: int
    stop: int
    shard_at: int


def why_not(trainer: Any, params: Sequence[Any], flat: FlatGrads | None) -> str | None:
    """Why the sharded update would not be exact (or possible) for this trainer and step, or None."""
    if int(mx.__version__.split(".")[0]) >= 2:
        return "MXNet 2's optimizer API (lists of indices) is not supported by the sharded update"
    opt = trainer._optimizer
    if type(opt) not in ELEMENTWISE:
        return (f"optimizer {type(opt).__name__} is not one known to update each element on its own "
                f"({', '.join(c.__name__ for c in ELEMENTWISE)})")
    if getattr(opt, "multi_precision", False):
        return "multi_precision keeps float32 master weights"
    if getattr(trainer, "_amp_loss_scaler", None) is not None:
        return "AMP's loss scaler skips steps on overflow"
    if flat is None or len(flat.buffers) != 1 or flat.rest:
        return "the gradients are not all in one flat buffer (several dtypes or contexts, sparse, GPU)"
    for p in params:
        data = p._data
        if data is None or len(data) != 1 or p._stype != "default" or data[0].context.device_type != "cpu":
            return f"parameter {p.name} is not one dense array in host memory"
    return None


def _leaves(state: Any) -> list[Any]:
    """The NDArrays of an optimizer state (None, an NDArray, or nested tuples / lists of them), in order."""
    if state is None:
        return []
    if isinstance(state, (tuple, list)):
        return [leaf for s in state for leaf in _leaves(s)]
    return [state]


def _rebuild(like: Any, leaves: list[Any]) -> Any:
    """``like``'s structure with its NDArrays replaced by ``leaves`` (consumed from the front)."""
    if like is None:
        return None
    if isinstance(like, (tuple, list)):
        return type(like)(_rebuild(s, leaves) for s in like)
    return leaves.pop(0)


class ShardedUpdate:
    """This rank's shard of the trainer's update: the segments, their optimizer states, and the step.

    Args:
        trainer: the ``DistributedTrainer`` (its optimizer, ``_params``, ``_prefix``).
        params: the trainable parameters, in the flat buffer's order.
        flat: the flat gradient buffer holding every gradient of ``params`` (one buffer, nothing in ``rest``).
        process_set: the ranks that share the update.
    """

    def __init__(self, trainer: Any, params: Sequence[Any], flat: FlatGrads, process_set: ProcessSet) -> None:
        self._trainer = trainer
        self.flat = flat
        self._ps = process_set
        self._size, self._rank = common.set_size(process_set), common.set_rank(process_set)
        index = {id(p): i for i, p in enumerate(trainer._params)}
        n = flat.buffers[0].size
        self.bounds = shard_bounds(n, self._size)
        lo, hi = self.bounds[self._rank], self.bounds[self._rank + 1]
        self.layout: list[tuple[int, Any, int, int]] = []  # (index, param, offset in the buffer, size)
        self.segments: list[Segment] = []
        at = 0
        for p in params:
            size = p._grad[0].size
            self.layout.append((index[id(p)], p, at, size))
            a, b = max(lo, at), min(hi, at + size)
            if a < b:
                self.segments.append(Segment(index[id(p)], p, a - at, b - at, a - lo))
            at += size
        self.states: dict[int, Any] = {}

    # -- the step ----------------------------------------------------------------------------------------------
    def step(self, prescale: float, postscale: float, ignore_stale_grad: bool) -> None:
        """Reduce-scatter the gradients, update this rank's segments, allgather the weights."""
        stale = self._check_fresh(ignore_stale_grad)
        prefix, ps = self._trainer._prefix, self._ps
        nda.wait_all()
        shard = common.core().reducescatter(self.flat.views[0], op=ReduceOp.AVERAGE, name=f"{prefix}trainer.shard",
                                            prescale=prescale, postscale=postscale, process_set=ps)
        grad = nda.to_ndarray(shard, self.flat.buffers[0])
        opt = self._trainer._optimizer
        with mx.autograd.pause():
            for seg in self.segments:
                if seg.index in stale:
                    continue
                weight = seg.param._data[0].reshape((-1,))[seg.start:seg.stop]
                if seg.index not in self.states:
                    self.states[seg.index] = opt.create_state_multi_precision(seg.index, weight)
                opt.update_multi_precision(seg.index, weight, grad[seg.shard_at:seg.shard_at + seg.stop - seg.start],
                                           self.states[seg.index])
        nda.wait_all()
        mine = np.empty(len(shard), dtype=shard.dtype)
        for seg in self.segments:
            view = nda.write_view(seg.param._data[0], waited=True).reshape(-1)
            mine[seg.shard_at:seg.shard_at + seg.stop - seg.start] = view[seg.start:seg.stop]
        full = common.core().allgather(mine, name=f"{prefix}trainer.weights", process_set=ps)
        lo, hi = self.bounds[self._rank], self.bounds[self._rank + 1]
        for _, p, at, size in self.layout:
            view = nda.write_view(p._data[0], waited=True).reshape(-1)
            if at < lo:  # the part before this rank's shard
                view[:min(size, lo - at)] = full[at:min(at + size, lo)]
            if at + size > hi:  # the part after it
                start = max(0, hi - at)
                view[start:] = full[at + start:at + size]

    def _check_fresh(self, ignore_stale_grad: bool) -> set[int]:
        """Gluon's check of ``Trainer._update``: a gradient backward did not write since the last step raises
        (the same ``UserWarning``), or with ``ignore_stale_grad`` its parameter is not updated. Returns the indices
        of the stale parameters, and marks the others' gradients as used."""
        stale = set()
        for i, p, _, _ in self.layout:
            data = p._data[0]
            if not data._fresh_grad:
                if not ignore_stale_grad:
                    raise UserWarning(
                        f"Gradient of Parameter `{p.name}` on context {data.context} has not been updated by "
                        "backward since last `step`. This could mean a bug in your model that made it only use a "
                        "subset of the Parameters (Blocks) for this iteration. If you are intentionally only "
                        "using a subset, call step with ignore_stale_grad=True to suppress this warning and skip "
                        "updating of Parameters with stale gradient")
                stale.add(i)
            data._fresh_grad = False
        return stale

    # -- states ------------------------------------------------------------------------------------------------
    def gather_states(self) -> dict[int, Any]:
        """Every parameter's whole optimizer state, as Gluon's ``Updater.states`` holds it (``{index: state}``,
        NDArrays on the parameter's context), from every rank's segments; also sets every parameter's update
        count in the optimizer to its owners'. A collective: every rank of the set calls it, in the same order."""
        opt = self._trainer._optimizer
        counts = opt._index_update_count
        mine = []
        for seg in self.segments:
            state = self.states.get(seg.index)
            leaves = [leaf.asnumpy() for leaf in _leaves(state)]
            mine.append((seg.index, seg.start, seg.index in self.states, leaves, counts.get(seg.index)))
        pieces: dict[int, list[tuple[int, bool, list[np.ndarray]]]] = {}
        for theirs in common.allgather_object(mine, name=f"{self._trainer._prefix}trainer.states",
                                              process_set=self._ps):
            for index, start, has, leaves, count in theirs:
                pieces.setdefault(index, []).append((start, has, leaves))
                if count is not None:
                    counts[index] = max(count, counts.get(index, 0))
        out: dict[int, Any] = {}
        for index, p, _, _ in self.layout:
            parts = sorted(pieces.get(index, []), key=lambda t: t[0])
            if not parts or not all(has for _, has, _ in parts):
                continue  # never updated (a stale gradient every step so far): Gluon's Updater has no state
            like = self._like(index, p)
            leaves = [mx.nd.array(np.concatenate([leaves[k] for _, _, leaves in parts]).reshape(p.shape),
                                  ctx=p._data[0].context, dtype=leaf.dtype)
                      for k, leaf in enumerate(_leaves(like))]
            out[index] = _rebuild(like, leaves)
        return out

    def _like(self, index: int, param: Any) -> Any:
        """A state of ``param``'s whole shape (its structure and dtypes), made by the optimizer."""
        with mx.autograd.pause():
            return self._trainer._optimizer.create_state_multi_precision(index, param._data[0])

    def load_states(self, states: dict[int, Any]) -> None:
        """This rank's segments of whole states (``{index: state}``, Gluon's ``Updater.states``)."""
        self.states = {}
        for seg in self.segments:
            state = states.get(seg.index)
            if state is None:
                continue
            leaves = [leaf.reshape((-1,))[seg.start:seg.stop].copyto(seg.param._data[0].context)
                      for leaf in _leaves(state)]
            self.states[seg.index] = _rebuild(state, leaves)
