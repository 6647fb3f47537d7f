"""Distributed trials for Ray Tune: every trial is a spark_hvd job of ``num_workers`` ranks (Horovod had
``DistributedTrainableCreator``).

``DistributedTrainableCreator(func, num_workers=2)`` returns a Tune function trainable that asks Tune for one
placement group per trial (an empty bundle for the trial itself, one bundle per worker), starts a ``RayExecutor`` in
it (``use_current_placement_group``), and runs ``func(config)`` on every rank. What rank 0 reports reaches the trial
through the job's driver service (the runner's) and becomes ``ray.tune.report``, in order, as it happens
(``RayExecutor.run``'s ``callbacks``), so Tune's schedulers (ASHA, PBT, early stopping) see every result and can
stop a trial. A trial's results are what its rank 0 reported (``func``'s return value is not reported); the other
ranks' reports are dropped. Several trials run at once where the cluster holds their placement groups.

Inside ``func``, Tune's two calls have their counterparts here, with Tune's signatures:

- ``report(metrics, checkpoint=None)``: on rank 0, ``ray.tune.report(metrics, checkpoint=checkpoint)`` in the trial
  (``checkpoint`` a ``ray.tune.Checkpoint``, ``Checkpoint.from_directory(path)``); it returns once Tune copied the
  checkpoint into the experiment's storage, so the directory may then be reused. On the other ranks it does
  nothing. ``spark_hvd.runner.report(**metrics)`` also works (metrics only).
- ``get_checkpoint()``: on every rank, the checkpoint the trial was restored from (``ray.tune.get_checkpoint()``
  in the trial: after a failure with ``FailureConfig(max_failures=...)``, ``Tuner.restore``, PBT's exploit, a
  paused trial resumed), or None for a fresh trial. A rank on another Ray node than the trial gets a copy of it
  where the checkpoint is on a local filesystem (``spark_hvd.ray.checkpoints``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from spark_hvd.ray.checkpoints import NodeCheckpoint, node_id, offer
from spark_hvd.ray.executor import RayExecutor

#: in a rank, while ``func`` runs: the checkpoint the trial was restored from
_restored: NodeCheckpoint | None = None
#: in a rank: the local copy ``get_checkpoint`` made of it (left at the end of ``func``)
_copy: contextlib.ExitStack | None = None
_copied: Any = None


def _tune(name: str) -> Callable[..., Any]:
    """Tune's ``report`` / ``get_checkpoint`` for a function trainable: ``ray.tune``'s (Ray 2.60), else
    ``ray.train``'s, where older Ray (2.10) has them. The one version shim of this package."""
    from ray import tune

    function = getattr(tune, name, None)
    if function is None:
        from ray import train

        function = getattr(train, name)
    return function


def report(metrics: dict[str, Any], *, checkpoint: Any = None) -> None:
    """In ``func``, on rank 0: ``ray.tune.report(metrics, checkpoint=checkpoint)`` in the trial, returning once
    Tune stored the checkpoint (``checkpoint``: a ``ray.tune.Checkpoint``); on the other ranks nothing."""
    import spark_hvd.core as core
    from spark_hvd.runner import report as report_metrics

    if core.rank() != 0:
        return
    if checkpoint is None:
        report_metrics(**metrics)
    else:
        offer(metrics, checkpoint)


def get_checkpoint() -> Any:
    """In ``func``, on every rank: the ``ray.tune.Checkpoint`` the trial was restored from, readable here (a copy
    on a rank of another node, where the checkpoint is on a local filesystem), or None for a fresh trial."""
    global _copy, _copied
    if _restored is None:
        return None
    if _copy is None:
        _copy = contextlib.ExitStack()
        _copied = _copy.enter_context(_restored.local())
    return _copied


def _in_trial(func: Callable[[dict[str, Any]], Any], config: dict[str, Any], restored: NodeCheckpoint | None) -> Any:
    """On every rank: ``func(config)`` with ``get_checkpoint()`` answering ``restored``."""
    global _restored, _copy, _copied
    _restored = restored
    try:
        return func(config)
    finally:
        copy, _restored, _copy, _copied = _copy, None, None, None
        if copy is not None:
            copy.close()


class _TrialReporter:
    """The trial's callback of ``RayExecutor.run``: rank 0's metrics, and its checkpoints (readable on this
    node), to ``ray.tune.report``."""

    takes_checkpoint = True

    def __init__(self) -> None:
        self._report = _tune("report")

    def __call__(self, metrics: dict[str, Any], checkpoint: NodeCheckpoint | None = None) -> None:
        if checkpoint is None:
            self._report(metrics)
            return
        with checkpoint.local() as readable:  # Tune copies it into the experiment's storage before returning
            self._report(metrics, checkpoint=readable)


def DistributedTrainableCreator(func: Callable[[dict[str, Any]], Any], num_workers: int = 2,  # noqa: N802
                                cpus_per_worker: float = 1, use_gpu: bool = False,
                                gpus_per_worker: float | None = None, timeout_s: float = 30) -> Any:
    """A Tune trainable (pass it to ``tune.Tuner``) whose every trial runs ``func(config)`` on ``num_workers``
    ranks of one spark_hvd job (see the module docstring). Horovod's name and arguments (``num_hosts`` is not
    taken: the workers go where the trial's placement group puts them)."""
    from ray import tune

    gpus = (gpus_per_worker or 1) if use_gpu else 0

    def trainable(config: dict[str, Any]) -> None:
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=timeout_s), num_workers=num_workers,
                               cpus_per_worker=cpus_per_worker, use_gpu=use_gpu, gpus_per_worker=gpus_per_worker,
                               use_current_placement_group=True)
        restored = _tune("get_checkpoint")()  # where the trial was restored from, handed to every rank
        restored = None if restored is None else NodeCheckpoint(restored, node_id())
        executor.start()
        try:  # rank 0's reports become Tune's, on this (the trial's) thread, as they come
            executor.run(_in_trial, args=[func, config, restored], callbacks=[_TrialReporter()])
        finally:
            executor.shutdown()

    bundles = [{"CPU": 0}] + [{"CPU": cpus_per_worker, **({"GPU": gpus} if gpus else {})}] * num_workers
    return tune.with_resources(trainable, tune.PlacementGroupFactory(bundles))
