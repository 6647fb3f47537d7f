"""Exception types of the store layer."""

from __future__ import annotations

from spark_hvd.errors import SparkHvdError


class StoreError(SparkHvdError):
    """A store operation failed: the message names the URL or path and what to do."""


class StoreURLError(StoreError, ValueError):
    """A URL that no store understands, or storage options that do not fit it."""


class StoreTimeoutError(StoreError, TimeoutError):
    """Files expected in the store did not become visible within the timeout."""
