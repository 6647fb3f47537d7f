"""Exception types of the ring core. Every message says what failed, where (rank, tensor) and what to do."""

from __future__ import annotations

from spark_hvd.errors import SparkHvdError

__all__ = ["SparkHvdError", "NotInitializedError", "AuthenticationError", "PeerFailureError", "CollectiveTimeoutError",
           "TensorMismatchError", "StallError", "ShutdownError"]


class NotInitializedError(SparkHvdError, ValueError):
    """A collective or a query (rank, size, ...) was used before ``init()``."""

    def __init__(self, what: str = "this function") -> None:
        super().__init__(f"spark_hvd has not been initialized; call hvd.init() before using {what}.")


class AuthenticationError(SparkHvdError):
    """A frame whose HMAC does not match the job's secret (never unpickled)."""


class PeerFailureError(SparkHvdError):
    """A peer rank died, closed its connection or did not answer within the timeout.

    Attributes:
        rank: the rank that failed (or ``None`` when it could not be told).
        operation: the collective or step that was under way.
    """

    def __init__(self, message: str, rank: int | None = None, operation: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.operation = operation


class CollectiveTimeoutError(PeerFailureError):
    """A collective waited longer than ``SPARK_HVD_TIMEOUT`` seconds for a peer."""


class TensorMismatchError(SparkHvdError):
    """The same tensor name was submitted with a different shape, dtype or op on different ranks."""

    def __init__(self, message: str, name: str | None = None, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.ranks = ranks or []


class StallError(SparkHvdError):
    """Some ranks never submitted a tensor that others did, for ``SPARK_HVD_STALL_SHUTDOWN_TIME`` seconds.

    Attributes:
        name: the stalled tensor (the oldest one when several stalled).
        ranks: the ranks that did not submit it.
    """

    def __init__(self, message: str, name: str | None = None, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.ranks = ranks or []


class ShutdownError(SparkHvdError):
    """The engine was shut down while an operation was pending."""
