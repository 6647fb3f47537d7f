"""Distributed trials for Ray Tune: every trial is a spark_hvd job of ``num_workers`` ranks (Horovod had
``DistributedTrainableCreator``).

``DistributedTrainableCreator(func, num_workers=2)`` returns a Tune function trainable that asks Tune for one
placement group per trial (an empty bundle for the trial itself, one bundle per worker), starts a ``RayExecutor`` in
it (``use_current_placement_group``), and runs ``func(config)`` on every rank. What rank 0 reports with
``spark_hvd.runner.report(epoch=..., step=..., **metrics)`` reaches the trial through the job's driver service (the
runner's) and becomes ``ray.tune.report(metrics)``, in order, as it happens (``RayExecutor.run``'s
``callbacks``), so Tune's schedulers (ASHA, early stopping) see every result and can stop a trial. A trial's
results are what its rank 0 reported (``func``'s return value is not reported). Several trials run at once where
the cluster holds their placement groups.

Not done yet: checkpoints through Tune (``tune.report(checkpoint=...)``, ``tune.get_checkpoint()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spark_hvd.ray.executor import RayExecutor


def _tune_report() -> Callable[..., Any]:
    """Tune's ``report`` for a function trainable: ``ray.tune.report`` (Ray 2.60), else ``ray.train.report``, the
    function older Ray (2.10) has for it. The one version shim of this package."""
    from ray import tune

    report = getattr(tune, "report", None)
    if report is None:
        from ray import train

        report = train.report
    return report


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
        executor.start()
        try:  # rank 0's reports become Tune's, on this (the trial's) thread, as they come
            executor.run(func, args=[config], callbacks=[_tune_report()])
        finally:
            executor.shutdown()

    bundles = [{"CPU": 0}] + [{"CPU": cpus_per_worker, **({"GPU": gpus} if gpus else {})}] * num_workers
    return tune.with_resources(trainable, tune.PlacementGroupFactory(bundles))
