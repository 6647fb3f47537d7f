"""spark_hvd on Ray: Horovod's ``RayExecutor`` over spark_hvd's launch contract, rendezvous and ring.

``RayExecutor(settings, num_workers=2).start()`` places one Ray actor per rank, gives each its rank (a Ray node is
a host), the job's secret (never through Ray: ``spark_hvd.ray.secret``) and torchrun's environment, and joins them
in one ring; ``run(fn)`` / ``execute(fn)`` then run functions that use ``spark_hvd.torch`` (or keras, tensorflow)
as ``hvd``, or plain torch.distributed code. ``RayExecutor(settings, min_workers=..., max_workers=...)`` is an
elastic job (``spark_hvd.ray.elastic``); ``spark_hvd.ray.tune.DistributedTrainableCreator`` makes every Ray Tune
trial a job. See docs/ray.md. Importing this package does not import Ray; starting
an executor needs it (``pip install 'spark_hvd[ray]'``).
"""

from spark_hvd.ray.errors import PlacementTimeoutError, RayExecutorError, RayWorkerFailedError, WorkerNode
from spark_hvd.ray.executor import RayExecutor, RaySettings
from spark_hvd.ray.secret import SecretClaimError

__all__ = ["PlacementTimeoutError", "RayExecutor", "RayExecutorError", "RaySettings", "RayWorkerFailedError",
           "SecretClaimError", "WorkerNode"]
