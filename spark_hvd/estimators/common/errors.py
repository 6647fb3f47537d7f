"""The estimators' errors: a bad param, model, loss or column, found on the driver before any Spark job runs.

Every message starts with the estimator's name (``"TorchEstimator: set optimizer, ..."``), so a failure inside a
Pipeline says which stage it came from; :func:`param_error` and :func:`param_type_error` build that prefix. The
types derive from the built-in ``ValueError`` / ``TypeError`` as well as from spark_hvd's root error, so code
that catches either keeps working.
"""

from __future__ import annotations

from typing import Any

from spark_hvd.errors import SparkHvdError

__all__ = ["EstimatorError", "EstimatorParamError", "EstimatorTypeError", "param_error", "param_type_error"]


class EstimatorError(SparkHvdError):
    """An estimator or model cannot run as configured."""


class EstimatorParamError(EstimatorError, ValueError):
    """A param (or the model, loss, or a column it names) has a value the estimator cannot use."""


class EstimatorTypeError(EstimatorError, TypeError):
    """A param holds an object of the wrong type."""


def estimator_name(who: Any) -> str:
    """The name that prefixes a message: ``who`` itself when it is a string, else its class's name."""
    if isinstance(who, str):
        return who
    return who.__name__ if isinstance(who, type) else type(who).__name__


def param_error(who: Any, message: str) -> EstimatorParamError:
    """``"<Estimator>: <message>"`` as an :class:`EstimatorParamError` (``who``: the estimator, its class or
    its name)."""
    return EstimatorParamError(f"{estimator_name(who)}: {message}")


def param_type_error(who: Any, message: str) -> EstimatorTypeError:
    """``"<Estimator>: <message>"`` as an :class:`EstimatorTypeError`."""
    return EstimatorTypeError(f"{estimator_name(who)}: {message}")
