"""Exception types of the runner (Spark barrier runs and the local ``spark-hvd-run`` launcher)."""

from __future__ import annotations

from dataclasses import dataclass, field

from spark_hvd.errors import SparkHvdError

# Remote exception types that are consequences of another rank's failure rather than a cause of their own.
CONSEQUENCE_TYPES = frozenset({
    "PeerFailureError", "CollectiveTimeoutError", "ShutdownError", "TaskKilled", "KeyboardInterrupt", "SystemExit",
})


@dataclass
class RankFailure:
    """What the driver learnt about one failed rank.

    ``kind`` is ``"exception"`` (the rank's function raised; type, message and traceback are the remote ones) or
    ``"lost"`` (its process died or its connection to the driver closed before it finished).
    """

    rank: int
    kind: str
    type_name: str
    message: str
    traceback: str = ""
    time: float = 0.0
    consequence: bool = False
    #: the rank's host, as its connection to the driver service came from ("" where unknown)
    host: str = ""

    def describe(self) -> str:
        """One line: ``rank 1: ValueError: boom``."""
        return f"rank {self.rank}: {self.type_name}: {self.message}"


class RunnerError(SparkHvdError):
    """A distributed run could not start or did not finish."""


def _slots_text(num_proc: int, free_slots: int, total_slots: int, param: str) -> str:
    return (f"{param}={num_proc} processes were requested but the cluster has only {free_slots} free task slots "
            f"({total_slots} in all). A barrier stage needs all of its tasks running at once: lower {param} to at "
            f"most {free_slots}, or add executors/cores (spark.executor.instances, spark.executor.cores, "
            f"spark.task.cpus).")


class NotEnoughSlotsError(RunnerError):
    """More processes were asked for than the cluster has free task slots (raised before anything is launched)."""

    def __init__(self, num_proc: int, free_slots: int, total_slots: int, param: str = "num_proc") -> None:
        super().__init__(_slots_text(num_proc, free_slots, total_slots, param))
        self.num_proc = num_proc
        self.free_slots = free_slots
        self.total_slots = total_slots


class SlotsTimeoutError(NotEnoughSlotsError, TimeoutError):
    """Horovod's "Timed out waiting for Spark tasks to start": the free task slots stayed fewer than ``num_proc``
    for ``start_timeout`` seconds (executors were not added, other jobs did not give theirs back); raised before
    anything is launched."""

    def __init__(self, num_proc: int, free_slots: int, total_slots: int, waited_s: float,
                 param: str = "num_proc") -> None:
        NotEnoughSlotsError.__init__(self, num_proc, free_slots, total_slots, param)
        self.args = (f"Timed out waiting for Spark tasks to start: after start_timeout={waited_s:g} s, "
                     + _slots_text(num_proc, free_slots, total_slots, param)
                     + " Raise start_timeout where executors are added on demand.",)
        self.timeout_s = waited_s


class StartTimeoutError(RunnerError):
    """Some ranks did not start within ``start_timeout`` seconds."""

    def __init__(self, missing: list[int], timeout_s: float) -> None:
        super().__init__(
            f"ranks {missing} did not start within start_timeout={timeout_s:g} s; the cluster may be short of free "
            f"task slots or executors may be failing to start (see the Spark UI / executor logs).")
        self.missing = missing
        self.timeout_s = timeout_s


class StageNotStartedError(StartTimeoutError):
    """Spark Connect (which cannot tell the driver its free slots): no rank of the stage started in time."""

    def __init__(self, num_proc: int, waited_s: float) -> None:
        RunnerError.__init__(
            self,
            f"no rank of the num_proc={num_proc} barrier stage started within {waited_s:g} s. Over Spark Connect the "
            f"driver cannot see the cluster's free task slots: most likely fewer than {num_proc} slots are free (a "
            f"barrier stage needs all of its tasks running at once). Lower num_proc, free or add executors/cores, or "
            f"raise SPARK_HVD_CONNECT_START_WAIT if executors are just slow to start.")
        self.missing = list(range(num_proc))
        self.timeout_s = waited_s
        self.num_proc = num_proc


class ScriptExitError(RunnerError):
    """A script run by ``run("train.py")`` exited with a non-zero status (``exit_code``) on a rank."""

    def __init__(self, script: str, exit_code: int) -> None:
        super().__init__(f"the script {script} exited with code {exit_code}")
        self.exit_code = exit_code


class RankFailedError(RunnerError):
    """A rank of a distributed run failed; carries that rank's remote exception type, message and traceback.

    Attributes:
        rank: the rank that failed first (the cause; other ranks usually fail as a consequence).
        remote_type: the name of the remote exception type (``"ValueError"``), or ``"ProcessLost"``.
        remote_message: the remote exception's message.
        remote_traceback: the remote traceback, formatted.
        failures: every failure the driver saw, first the cause.
        exit_code: a script's exit status when the rank's script exited with one (``ScriptExitError``), else
            None.
    """

    def __init__(self, failure: RankFailure, failures: list[RankFailure] | None = None, detail: str = "") -> None:
        self.rank = failure.rank
        self.remote_type = failure.type_name
        self.remote_message = failure.message
        self.remote_traceback = failure.traceback
        self.failures = failures or [failure]
        self.exit_code: int | None = None
        if failure.type_name == "ScriptExitError":
            self.exit_code = int(failure.message.rsplit(" ", 1)[-1])
        text = f"rank {failure.rank} failed: {failure.type_name}: {failure.message}"
        others = [f for f in self.failures if f is not failure]
        if others:
            text += "\nother ranks: " + "; ".join(f.describe() for f in others)
        if failure.traceback:
            text += f"\n--- remote traceback of rank {failure.rank} ---\n{failure.traceback.rstrip()}"
        if detail:
            text += f"\n--- Spark ---\n{detail}"
        super().__init__(text)


@dataclass
class LaunchFailure:
    """The first failed process of a local launch (``spark-hvd-run``)."""

    rank: int
    returncode: int
    #: ``exited with code 3`` or ``was killed by SIGKILL (exit code 137)``.
    description: str = ""
    stderr_tail: list[str] = field(default_factory=list)
