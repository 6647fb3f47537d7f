"""``DistributedOptimizer(..., op=Adasum)``: Horovod's delta optimizer for Adasum.

Adasum combines *updates*, not gradients (Horovod's "Distributed Adasum Optimizer"): each rank runs the wrapped
optimizer's step on its own gradients (its own optimizer state: Adam's moments, momentum buffers, stay per rank),
takes the change of every parameter, ``delta = p_after - p_before``, combines the ranks' deltas with the Adasum
allreduce, and sets ``p = p_before + adasum(deltas)``, the same on every rank.

As in Horovod the local step runs per parameter inside its gradient hook, as soon as the gradient is final for the
step (after ``backward_passes_per_step`` passes summed in ``p.grad``), and the delta's Adasum allreduce starts there
on the core's background engine, so the reductions overlap the rest of backward; ``step()`` waits for them (after
running the local step for any parameter whose hook did not fire) and writes ``p_before + delta``. Each delta goes
out alone under its parameter's name (the engine fuses them; Adasum keeps each tensor's own coefficients).

Differs from Horovod: a non-global process set works (Horovod raises ``NotImplementedError``): the deltas are
combined over its ranks only, and a rank outside it keeps its local step. Deltas of CUDA parameters are combined
in host memory (the core's Adasum runs there), as Horovod's MPI build does when it has no NCCL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet
from spark_hvd.torch import mpi_ops
from spark_hvd.torch.compression import Compressor
from spark_hvd.torch.passes import count_pass


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Mixin placed in front of the user's optimizer class (see :func:`wrap`)."""

    # set by _hvd_adasum_setup
    _hvd_names: dict[int, str]
    _hvd_compression: type[Compressor]
    _hvd_process_set: ProcessSet

    def _hvd_adasum_setup(self, names: dict[int, str], compression: type[Compressor],
                          backward_passes_per_step: int, process_set: ProcessSet) -> None:
        self._hvd_names = names
        self._hvd_compression = compression
        self._hvd_process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._hvd_group_index = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self._hvd_requires_update = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._hvd_delay = {id(p): backward_passes_per_step for p in self._hvd_requires_update}
        self._hvd_start: dict[int, torch.Tensor] = {}  # each parameter before this step's local update
        # parameter id -> (parameter, handle, reduced buffer, compression context)
        self._hvd_handles: dict[int, tuple[torch.Tensor, mpi_ops.Handle, torch.Tensor, Any]] = {}
        self._parameter_names = {p: names[id(p)] for g in self.param_groups for p in g["params"]}  # Horovod's
        self._hvd_hook_handles = [p.register_post_accumulate_grad_hook(self._hvd_hook)
                                  for p in self._hvd_requires_update]

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (Horovod's); call it between steps."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        for pid in self._hvd_delay:
            self._hvd_delay[pid] = passes

    # ---------------------------------------------------------------------------------------------------------
    def _hvd_hook(self, p: torch.Tensor) -> None:
        pid = id(p)
        if pid not in self._hvd_delay:
            return
        if count_pass(self, pid, "optimizer.step()"):
            self._hvd_step_and_submit(p)

    def _hvd_local_step(self, p: torch.Tensor) -> None:
        """The wrapped optimizer's step on ``p`` alone (its group's settings, its own state)."""
        groups = self.param_groups
        group = groups[self._hvd_group_index[id(p)]]
        params = group["params"]
        self.param_groups = [group]
        group["params"] = [p]
        try:
            super().step()
        finally:
            group["params"] = params
            self.param_groups = groups

    def _hvd_step_and_submit(self, p: torch.Tensor) -> None:
        """Run the local step on ``p`` and start the Adasum allreduce of its change."""
        pid = id(p)
        with torch.no_grad():
            start = self._hvd_start.get(pid)
            if start is None:
                start = self._hvd_start[pid] = torch.empty_like(p, memory_format=torch.contiguous_format)
            start.copy_(p)
            self._hvd_local_step(p)
            delta = p.detach().sub(start)
            compressed, ctx = self._hvd_compression.compress(delta)
            buf = compressed if compressed.is_cpu else compressed.cpu()  # the core's Adasum runs on host memory
            buf = buf.contiguous()
        h = mpi_ops.allreduce_async_(buf, name=f"adasum.delta.{self._hvd_names[pid]}", op=ReduceOp.ADASUM,
                                     process_set=self._hvd_process_set)
        self._hvd_handles[pid] = (p, h, buf, ctx)

    # ---------------------------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Nothing to do: with Adasum the local step runs in the gradient hooks and ``step()`` combines the
        deltas (Horovod's ``synchronize`` is a no-op for Adasum too)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Not supported with Adasum (as in Horovod): the gradients are applied locally before any reduction."""
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover - a generator for contextmanager

    def step(self, closure: Any = None) -> Any:
        """Run the local step for every parameter whose gradient hook has not (``backward_passes_per_step``
        passes not yet seen, or no gradient this step), wait for the deltas' Adasum, set ``p = p_before + delta``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p in self._hvd_requires_update:
            if id(p) not in self._hvd_handles:
                self._hvd_step_and_submit(p)
        try:
            for p, h, _buf, ctx in list(self._hvd_handles.values()):
                reduced = self._hvd_compression.decompress(mpi_ops.synchronize(h), ctx)
                with torch.no_grad():
                    start = self._hvd_start[id(p)]
                    start.add_(reduced.to(start.device, start.dtype))
                    p.copy_(start)
        finally:
            self._hvd_handles.clear()
            for pid in self._hvd_delay:
                self._hvd_delay[pid] = self.backward_passes_per_step
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; refused between ``backward()`` and ``step()`` (as in Horovod): the local updates
        of that step have already been made and their deltas are being combined."""
        if self._hvd_handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        super().zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer then no longer steps in backward)."""
        for h in self._hvd_hook_handles:
            h.remove()
        self._hvd_hook_handles = []


def wrap(optimizer: torch.optim.Optimizer, names: dict[int, str], compression: type[Compressor],
         backward_passes_per_step: int, process_set: ProcessSet) -> torch.optim.Optimizer:
    """``optimizer`` as a delta optimizer combining its updates with Adasum over ``process_set``.

    ``names`` maps ``id(parameter)`` to the parameter's name (checked by the caller: unique, covering every
    parameter); the caller has handled the cases where nothing is combined (one rank, a rank outside the set).
    """
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedAdasumOptimizer, base),
               {"__module__": __name__, "__qualname__": base.__name__})
    obj = cls.__new__(cls)
    obj.__dict__.update(optimizer.__dict__)
    obj._hvd_adasum_setup(names, compression, backward_passes_per_step, process_set)
    return obj
