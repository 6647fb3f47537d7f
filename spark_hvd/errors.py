"""The root of spark_hvd's exceptions: every error the library raises derives from :class:`SparkHvdError`.

Each layer that has failures of its own keeps them in its ``errors.py``, derived from this class: the core's
(``spark_hvd.core.errors``: a failed peer, a stall, a mismatch ...), the store's (``StoreError``), the data
layer's (``DataError``), the runner's (``RunnerError``) and the estimators' (``spark_hvd.estimators.common.errors``).
This module imports nothing, so a layer reaches its base class without loading another layer.
"""

from __future__ import annotations

__all__ = ["SparkHvdError"]


class SparkHvdError(RuntimeError):
    """Base class of every error raised by spark_hvd (Horovod's ``HorovodInternalError`` is this class)."""
