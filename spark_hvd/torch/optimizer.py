"""``DistributedOptimizer``: gradient averaging that overlaps backward, as in Horovod.

A post-accumulate-grad hook on every parameter starts that parameter's allreduce (in place on ``p.grad``) as
soon as its gradient is final for the step, so communication runs in the core's background engine while
autograd still computes the earlier layers. ``step()`` waits for the outstanding allreduces, then runs the
wrapped optimizer's update.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from spark_hvd import _binding_common as common
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.torch import adasum_optimizer, mpi_ops
from spark_hvd.torch.compression import Compression, Compressor
from spark_hvd.torch.passes import count_pass

log = logging.getLogger(__name__)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixin placed in front of the user's optimizer class (see :func:`DistributedOptimizer`)."""

    # set by _hvd_setup
    _hvd_groups: list[list[torch.Tensor]]
    _hvd_group_names: list[str]
    _hvd_sparse_as_dense: bool = False

    def _hvd_setup(self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                   compression: type[Compressor], backward_passes_per_step: int, op: ReduceOp,
                   gradient_predivide_factor: float, groups: Any, bucket_cap_mb: float | None,
                   process_set: ProcessSet = global_process_set) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self._hvd_compression = compression
        self._hvd_process_set = process_set
        self._hvd_op = op
        self._hvd_prescale, self._hvd_postscale = common.gradient_scales(op, gradient_predivide_factor)
        self.backward_passes_per_step = backward_passes_per_step

        all_params = [p for g in self.param_groups for p in g["params"]]
        name_of = _parameter_names(all_params, named_parameters)
        self._hvd_requires_update = [p for p in all_params if p.requires_grad]
        # groups of parameters reduced together; every parameter belongs to exactly one group
        explicit: list[list[torch.Tensor]] = []
        if groups is not None:
            if isinstance(groups, int):
                if groups <= 0:
                    raise ValueError(f"groups must be a positive int or a list of parameter lists, got {groups}")
                n = len(self._hvd_requires_update)
                per = -(-n // groups) if n else 1
                explicit = [self._hvd_requires_update[i:i + per] for i in range(0, n, per)]
            else:
                known = {id(p) for p in self._hvd_requires_update}
                for gi, g in enumerate(groups):
                    g = list(g)
                    for p in g:
                        if id(p) not in known:
                            raise ValueError(f"groups[{gi}] holds a tensor that is not a trainable parameter "
                                             "of this optimizer")
                    explicit.append(g)
        elif bucket_cap_mb:
            explicit = _buckets(self._hvd_requires_update, bucket_cap_mb)
        grouped_ids = {id(p) for g in explicit for p in g}
        self._hvd_groups = [g for g in explicit if g]
        self._hvd_groups += [[p] for p in self._hvd_requires_update if id(p) not in grouped_ids]
        self._hvd_group_names = []
        for g in self._hvd_groups:
            if len(g) == 1:
                self._hvd_group_names.append(f"grad.{name_of[id(g[0])]}")
            else:
                self._hvd_group_names.append(f"grad.group.{name_of[id(g[0])]}+{len(g) - 1}")
        self._hvd_group_of = {id(p): gi for gi, g in enumerate(self._hvd_groups) for p in g}
        self._hvd_names = name_of
        self._hvd_delay = {id(p): backward_passes_per_step for p in self._hvd_requires_update}
        self._hvd_ready: dict[int, set[int]] = {}
        self._hvd_handles: dict[int, tuple[mpi_ops.Handle, list[torch.Tensor], list[Any]]] = {}
        self._hvd_sparse: dict[int, tuple[torch.Tensor, mpi_ops.Handle]] = {}  # sparse gradients in flight
        self._hvd_densified: set[int] = set()  # sparse gradients sent dense (sparse_as_dense)
        self._parameter_names = {p: name_of[id(p)] for p in all_params}  # Horovod's attribute
        self._hvd_should_synchronize = True
        self._hvd_synchronized = False
        self._hvd_hook_handles = []
        # one rank: averaging over one rank is the identity, so there is nothing to send (and no hook to run);
        # a rank outside the process set keeps its own gradients, as in Horovod
        self._hvd_noop = not process_set.included() or mpi_ops.set_size(process_set) == 1
        if self._hvd_noop:
            return
        for p in self._hvd_requires_update:
            self._hvd_hook_handles.append(p.register_post_accumulate_grad_hook(self._hvd_hook))

    # ---------------------------------------------------------------------------------------------------------
    def _hvd_hook(self, p: torch.Tensor) -> None:
        pid = id(p)
        gi = self._hvd_group_of.get(pid)
        if gi is None:
            return
        if count_pass(self, pid, "optimizer.step() / synchronize()"):
            ready = self._hvd_ready.setdefault(gi, set())
            ready.add(pid)
            if len(ready) == len(self._hvd_groups[gi]):
                self._hvd_submit(gi)

    def _hvd_submit(self, gi: int) -> None:
        params: list[torch.Tensor] = []
        compressed: list[torch.Tensor] = []
        ctxs: list[Any] = []
        for p in self._hvd_groups[gi]:
            if p.grad is None:
                # this rank computed no gradient for p (unused in its graph); others may have: send zeros
                p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif p.grad.is_sparse:
                if not self._hvd_sparse_as_dense:  # Horovod's sparse allreduce: gather indices and values
                    self._hvd_sparse[id(p)] = (p, mpi_ops.sparse_allreduce_async(
                        p.grad, name=f"grad.sparse.{self._hvd_names[id(p)]}", op=self._hvd_op,
                        process_set=self._hvd_process_set))
                    continue
                p.grad = p.grad.to_dense()
                self._hvd_densified.add(id(p))  # back to sparse before the update, as Horovod does
            c, ctx = self._hvd_compression.compress(p.grad)
            params.append(p)
            compressed.append(c)
            ctxs.append(ctx)
        name = self._hvd_group_names[gi]
        if len(compressed) == 1:
            h = mpi_ops.allreduce_async_(compressed[0], name=name, op=self._hvd_op,
                                         prescale_factor=self._hvd_prescale, postscale_factor=self._hvd_postscale,
                                         process_set=self._hvd_process_set)
        else:
            h = mpi_ops.grouped_allreduce_async_(compressed, name=name, op=self._hvd_op,
                                                 prescale_factor=self._hvd_prescale,
                                                 postscale_factor=self._hvd_postscale,
                                                 process_set=self._hvd_process_set)
        self._hvd_handles[gi] = (h, params, ctxs)

    def _hvd_wait_all(self, apply: bool) -> None:
        for h, params, ctxs in list(self._hvd_handles.values()):
            out = mpi_ops.synchronize(h)
            if not apply:
                continue
            outs = out if isinstance(out, list) else [out]
            for p, o, ctx in zip(params, outs, ctxs, strict=True):
                d = self._hvd_compression.decompress(o, ctx)
                if d is not p.grad:
                    with torch.no_grad():
                        p.grad.copy_(d)
                if id(p) in self._hvd_densified:
                    p.grad = p.grad.to_sparse()
        for p, h in list(self._hvd_sparse.values()):
            reduced = mpi_ops.synchronize(h)
            if apply:
                p.grad = reduced
        self._hvd_handles.clear()
        self._hvd_sparse.clear()
        self._hvd_densified.clear()
        self._hvd_ready.clear()
        for pid in self._hvd_delay:
            self._hvd_delay[pid] = self.backward_passes_per_step

    # ---------------------------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the gradient allreduces of this step (starting any not yet started) and write ``p.grad``.

        Call it yourself before touching gradients (e.g. clipping), then ``step()`` inside
        :meth:`skip_synchronize`.
        """
        if self._hvd_noop:
            self._hvd_synchronized = True
            return
        for gi in range(len(self._hvd_groups)):
            if gi not in self._hvd_handles:
                self._hvd_submit(gi)
        self._hvd_wait_all(apply=True)
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context ``step()`` does not synchronize (use after an explicit :meth:`synchronize`)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Wait for the averaged gradients, then update the parameters with the wrapped optimizer."""
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after optimizer.synchronize(); "
                    "the gradients are reduced twice. Wrap step() in `with optimizer.skip_synchronize():`.",
                    stacklevel=2)
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients. Allreduces still in flight are completed (every rank takes part) and
        discarded first, so no background write lands in a gradient after it was cleared."""
        if self._hvd_handles:
            log.warning("optimizer.zero_grad() called with %d gradient allreduce(s) in flight (after backward, "
                        "before step()); waiting for them and discarding the results", len(self._hvd_handles))
            self._hvd_wait_all(apply=False)
        elif self._hvd_ready or any(d != self.backward_passes_per_step for d in self._hvd_delay.values()):
            self._hvd_ready.clear()
            for pid in self._hvd_delay:
                self._hvd_delay[pid] = self.backward_passes_per_step
        super().zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer then no longer averages gradients)."""
        for h in self._hvd_hook_handles:
            h.remove()
        self._hvd_hook_handles = []


def _parameter_names(all_params: list[torch.Tensor],
                     named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of an optimizer: from ``named_parameters`` (checked: pairs,
    unique names, every parameter named), or by position (``noname.<i>``)."""
    if named_parameters is None:
        return {id(p): f"noname.{i}" for i, p in enumerate(all_params)}
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters must be a sequence of (name, parameter) tuples, "
                         "e.g. model.named_parameters()")
    names_seen: dict[str, int] = {}
    for n, _ in named:
        names_seen[n] = names_seen.get(n, 0) + 1
    dups = sorted(n for n, c in names_seen.items() if c > 1)
    if dups:
        raise ValueError(f"parameter names in named_parameters are not unique: {dups}")
    name_of = {id(p): n for n, p in named}
    unnamed = [i for i, p in enumerate(all_params) if id(p) not in name_of]
    if unnamed:
        raise ValueError(
            f"named_parameters does not cover every parameter of the optimizer: parameters at "
            f"positions {unnamed[:10]} of optimizer.param_groups have no name")
    return name_of


def _buckets(params: list[torch.Tensor], cap_mb: float) -> list[list[torch.Tensor]]:
    """DDP-style buckets over ``params`` in reverse order: the first closes past 1 MiB, the others past ``cap_mb``."""
    if cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0 (or None), got {cap_mb}")
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    nbytes = 0
    cap = min(1.0, cap_mb) * 2**20
    for p in reversed(params):
        current.append(p)
        nbytes += p.numel() * p.element_size()
        if nbytes >= cap:
            buckets.append(current)
            current, nbytes, cap = [], 0, cap_mb * 2**20
    if current:
        buckets.append(current)
    return buckets


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1,
                         op: ReduceOp = common.Average,
                         gradient_predivide_factor: float = 1.0,
                         groups: Any = None,
                         bucket_cap_mb: float | None = 25.0,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its state and param groups are shared, not copied.
        named_parameters: ``model.named_parameters()``: names the allreduces (recommended; they must be the
            same on every rank). Without it parameters are named by position.
        compression: ``Compression.none`` or ``Compression.fp16`` (send gradients as float16).
        backward_passes_per_step: number of ``backward()`` calls accumulated locally in ``p.grad`` before one
            allreduce (scale the loss by ``1/k`` to average them, as with Horovod).
        op: ``Average`` (default) or ``Sum``, or ``Adasum``: Horovod's delta optimizer (each rank steps on its own
            gradients, the parameters' changes are combined with Adasum; see :mod:`spark_hvd.torch.adasum_optimizer`).
            With Adasum, ``groups``, ``bucket_cap_mb`` and ``sparse_as_dense`` have no effect (every delta goes out
            alone, by name, as in Horovod), and ``skip_synchronize()`` raises.
        gradient_predivide_factor: divide gradients by this before the sum and multiply after (Average only).
        groups: an int (split the parameters into that many groups) or a list of parameter lists; each group
            goes out as one grouped allreduce once all its gradients are ready.
        bucket_cap_mb: without ``groups``, parameters are put in buckets in reverse order (about the order
            backward produces their gradients), the first bucket closing after 1 MiB and the others after this
            many MiB, as torch DDP does: a step then runs a few large collectives instead of one per tensor, while
            the first buckets still overlap the rest of backward. ``None`` or 0: one allreduce per tensor (left to
            the core's fusion), Horovod's behaviour. Results are identical either way; only timing changes.
        sparse_as_dense: send sparse gradients (``nn.Embedding(..., sparse=True)``) as dense tensors in the
            allreduce, and make them sparse again for the update (Horovod's); without it a sparse gradient goes through
            :func:`sparse_allreduce_async` (every rank's indices and values gathered) and stays sparse, as in Horovod.
        process_set: reduce gradients over the ranks of this process set only (averages divide by its size); on a
            rank outside it the optimizer applies its own gradients unreduced, as in Horovod.

    Returns:
        an optimizer of a subclass of ``type(optimizer)`` (``isinstance`` checks and ``state_dict`` still work)
        with ``synchronize()`` and ``skip_synchronize()``.
    """
    common.require_init("DistributedOptimizer()")
    if isinstance(optimizer, (_DistributedOptimizer, adasum_optimizer._DistributedAdasumOptimizer)):
        raise ValueError("optimizer is already a DistributedOptimizer")
    rop = common.resolve_op(op)
    if rop not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
        raise ValueError(f"DistributedOptimizer supports op=Average, Sum or Adasum, got {rop}")
    if rop is ReduceOp.ADASUM:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        common.gradient_scales(rop, gradient_predivide_factor)  # Horovod's ValueError for a predivide factor
        if process_set.included() and mpi_ops.set_size(process_set) > 1:  # else: nothing to combine (Horovod's)
            names = _parameter_names([p for g in optimizer.param_groups for p in g["params"]], named_parameters)
            return adasum_optimizer.wrap(optimizer, names, compression, backward_passes_per_step, process_set)
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": __name__, "__qualname__": base.__name__})
    obj = cls.__new__(cls)
    obj.__dict__.update(optimizer.__dict__)
    # no _patch_step_function(): the base class's step is already wrapped with the step hooks, and our step
    # calls it, so the hooks run once, after the gradients were averaged
    obj._hvd_sparse_as_dense = bool(sparse_as_dense)
    obj._hvd_setup(named_parameters, compression, backward_passes_per_step, rop, gradient_predivide_factor, groups,
                   bucket_cap_mb, process_set)
    return obj
