"""Exception types of ``spark_hvd.ray``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spark_hvd.runner.errors import RankFailedError, RankFailure, RunnerError


@dataclass(frozen=True)
class WorkerNode:
    """Where one rank of a ``RayExecutor`` job runs: its Ray node's address and id, host name and process id."""

    rank: int
    node_ip: str
    node_id: str
    hostname: str
    pid: int

    def where(self) -> str:
        """``127.0.0.1 (node 1a2b3c4d..., host h1, pid 1234)``."""
        return f"{self.node_ip} (node {self.node_id[:12]}, host {self.hostname}, pid {self.pid})"


class RayExecutorError(RunnerError):
    """A ``RayExecutor`` could not place, start or reach its workers."""


class PlacementTimeoutError(RayExecutorError, TimeoutError):
    """Ray could not place the workers within ``placement_group_timeout_s`` (a ``TimeoutError``, as Horovod's)."""


class RayWorkerFailedError(RankFailedError):
    """A rank of a ``RayExecutor`` job failed: ``rank``, ``node`` (a ``WorkerNode``: the Ray node it ran on), the
    remote exception type, message and traceback (``RankFailedError``'s attributes), every failure seen."""

    def __init__(self, failure: RankFailure, failures: list[RankFailure], node: WorkerNode | None,
                 what: str = "run") -> None:
        super().__init__(failure, failures)
        self.node = node
        self.args = (f"RayExecutor.{what}: {self.args[0]}",)

    def __reduce__(self) -> tuple[Any, ...]:
        """Copied and pickled as it is (Ray Tune copies a trial's error, and sends it to its driver): the
        constructor's arguments are not its ``args``."""
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An exception of ``cls`` with ``args`` and the attributes ``state``, its constructor not called."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc
