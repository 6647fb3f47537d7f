"""horovodrun's flags that ``spark-hvd-run`` does not take, each with what to write instead.

A Horovod user's command line (``horovodrun -np 2 --gloo --fusion-threshold-mb 32 python train.py``) would
otherwise get argparse's bare ``unrecognized arguments``. :func:`add_horovod_flags` registers each of them as a
hidden option of the launcher's parser whose use is an error of one line naming the flag and its spark_hvd
equivalent (an ``--env`` setting, a launcher, a Python call, or nothing to do), with the flag's value filled in
where the command line gave one. Flags after the command belong to the command and are left alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from spark_hvd.core.settings import Settings

__all__ = ["HOROVOD_FLAGS", "add_horovod_flags", "horovod_flag_hint"]

_ELASTIC = ("elastic training runs on Spark: spark_hvd.runner.run_elastic(fn, num_proc=..., min_num_proc=..., "
            "max_num_proc=..., elastic_timeout=..., reset_limit=...) (docs/elastic.md); spark-hvd-run has a fixed "
            "number of ranks")
_AUTOTUNE_SEARCH = ("no equivalent: spark_hvd's autotune searches a small grid of cycle times and fusion thresholds, "
                    "not by Bayesian optimisation (docs/settings.md, Autotune); drop the flag")
_HIERARCHICAL = ("nothing to set: ranks on one host always reduce through shared memory first, then across hosts "
                 "(--env SPARK_HVD_SHM=0 turns shared memory off)")
_MPI = ("to run on MPI, start the script with mpirun itself (mpirun -np 2 python train.py: the MPI backend is "
        "chosen by itself) and give MPI's options there")
_TIMESTAMP = "no equivalent: every output line is prefixed with its [rank]; drop the flag"
_NONE = "no spark_hvd equivalent; drop the flag"


def _setting(var: str, unit: str = "", scale: float | None = None) -> Callable[[str | None], str]:
    """A pointer to ``--env VAR=value``, the value taken from the command line where it gave one."""

    def hint(value: str | None) -> str:
        shown = "<value>"
        if value is not None:
            try:
                shown = str(int(float(value) * scale)) if scale else value
            except ValueError:
                shown = value
        alias = {env: alias for env, alias, _, _ in Settings.describe()}.get(var)
        also = f"; {alias} is read too" if alias else ""
        return f"--env {var}={shown}{f' ({unit})' if unit else ''}{also} (docs/settings.md)"

    return hint


#: flag -> (how many values it takes, the pointer: a text, or a function of the flag's value)
HOROVOD_FLAGS: dict[str, tuple[int, str | Callable[[str | None], str]]] = {
    "--gloo": (0, "nothing to set: spark_hvd's own TCP ring plays gloo's part and is the default "
                      "(--env SPARK_HVD_BACKEND=torch uses torch.distributed's gloo instead)"),
    "--mpi": (0, _MPI),
    "--jsrun": (0, _MPI),
    "--mpi-args": (1, _MPI),
    "--binding-args": (1, _MPI),
    "--mpi-threads-disable": (0, _MPI),
    "--no-mpi-threads-disable": (0, _MPI),
    "--tcp": (0, "nothing to set: the ring is TCP between hosts (--env SPARK_HVD_SHM=0 turns off shared "
                     "memory within a host too)"),
    "--fusion-threshold-mb": (1, _setting("SPARK_HVD_FUSION_THRESHOLD", "bytes, not MB", 1024 * 1024)),
    "--cycle-time-ms": (1, _setting("SPARK_HVD_CYCLE_TIME", "milliseconds")),
    "--cache-capacity": (1, _setting("SPARK_HVD_CACHE_CAPACITY")),
    "--timeline-filename": (1, _setting("SPARK_HVD_TIMELINE", "a path")),
    "--timeline-mark-cycles": (0, "nothing to set: every negotiation round is on the timeline (ROUND, row "
                                      "'engine')"),
    "--no-timeline-mark-cycles": (0, _NONE),
    "--no-stall-check": (0, "--env SPARK_HVD_STALL_CHECK_TIME=0 (docs/settings.md)"),
    "--stall-check": (0, "nothing to set: the stall check is on by default"),
    "--stall-check-warning-time-seconds": (1, _setting("SPARK_HVD_STALL_CHECK_TIME", "seconds")),
    "--stall-check-shutdown-time-seconds": (1, _setting("SPARK_HVD_STALL_SHUTDOWN_TIME", "seconds")),
    "--gloo-timeout-seconds": (1, _setting("SPARK_HVD_TIMEOUT", "seconds")),
    "--autotune": (0, "--env SPARK_HVD_AUTOTUNE=1; HOROVOD_AUTOTUNE is read too (docs/settings.md)"),
    "--no-autotune": (0, "nothing to set: autotune is off by default"),
    "--autotune-log-file": (1, _setting("SPARK_HVD_AUTOTUNE_LOG", "a path")),
    "--autotune-warmup-samples": (1, _setting("SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES")),
    "--autotune-steps-per-sample": (1, _setting("SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE")),
    "--autotune-bayes-opt-max-samples": (1, _AUTOTUNE_SEARCH),
    "--autotune-gaussian-process-noise": (1, _AUTOTUNE_SEARCH),
    "--hierarchical-allreduce": (0, _HIERARCHICAL),
    "--no-hierarchical-allreduce": (0, _HIERARCHICAL),
    "--hierarchical-allgather": (0, _HIERARCHICAL),
    "--no-hierarchical-allgather": (0, _HIERARCHICAL),
    "--num-nccl-streams": (1, _NONE),
    "--thread-affinity": (1, _NONE),
    "--log-level": (1, "spark_hvd logs through Python's logging: logging.getLogger('spark_hvd').setLevel(...) "
                          "in the script"),
    "--log-with-timestamp": (0, _TIMESTAMP),
    "--log-without-timestamp": (0, _TIMESTAMP),
    "--log-hide-timestamp": (0, _TIMESTAMP),
    "--no-log-hide-timestamp": (0, _TIMESTAMP),
    "-prefix-timestamp": (0, _TIMESTAMP),
    "--prefix-output-with-timestamp": (0, _TIMESTAMP),
    "--output-filename": (1, "no equivalent: every output line is prefixed with its [rank]; redirect "
                                "spark-hvd-run's own output to a file"),
    "--config-file": (1, "no config file: give each setting with --env SPARK_HVD_...=value (docs/settings.md)"),
    "--disable-cache": (0, "nothing to set: spark-hvd-run caches no start-up checks"),
    "-cb": (0, "nothing is built: spark_hvd.torch's mpi_built(), nccl_built() (and the Keras ones) tell at run "
                   "time"),
    "--check-build": (0, "nothing is built: spark_hvd.torch's mpi_built(), nccl_built() (and the Keras ones) "
                             "tell at run time"),
    "--min-np": (1, _ELASTIC),
    "--min-num-proc": (1, _ELASTIC),
    "--max-np": (1, _ELASTIC),
    "--max-num-proc": (1, _ELASTIC),
    "--slots-per-host": (1, _ELASTIC),
    "--elastic-timeout": (1, _ELASTIC),
    "--reset-limit": (1, _ELASTIC),
    "--blacklist-cooldown-range": (2, _ELASTIC),
    "--host-discovery-script": (1, _ELASTIC),
}


def horovod_flag_hint(flag: str, values: Sequence[str] | str | None = None) -> str:
    """The one-line message for the horovodrun flag ``flag`` given with ``values`` (None: none given)."""
    value = values if isinstance(values, str) or values is None else " ".join(values) or None
    pointer = HOROVOD_FLAGS[flag][1]
    text = pointer(value) if callable(pointer) else pointer
    return f"{flag} is a horovodrun flag that spark-hvd-run does not take; instead: {text}"


class _HorovodFlag(argparse.Action):
    """Using the flag is an error naming its spark_hvd equivalent."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(horovod_flag_hint(option_string or self.option_strings[0], values))


def add_horovod_flags(parser: argparse.ArgumentParser) -> None:
    """Register every flag of :data:`HOROVOD_FLAGS` on ``parser``, hidden from ``--help``."""
    for flag, (nargs, _) in HOROVOD_FLAGS.items():
        parser.add_argument(flag, action=_HorovodFlag, nargs=nargs or 0, dest="horovod_flag", default=None,
                            help=argparse.SUPPRESS)
