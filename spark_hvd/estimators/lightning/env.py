"""``SparkHvdEnvironment``: Lightning's ``ClusterEnvironment`` for a spark_hvd rank.

A Lightning ``Trainer`` asks its cluster environment who it is and whether someone else started its processes.
In a spark_hvd rank the answer is: spark_hvd started them (``creates_processes_externally`` is True, so Lightning
launches nothing), the rank and world size are the job's (``hvd.rank()``/``hvd.size()``), and
``init_process_group`` meets over the job's authenticated store through ``env://`` (``spark_hvd.core.torchrun``,
installed in every rank by the runner); ``main_address``/``main_port`` are only what torchrun's variables say.

Every rank is its own Lightning "node" with one device: ``node_rank()`` is the global rank and ``local_rank()`` 0,
so ``Trainer(devices=1 (or [gpu index]), num_nodes=world size)`` holds for any placement of ranks on hosts (Lightning
would otherwise index its device list with the local rank). ``set_global_rank``/``set_world_size`` (Lightning's
own arithmetic from nodes and devices) are checked against the job's values, never applied.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import ClusterEnvironment

__all__ = ["SparkHvdEnvironment"]


class SparkHvdEnvironment(ClusterEnvironment):
    """The rank and size of a spark_hvd job for Lightning (see the module docstring)."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self._rank, self._size = int(rank), int(size)

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        """Never picked by Lightning's own detection: the estimator hands it to the strategy."""
        return False

    def world_size(self) -> int:
        return self._size

    def set_world_size(self, size: int) -> None:
        if size != self._size:
            raise ValueError(f"Lightning computed a world size of {size}, the spark_hvd job has {self._size} ranks "
                             "(devices and num_nodes must not be set in trainer_args)")

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self._rank:
            raise ValueError(f"Lightning computed global rank {rank} for spark_hvd rank {self._rank}")

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self._rank
