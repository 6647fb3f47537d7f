"""TensorFlow's start-up lines kept out of every rank's output.

``import tensorflow`` writes two lines to the process's standard error from C++ before its logging is set up,
whatever ``TF_CPP_MIN_LOG_LEVEL`` says: absl's "All log messages before absl::InitializeLog() ..." and oneDNN's
"oneDNN custom operations are on ..." (twice each, TF 2.21). With one copy per rank they bury what matters.
``dropped_start_lines`` runs a block with file descriptor 2 on a pipe whose lines are passed on at once, except
those. ``quiet_imports`` is where a rank unpickles its function (which imports the frameworks its arguments hold:
a Keras model imports TensorFlow): with ``SPARK_HVD_QUIET_FRAMEWORK_LOGS=1`` in the rank's environment (the
estimators set it) the framework log settings ``QUIET_FRAMEWORK_LOGS`` are applied first unless the environment
has them, and wherever ``TF_CPP_MIN_LOG_LEVEL`` asks for no INFO lines the start-up lines are dropped.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

__all__ = ["QUIET_ENV", "QUIET_FRAMEWORK_LOGS", "TF_START_LINES", "dropped_start_lines", "quiet_imports"]

#: framework log settings an estimator's rank gets unless its environment sets them: TensorFlow's C++ INFO/WARNING
#: lines (oneDNN, CUDA probing, XLA) and gRPC's would repeat on every rank
QUIET_FRAMEWORK_LOGS = {"TF_CPP_MIN_LOG_LEVEL": "2", "GRPC_VERBOSITY": "ERROR"}
#: the variable that asks a rank for ``QUIET_FRAMEWORK_LOGS`` before anything is unpickled there
QUIET_ENV = "SPARK_HVD_QUIET_FRAMEWORK_LOGS"

#: what the dropped lines contain
TF_START_LINES = (b"All log messages before absl::InitializeLog()", b"oneDNN custom operations are on")


def quiet_imports() -> contextlib.AbstractContextManager:
    """``QUIET_FRAMEWORK_LOGS`` applied where ``QUIET_ENV`` asks (unless set); then ``dropped_start_lines()`` where
    TensorFlow is yet to be imported and ``TF_CPP_MIN_LOG_LEVEL`` (1 or more) asks for no INFO lines, else a context
    that does nothing."""
    if os.environ.get(QUIET_ENV) == "1":
        for name, value in QUIET_FRAMEWORK_LOGS.items():
            os.environ.setdefault(name, value)
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip()
    if "tensorflow" in sys.modules or level in ("", "0"):
        return contextlib.nullcontext()
    return dropped_start_lines()


@contextlib.contextmanager
def dropped_start_lines(patterns: tuple[bytes, ...] = TF_START_LINES) -> Iterator[None]:
    """Within the block, lines written to file descriptor 2 that contain one of ``patterns`` are dropped; every
    other line reaches the real standard error as it is written (a thread forwards them)."""
    sys.stderr.flush()
    real = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            for line in iter(pipe.readline, b""):
                if not any(p in line for p in patterns):
                    os.write(real, line)

    thread = threading.Thread(target=forward, name="spark-hvd-start-lines", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # the pipe's last write end closes: the thread reads to the end and stops
        thread.join(5.0)
        if not thread.is_alive():  # a process started in the block may hold the pipe: its lines still go out
            os.close(real)
