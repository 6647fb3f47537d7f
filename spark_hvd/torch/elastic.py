"""Horovod's torch elastic API: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``.

Example (run it with ``spark_hvd.runner.run_elastic(train, min_num_proc=1, max_num_proc=4)``)::

    import spark_hvd.torch as hvd

    def train():
        hvd.init()
        sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
        state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

        @hvd.elastic.run
        def loop(state):
            for state.epoch in range(state.epoch, epochs):
                for state.batch, idx in enumerate(batches(sampler), start=state.batch):
                    ...  # forward, backward, optimizer.step()
                    sampler.record_batch(state.batch, batch_size)
                    state.commit()
                state.batch = 0
                sampler.set_epoch(state.epoch + 1)
                state.commit()

        loop(state)
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from spark_hvd.core.elastic import (
    ElasticSampler,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    run_fn,
)
from spark_hvd.torch import mpi_ops
from spark_hvd.torch.functions import broadcast_optimizer_state, broadcast_parameters


class _Handler:
    """Snapshot / restore / sync of one object of a known kind (model, optimizer, sampler)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self, name: str) -> None:
        raise NotImplementedError


class _ModelHandler(_Handler):
    def sync(self, name: str) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self, name: str) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def save(self) -> None:
        self.value.sync_processed()  # collective: every rank's processed indices, so rank 0's snapshot has all
        super().save()

    def sync(self, name: str) -> None:
        self.value.load_state_dict(mpi_ops.broadcast_object(self.value.state_dict(), 0,
                                                            name=f"elastic.sampler.{name}"))


_HANDLERS: list[tuple[type, type[_Handler]]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (ElasticSampler, _SamplerHandler),
]


class TorchState(ObjectState):
    """Elastic state of a torch training process (Horovod's ``hvd.elastic.TorchState``).

    ``model`` (``nn.Module``), ``optimizer`` and any keyword that is a module, an optimizer or an
    ``ElasticSampler`` are snapshotted by deep copies of their ``state_dict()`` on ``commit()`` and loaded back by
    ``restore()``; ``sync()`` broadcasts them from rank 0. Other keywords are plain objects (``ObjectState``). All
    are attributes: ``state.model``, ``state.epoch``.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **objects: Any) -> None:
        objects.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in objects.items():
            kind = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if kind is None:
                if value is not None or name not in ("model", "optimizer"):
                    plain[name] = value
            else:
                handlers[name] = kind(value)
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(**plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        self.sync_from_driver()
        for name, handler in self._handlers.items():
            handler.sync(name)
        super().sync()

    def snapshot(self) -> Any:
        return {**super().snapshot(), "handlers": {name: h.saved for name, h in self._handlers.items()}}

    def load_snapshot(self, value: Any) -> None:
        super().load_snapshot(value)
        for name, saved in value["handlers"].items():
            if name not in self._handlers:
                raise KeyError(f"the committed elastic state has {name!r}, which this TorchState does not hold "
                               f"(it holds {sorted(self._handlers)}); build the state with the same keywords")
            self._handlers[name].saved = saved


def _reset() -> None:
    mpi_ops.shutdown()
    mpi_ops.init()


def run(func: Any) -> Any:
    """Horovod's ``hvd.elastic.run`` decorator: ``func(state, *args, **kwargs)`` runs from a synced state, and
    under ``spark_hvd.runner.run_elastic`` resumes from the last commit after a lost rank or a resize."""
    return run_fn(func, _reset)


__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]
