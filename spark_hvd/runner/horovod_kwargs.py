"""The keywords of Horovod's ``horovod.spark.run`` / ``run_elastic`` that spark_hvd's take with Horovod's meaning, and
the ones it refuses, naming what to write instead (checked on the driver before any Spark job).

- ``stdout``, ``stderr``: the ranks' output lines go to these streams, in Horovod's format ``[rank]<stdout>:line``
  (``OutputStreams``), whatever ``verbose`` says; without them the driver prints ``[rank] line`` when
  ``verbose >= 1``.
- ``prefix_output_with_timestamp``: each forwarded line starts with ``time.asctime()``, as Horovod's.
- ``nics``: the network interfaces the ranks use: sets ``SPARK_HVD_NETWORK_INTERFACE`` in the ranks' ``env``.
- ``use_gloo``: the built-in ring is what Horovod's Gloo launch is: True or None is accepted; ``use_mpi=True`` and
  ``extra_mpi_args`` are refused (no ``mpirun`` on Spark), as is ``executable`` (the ranks run in Spark's own
  Python workers: ``PYSPARK_PYTHON`` / ``spark.pyspark.python`` choose it).
- ``min_np``, ``max_np`` (``run_elastic``): Horovod's deprecated names of ``min_num_proc``, ``max_num_proc``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from spark_hvd.core.transport.addresses import NETWORK_INTERFACE_ENV
from spark_hvd.runner.errors import RunnerError

__all__ = ["OutputStreams", "horovod_env", "np_alias"]


@dataclass(frozen=True)
class OutputStreams:
    """Where the driver writes the ranks' output lines: Horovod's ``stdout`` / ``stderr`` streams (None: the
    driver's own, ``[rank] line``, when ``verbose >= 1``), and ``timestamp``: start each line with
    ``time.asctime()`` (Horovod's ``prefix_output_with_timestamp``)."""

    stdout: TextIO | None = None
    stderr: TextIO | None = None
    timestamp: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def stream(self, name: str) -> TextIO | None:
        """The stream given for ``name`` (``"stdout"`` or ``"stderr"``), or None."""
        return self.stderr if name == "stderr" else self.stdout

    def lines(self, rank: int, name: str, text: str, horovod: bool) -> str:
        """``text``'s lines prefixed: ``[rank]<name>:line`` (Horovod's, ``horovod=True``) or ``[rank] line``."""
        stamp = time.asctime() if self.timestamp else ""
        prefix = f"{stamp}[{rank}]<{name}>:" if horovod else f"{stamp}[{rank}] "
        return "".join(f"{prefix}{line}\n" for line in text.splitlines())

    def write(self, rank: int, name: str, text: str) -> bool:
        """Write ``text`` to the stream given for ``name`` in Horovod's format; False when none was given."""
        out = self.stream(name)
        if out is None:
            return False
        with self._lock:
            out.write(self.lines(rank, name, text, horovod=True))
            flush = getattr(out, "flush", None)
            if flush is not None:
                flush()
        return True


def horovod_env(env: dict[str, str] | None, *, use_mpi: bool | None = None, use_gloo: bool | None = None,
                extra_mpi_args: str | None = None, nics: Iterable[str] | None = None,
                executable: str | None = None, what: str = "run") -> dict[str, str] | None:
    """``env`` with what Horovod's launch keywords mean here (``nics``), after refusing those that mean nothing on a
    Spark barrier stage. ``what`` names the function in the messages."""
    if use_mpi:
        raise RunnerError(f"{what}(use_mpi=True): spark_hvd starts no mpirun on Spark; its ranks connect through "
                          "the built-in ring, which is what Horovod's use_gloo=True launch is: leave use_mpi out")
    if use_gloo is False and use_mpi is False:
        raise RunnerError(f"{what}(use_gloo=False, use_mpi=False): one controller must be used; spark_hvd's is the "
                          "built-in ring (Horovod's Gloo): leave both out")
    if extra_mpi_args:
        raise RunnerError(f"{what}(extra_mpi_args={extra_mpi_args!r}): there is no mpirun on Spark to pass them to; "
                          "settings go in env (e.g. env={'SPARK_HVD_FUSION_THRESHOLD': '33554432'}, "
                          "docs/settings.md)")
    if executable is not None:
        raise RunnerError(f"{what}(executable={executable!r}): the ranks run in Spark's own Python workers; choose "
                          "their interpreter with PYSPARK_PYTHON or spark.pyspark.python")
    if nics is None:
        return env
    names = [nics] if isinstance(nics, str) else sorted(str(n) for n in nics)
    if not names or not all(n.strip() for n in names):
        raise RunnerError(f"{what}(nics={nics!r}): give the network interface names, e.g. nics=['eth0']")
    merged = dict(env or {})
    given = merged.get(NETWORK_INTERFACE_ENV)
    joined = ",".join(n.strip() for n in names)
    if given is not None and given != joined:
        raise RunnerError(f"{what}: nics={nics!r} and env[{NETWORK_INTERFACE_ENV!r}]={given!r} disagree; give one")
    merged[NETWORK_INTERFACE_ENV] = joined
    return merged


def np_alias(value: Any, alias: Any, name: str, alias_name: str) -> Any:
    """``value``, or Horovod's deprecated ``alias`` of it when only that is given (both given: they must agree)."""
    if alias is None:
        return value
    if value is not None and value != alias:
        raise RunnerError(f"run_elastic: {name}={value} and {alias_name}={alias} (its deprecated Horovod name) "
                          f"disagree; give {name} only")
    return alias
